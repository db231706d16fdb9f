"""DeepSeek-V4 (DeepseekV4ForCausalLM) against transformers on the same weights (CPU, float32):
tiny models made by transformers (tests/v4_harness.py: several layer_types orders, hc_mult 2 and
4, hash and top-k routing, YaRN, prompts longer than the window and several compression blocks).

Logits of a ragged prefill and of decode steps through the paged cache within 1e-4 of
transformers' (seen: under 1e-6). The engine's greedy tokens equal transformers' `generate` with
async scheduling, chunked prefill in chunks shorter than a compression block, prefix caching and
preemption from a small pool at once: the compressor's partial windows live in the cache rows, so
they carry across steps, chunks and recomputation. Dummy weights: the tiny preset through the
engine, DeepSeek-V4-Flash's shape built on the meta device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_harness import load_hf, max_logit_diff, run_prefill_and_decode
from v4_harness import NAMES, build_v4_folder

from atomrt.runtime import SamplingParams
from atomrt.runtime.config import Config, ModelConfig
from atomrt.workers.layers.attention import collect_attention_layers
from atomrt.workers.loading.loader import build_model, load_model, read_arch
from atomrt.workers.runner.kv_cache import kv_layer_specs, kv_sizes_by_kind

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
PROMPTS = [
    [3, 17, 42, 99, 5, 8, 61, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [7, 1, 120],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 40, 50, 60],
]
# Engine prompts: two share a 16-token prefix (four blocks of 4: prefix caching), lengths 2-26
SHARED = [5, 9, 14, 2, 77, 31, 8, 150, 66, 4, 12, 90, 33, 44, 55, 66]
ENGINE_PROMPTS = [
    SHARED + [7, 3, 9, 10, 11],
    list(range(21, 47)),
    [8, 6],
    SHARED + [101, 102, 103, 104],
    [60, 61, 62, 63, 64, 65, 66],
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: build_v4_folder(tmp_path_factory.mktemp(name), name) for name in NAMES}


def hf_greedy(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    hf_model = load_hf(folder)
    out = []
    for prompt in prompts:
        with torch.no_grad():
            ids = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
            )
        out.append(ids[0, len(prompt) :].tolist())
    return out


@pytest.mark.parametrize("name", NAMES)
def test_tiny_v4_logits_match_transformers(folders: dict[str, Path], name: str) -> None:
    loaded = load_model(Config(model=str(folders[name])), "cpu", torch.float32)
    assert loaded.arch.v4 is not None and loaded.arch.is_moe
    result = run_prefill_and_decode(loaded.model, PROMPTS, 12, block_size=4, num_pad_rows=2)
    worst = max_logit_diff(result, load_hf(folders[name]), PROMPTS)
    assert worst <= TOLERANCE, f"{name}: max |logits - transformers| = {worst:.3g}"


def _engine_tokens(folder: Path, **kwargs) -> tuple[list[list[int]], dict]:
    """Greedy tokens through the engine: 4-token blocks, a 3-row step budget (prefill chunks
    shorter than a compression block), 12 blocks (fewer than the requests need at once:
    preemption), prefix caching, async scheduling; returns them with what happened."""
    from atomrt.runtime.entrypoints.llm import LLM

    settings = dict(
        device="cpu",
        enforce_eager=True,
        block_size=4,
        num_kv_blocks=12,
        max_num_seqs=8,
        max_num_batched_tokens=3,
        async_scheduling=True,
    )
    llm = LLM(str(folder), **{**settings, **kwargs})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        llm.generate(ENGINE_PROMPTS[:1], params)  # fills the prefix cache with the shared blocks
        outs = llm.generate(ENGINE_PROMPTS, params)
        seen = dict(
            preemptions=sum(o.metrics.num_preemptions for o in outs),
            prefix_hits=llm.engine.schedulers[0].block_manager.num_prefix_hit_tokens,
        )
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], seen


@pytest.mark.parametrize("name", NAMES)
def test_engine_greedy_tokens_equal_transformers_generate(
    folders: dict[str, Path], name: str
) -> None:
    expected = hf_greedy(folders[name], ENGINE_PROMPTS, MAX_TOKENS)
    got, seen = _engine_tokens(folders[name])
    assert got == expected
    assert seen["preemptions"] > 0 and seen["prefix_hits"] >= len(SHARED), seen


def test_cache_is_sized_per_layer_type(folders: dict[str, Path]) -> None:
    """One spec per layer, the kinds the layer types; a row per token holds the window's key, and
    for compressed layers the compressor's projections and the entry (CSA: the indexer's too)."""
    loaded = load_model(Config(model=str(folders["csa_hca"])), "cpu", torch.float32)
    specs = kv_layer_specs(collect_attention_layers(loaded.model))
    sizes = {
        s.kind: (s.num_layers, s.bytes_per_token) for s in kv_sizes_by_kind(specs, torch.float32)
    }
    d, di = 32, 16  # head_dim, index_head_dim
    csa = d + 2 * (2 * d) + d + 2 * (2 * di) + di
    hca = d + 2 * d + d
    assert sizes == {
        "sliding_attention": (1, 4 * d),
        "compressed_sparse_attention": (2, 2 * 4 * csa),
        "heavily_compressed_attention": (1, 4 * hca),
    }


def test_tiny_preset_runs_with_dummy_weights() -> None:
    from atomrt.runtime.entrypoints.llm import LLM

    llm = LLM(
        "tiny-deepseek-v4",
        load_format="dummy",
        device="cpu",
        enforce_eager=True,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=8,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        outs = llm.generate([list(range(3, 40)), [5, 6, 7]], params)
    finally:
        llm.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]


def test_flash_preset_shape_on_meta() -> None:
    """DeepSeek-V4-Flash's shape for dummy weights, its first layers kept by hf_overrides."""
    config = Config(
        model="DeepSeek-V4-Flash",
        model_config=ModelConfig(load_format="dummy", hf_overrides={"num_hidden_layers": 3}),
    )
    arch = read_arch(config)
    assert arch.num_layers == 3 and arch.head_dim == 512 and arch.v4.hc_mult == 4
    assert arch.v4.layer_types == ("heavily_compressed_attention",) * 2 + (
        "heavily_compressed_attention",
    )
    assert arch.v4.qk_rope_head_dim == 64 and arch.v4.compress_rope_scaling["factor"] == 16.0
    model = build_model(arch, "meta", torch.bfloat16)
    attn = model.layers[0].attn
    assert tuple(attn.wq_b.weight.shape) == (64 * 512, 1024)
    assert tuple(attn.wo_a.weight.shape) == (8 * 1024, 64 * 512 // 8)
    assert len(model.layers[2].ffn.experts) == 256
    assert model.layers[0].ffn.gate.hashed and not hasattr(model.layers[0].ffn.gate, "bias")


def test_config_errors_name_the_field(folders: dict[str, Path]) -> None:
    from atomrt.workers.loading.loader import read_hf_config
    from atomrt.workers.models.arch import arch_from_hf_config

    cfg = read_hf_config(folders["csa_hca"])
    with pytest.raises(ValueError, match="layer_types"):
        arch_from_hf_config({**cfg, "layer_types": ["full_attention"] * 4}, "here")
    with pytest.raises(ValueError, match="o_groups"):
        arch_from_hf_config({**cfg, "o_groups": 3}, "here")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        build_model(arch_from_hf_config(cfg, "here"), "meta", torch.float32, _tp(2))


def _tp(size: int):
    from atomrt.distributed.communication_op import TPInfo

    return TPInfo(0, size)

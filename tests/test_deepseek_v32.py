"""DeepSeek-V3.2 (DeepseekV32ForCausalLM: MLA whose queries attend only the tokens its lightning
indexer picks) and GLM-5 (GlmMoeDsaForCausalLM: the same with interleaved indexer rotary and
layers that reuse the previous indexer layer's picks) against transformers on the same weights (CPU, float32), tiny models from
tests/dsa_harness.py: logits of a ragged prefill and decode steps through the paged cache within
1e-4 of transformers' (seen under 1e-6); the engine's greedy tokens equal `generate`'s with async
scheduling, chunked prefill, prefix caching and preemption.

On these weights transformers' `generate` and a full recompute of the same sequence agree (the
indexer's 16 heads leave no ties); atomrt follows the formulas, which both are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dsa_harness import NAMES, build_dsa_folder
from model_harness import (
    hf_greedy,
    load_hf,
    max_logit_diff,
    record_as_request_graphs,
    run_prefill_and_decode,
)
from test_deepseek_v4 import ENGINE_PROMPTS, MAX_TOKENS, PROMPTS, SHARED, _engine_tokens

from atomrt.runtime.config import CompilationConfig, Config
from atomrt.workers.layers.attention import collect_attention_layers
from atomrt.workers.loading.loader import load_model
from atomrt.workers.runner.kv_cache import kv_layer_specs, kv_sizes_by_kind

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: build_dsa_folder(tmp_path_factory.mktemp(name), name) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_tiny_v32_logits_match_transformers(folders: dict[str, Path], name: str) -> None:
    loaded = load_model(Config(model=str(folders[name])), "cpu", torch.float32)
    assert loaded.arch.index_n_heads == 16 and loaded.arch.is_mla
    assert loaded.arch.index_shared_layers == ((1, 3) if name == "glm5" else ())
    result = run_prefill_and_decode(loaded.model, PROMPTS, 8, block_size=4, num_pad_rows=2)
    worst = max_logit_diff(result, load_hf(folders[name]), PROMPTS)
    assert worst <= 1e-4, f"{name}: max |logits - transformers| = {worst:.3g}"
    specs = kv_layer_specs(collect_attention_layers(loaded.model))
    (size,) = kv_sizes_by_kind(specs, torch.float32)
    # the latent row, and the indexer's key where the layer has an indexer
    width = 4 * (2 * (32 + 8 + 16) + 2 * (32 + 8)) if name == "glm5" else 3 * 4 * (32 + 8 + 16)
    assert (size.kind, size.bytes_per_token) == ("dsa_mla", width)


def test_graph_safe_prefix_picks_the_slots_every_slot_picks(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `GRAPH_SAFE_PREFIX` a graph-safe step's indexer layers pick, row by row, layer by layer
    and step by step, the slots the scores of every slot of the block table and torch's top-k
    pick (both through the indexer's kernel, here under the interpreter): a row's positions up
    to its own, none past it, whatever the ragged prefill and the padded rows."""
    from atomrt.workers.layers import dsa_mla

    monkeypatch.setattr(dsa_mla, "_GRAPH_SAFE_CHUNK", 3)
    monkeypatch.setattr(dsa_mla, "USE_KERNELS_ON_CPU", True)
    record_as_request_graphs(monkeypatch)
    attend = dsa_mla._attend_graph_safe
    runs: dict[bool, list[list[list[int]]]] = {False: [], True: []}
    for prefix in (False, True):
        monkeypatch.setattr(dsa_mla, "GRAPH_SAFE_PREFIX", prefix)

        def logged(layer, md, *args, prefix=prefix):  # type: ignore[no-untyped-def]
            attend(layer, md, *args)
            if layer.indexer is not None:
                slots, picked = dsa_mla._LAST_PICKS[(id(md), "graph_safe")]
                live = int(md.cu_seqlens_q[-1])
                rows = torch.where(picked, slots, -1)[:live].sort(dim=1).values
                runs[prefix].append(rows.tolist())

        monkeypatch.setattr(dsa_mla, "_attend_graph_safe", logged)
        loaded = load_model(Config(model=str(folders["v32"])), "cpu", torch.float32)
        run_prefill_and_decode(loaded.model, PROMPTS, 3, block_size=4, num_pad_rows=2)
    assert len(runs[True]) == len(runs[False]) > 0
    assert runs[True] == runs[False]
    assert any(-1 in row for step in runs[True] for row in step)  # a row sees fewer than k


# level 3 compiles for about 19 s on a 2-core CPU: `slow`, beside the GPU tier's real shapes at
# level 3 (tests/gpu/test_deepseek_gpu.py)
ENGINE_CASES = [pytest.param(name, False, id=f"{name}-level0") for name in NAMES] + [
    pytest.param("glm5", True, id="glm5-level3", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,level3", ENGINE_CASES)
def test_engine_greedy_tokens_equal_transformers_generate(
    folders: dict[str, Path], name: str, level3: bool, tmp_path: Path
) -> None:
    """Level 3 (pieces run as traced) splits at the sparse MLA op."""
    expected = hf_greedy(folders[name], ENGINE_PROMPTS, MAX_TOKENS)
    extra = {}
    if level3:
        cc = CompilationConfig(level=3, cache_dir=str(tmp_path), use_inductor=False)
        extra = dict(enforce_eager=False, compilation_config=cc)
    got, seen = _engine_tokens(folders[name], **extra)
    assert got == expected
    assert seen["preemptions"] > 0 and seen["prefix_hits"] >= len(SHARED), seen


@pytest.mark.slow  # 12 s on a 2-core CPU; MLA's TP split: tests/test_deepseek_parallel.py
def test_tensor_parallel_tokens_equal_transformers_generate(folders: dict[str, Path]) -> None:
    """TP = 2 over mp processes: MLA's query heads and kv_b_proj split, the indexer whole on each
    rank (every rank picks the same tokens)."""
    expected = hf_greedy(folders["glm5"], ENGINE_PROMPTS, MAX_TOKENS)
    got, _ = _engine_tokens(
        folders["glm5"], tensor_parallel_size=2, executor="mp", worker_timeout_s=90.0
    )
    assert got == expected


def test_recording_plan(folders: dict[str, Path]) -> None:
    """What a TR_HYBRID bucket records, on the CPU with a logging segment backend: the compiled
    backbone is the unit, each layer's sparse attention (`_dsa_attend`) its one eager region,
    so num_layers + 1 segments; both phases record (unlike DeepSeek-V4)."""
    from v4_harness import record_decode_step

    from atomrt.graphs.markers import token_graph_units
    from atomrt.workers.runner.graph_runner import recorded_phases

    model = load_model(Config(model=str(folders["glm5"])), "cpu", torch.float32).model
    (unit,) = token_graph_units(model)
    assert unit is model.model and recorded_phases(model) == (False, True)
    graph = record_decode_step(model, unit, [PROMPTS[0], PROMPTS[2]], [])
    num_layers = model.arch.num_layers
    assert graph.num_segments(2, "decode") == num_layers + 1
    calls = graph._recordings[(2, None)].eager_calls
    assert [(c.fn.__name__, c.args[-1]) for c in calls] == [
        ("_dsa_attend", i) for i in range(num_layers)
    ]


def test_v32_preset_shape_on_meta() -> None:
    """DeepSeek-V3.2's shape for dummy weights (its first layers kept by hf_overrides)."""
    from atomrt.runtime.config import ModelConfig
    from atomrt.workers.loading.loader import build_model, read_arch

    config = Config(
        model="DeepSeek-V3.2",
        model_config=ModelConfig(load_format="dummy", hf_overrides={"num_hidden_layers": 4}),
    )
    arch = read_arch(config)
    assert (arch.index_n_heads, arch.index_head_dim, arch.index_topk) == (64, 128, 2048)
    attn = build_model(arch, "meta", torch.bfloat16).model.layers[3].self_attn
    assert tuple(attn.indexer.wq_b.weight.shape) == (64 * 128, 1536)
    # q_lora_rank, the latent (512 + 64), the indexer's key and head weights: one GEMM
    assert attn.fused_qkv_a_proj.weight.shape[0] == 1536 + 576 + 128 + 64


def test_glm5_preset_is_transformers_glm5_on_meta() -> None:
    """The GLM-5 preset's first 4 layers (3 dense, 1 MoE) hold the weights of transformers'
    GlmMoeDsaForCausalLM at its default config (zai-org/GLM-5's) with 4 layers: as many parameters,
    the routing's correction bias aside (a buffer there), and every indexer its own."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from atomrt.runtime.config import ModelConfig
    from atomrt.workers.loading.loader import build_model, read_arch

    config = Config(
        model="GLM-5",
        model_config=ModelConfig(load_format="dummy", hf_overrides={"num_hidden_layers": 4}),
    )
    arch = read_arch(config)
    assert arch.architecture == "GlmMoeDsaForCausalLM" and arch.index_shared_layers == ()
    reference = GlmMoeDsaConfig(num_hidden_layers=4)
    assert (arch.index_n_heads, arch.index_head_dim, arch.index_topk) == (
        reference.index_n_heads,
        reference.index_head_dim,
        reference.index_topk,
    )
    model = build_model(arch, "meta", torch.bfloat16)
    with torch.device("meta"):
        theirs = GlmMoeDsaForCausalLM(reference)
    moe_layers = reference.num_hidden_layers - reference.first_k_dense_replace
    ours = sum(p.numel() for p in model.parameters())
    assert ours == sum(p.numel() for p in theirs.parameters()) + moe_layers * 256


def test_long_prompt_attends_in_query_chunks(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's query rows score and attend in chunks (bounded memory), the shared layers'
    picks assembled whole: 3-row chunks give transformers' logits."""
    from atomrt.workers.layers import dsa_mla

    monkeypatch.setattr(dsa_mla, "_QUERY_CHUNK", 3)
    loaded = load_model(Config(model=str(folders["glm5"])), "cpu", torch.float32)
    result = run_prefill_and_decode(loaded.model, PROMPTS, 2, block_size=4)
    assert max_logit_diff(result, load_hf(folders["glm5"]), PROMPTS) <= 1e-4


@pytest.mark.parametrize("index_dim", [0, 24], ids=["shared-topk", "indexer-key"])
def test_cache_write_kernel_skips_padded_rows_as_the_masked_copy(index_dim: int) -> None:
    """The write a CUDA recording runs (MLA's write kernel over [latent | k_pe | the indexer's
    key], here through Triton's interpreter: nothing waits for the device) leaves the cache as the
    CPU's masked copy (MLA's reference write, what `_write_rows` runs on the CPU) does: the rows at
    their slots, the negative slots' rows nowhere, every other slot untouched. Widths not powers
    of 2."""
    from atomrt.workers.kernels.attention.mla_write import mla_write_kv_cache
    from atomrt.workers.layers.dsa_mla import _write_rows

    gen = torch.Generator().manual_seed(5)
    lora, rope, blocks, block_size = 40, 12, 3, 4
    rows = torch.randn(6, lora + rope + index_dim, generator=gen)
    slots = torch.tensor([5, -1, 11, 0, -1, 7])
    caches = [torch.full((blocks, block_size, rows.shape[1]), float("nan")) for _ in range(2)]
    mla_write_kv_cache(rows[:, :lora], rows[:, lora:], caches[0], slots)
    _write_rows(rows, caches[1], slots, lora)
    kernel_cache, masked_cache = (c.view(-1, rows.shape[1]) for c in caches)
    assert torch.equal(kernel_cache[slots[slots >= 0]], rows[slots >= 0])
    assert torch.equal(kernel_cache.isnan(), masked_cache.isnan())
    assert torch.equal(kernel_cache.nan_to_num(), masked_cache.nan_to_num())
    assert int((~kernel_cache.isnan().all(-1)).sum()) == 4


# "prefix" is `slow` (about 27 s for both models; the picks test below runs by default)
@pytest.mark.parametrize(
    "scores", ["torch", "kernel", pytest.param("prefix", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("name", ["v32", "glm5"])
def test_graph_safe_attention_matches_transformers(
    folders: dict[str, Path], name: str, scores: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a request graph's metadata (FULL records the step inline; a read of the host copies
    of the lengths fails the test) the sparse attention is planned from shapes alone: every slot
    a row's block table holds is scored, the top-k kept, attended with absorbed weights. A ragged
    prefill, padded rows and decode steps, in 3-row chunks, give transformers' logits; the
    indexer's scores by torch (CPU's) or by CUDA's Triton kernel, here under the interpreter, or
    (`GRAPH_SAFE_PREFIX`) each row's positions up to its own scored and ranked by the kernels of
    workers/kernels/v4/v4_index.py."""
    from atomrt.workers.layers import dsa_mla

    monkeypatch.setattr(dsa_mla, "_GRAPH_SAFE_CHUNK", 3)
    monkeypatch.setattr(dsa_mla, "USE_KERNELS_ON_CPU", scores != "torch")
    monkeypatch.setattr(dsa_mla, "GRAPH_SAFE_PREFIX", scores == "prefix")
    loaded = load_model(Config(model=str(folders[name])), "cpu", torch.float32)
    record_as_request_graphs(monkeypatch)
    result = run_prefill_and_decode(loaded.model, PROMPTS, 6, block_size=4, num_pad_rows=2)
    worst = max_logit_diff(result, load_hf(folders[name]), PROMPTS)
    assert worst <= 1e-4, f"{name}: max |logits - transformers| = {worst:.3g}"

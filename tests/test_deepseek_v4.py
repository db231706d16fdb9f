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

import contextlib
import json
from pathlib import Path
from typing import Optional

import pytest
import torch
from kernel_device import DEVICE
from model_harness import (
    engine_greedy,
    hf_greedy,
    load_hf,
    max_logit_diff,
    record_as_request_graphs,
    run_prefill_and_decode,
)
from v4_harness import NAMES, build_v4_folder

from atomrt import SamplingParams
from atomrt.compile import compilation_counter
from atomrt.distributed.communication_op import DPInfo, TPInfo
from atomrt.runtime.config import CompilationConfig, Config, ModelConfig
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


@pytest.mark.parametrize("name", NAMES)
def test_tiny_v4_logits_match_transformers(folders: dict[str, Path], name: str) -> None:
    loaded = load_model(Config(model=str(folders[name])), "cpu", torch.float32)
    assert loaded.arch.v4 is not None and loaded.arch.is_moe
    result = run_prefill_and_decode(loaded.model, PROMPTS, 12, block_size=4, num_pad_rows=2)
    worst = max_logit_diff(result, load_hf(folders[name]), PROMPTS)
    assert worst <= TOLERANCE, f"{name}: max |logits - transformers| = {worst:.3g}"


def _engine_tokens(folder: Path, **kwargs) -> tuple[list[list[int]], dict]:
    """Greedy tokens through the engine: 4-token blocks, a 3-row step budget (prefill chunks
    shorter than a compression block), 10 blocks (fewer than the requests need at once, the
    window's blocks returned: preemption), prefix caching, async scheduling; returns them with
    what happened."""
    settings = dict(
        device="cpu",
        enforce_eager=True,
        block_size=4,
        num_kv_blocks=10,
        max_num_seqs=8,
        max_num_batched_tokens=3,
        async_scheduling=True,
    )
    return engine_greedy(folder, ENGINE_PROMPTS, MAX_TOKENS, **{**settings, **kwargs})


# (model, None for level 0 / False for level 3 pieces run as traced / True for Inductor's)
ENGINE_CASES = [pytest.param(name, None, id=f"{name}-level0") for name in NAMES] + [
    pytest.param("csa_hca", False, id="csa_hca-level3"),
    pytest.param("hca_first", True, id="hca_first-level3-inductor", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,inductor", ENGINE_CASES)
def test_engine_greedy_tokens_equal_transformers_generate(
    folders: dict[str, Path], name: str, inductor, tmp_path: Path
) -> None:
    """Level 3 splits at the compressor launch and the attention op: a piece between each two."""
    expected = hf_greedy(folders[name], ENGINE_PROMPTS, MAX_TOKENS)
    level3 = {}
    if inductor is not None:
        cc = CompilationConfig(level=3, cache_dir=str(tmp_path), use_inductor=inductor)
        level3 = dict(enforce_eager=False, compilation_config=cc)
    compilation_counter.reset()
    got, seen = _engine_tokens(folders[name], **level3)
    assert got == expected
    assert seen["preemptions"] > 0 and seen["prefix_hits"] >= len(SHARED), seen
    if inductor is not None:
        types = json.loads((folders[name] / "config.json").read_text())["layer_types"]
        ops = sum(1 if t == "sliding_attention" else 2 for t in types)
        assert compilation_counter.num_piecewise_graphs_seen == 2 * ops + 1


def test_window_blocks_return_to_the_pool(folders: dict[str, Path]) -> None:
    """A long generation: as it runs, its blocks behind the window (and the compressors' reach)
    return to the pool, each group's first block kept for the compressed entries (block counts
    observed at every allocation); the tokens stay transformers' `generate`'s."""
    from atomrt.runtime.entrypoints.llm import LLM

    folder, prompt, max_tokens = folders["csa_hca"], ENGINE_PROMPTS[1], 40
    expected = hf_greedy(folder, [prompt], max_tokens)
    llm = LLM(str(folder), device="cpu", enforce_eager=True, block_size=4, num_kv_blocks=64)
    bm = llm.engine.schedulers[0].block_manager
    seen = []
    append_slots = bm.append_slots

    def observed(seq, num_new_tokens: int) -> None:
        append_slots(seq, num_new_tokens)
        seen.append((len(seq.block_table), bm.num_used_blocks))

    bm.append_slots = observed  # observes the real block manager's counts
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == expected[0]
    assert bm.window is not None and bm.window.free_behind and bm.num_window_freed_blocks > 0
    table, held = seen[-1]  # 66 tokens: 17 blocks of 4; held: every 4th and the last reach's
    assert table == 17 and held <= 7, seen
    assert [h for _, h in seen] != sorted(h for _, h in seen)  # the count went down on the way


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
    model = build_model(arch, "meta", torch.bfloat16).model
    attn = model.layers[0].attn
    assert tuple(attn.wq_b.weight.shape) == (64 * 512, 1024)
    assert tuple(attn.wo_a.weight.shape) == (8 * 1024, 64 * 512 // 8)
    assert tuple(model.layers[2].ffn.w13.shape) == (256, 2 * 2048, 4096)
    assert model.layers[0].ffn.gate.hashed and not hasattr(model.layers[0].ffn.gate, "bias")


def test_config_errors_name_the_field(folders: dict[str, Path]) -> None:
    from atomrt.workers.loading.loader import read_hf_config
    from atomrt.workers.models.registry import arch_from_hf_config

    cfg = read_hf_config(folders["csa_hca"])
    with pytest.raises(ValueError, match="layer_types"):
        arch_from_hf_config({**cfg, "layer_types": ["full_attention"] * 4}, "here")
    with pytest.raises(ValueError, match="o_groups"):
        arch_from_hf_config({**cfg, "o_groups": 3}, "here")
    from atomrt.runtime.config import SpeculativeConfig

    arch = arch_from_hf_config(cfg, "here")
    mtp = Config(
        model=str(folders["csa_hca"]),
        speculative_config=SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 1}),
    )
    from atomrt.workers.loading.loader import load_mtp_layers

    target = build_model(arch, "meta", torch.float32, config=mtp)  # the target holds no MTP layer
    with pytest.raises(ValueError, match="speculative_config.method 'mtp'"):
        load_mtp_layers(target, mtp, "meta", torch.float32)  # the drafter's, of which it has none
    with pytest.raises(ValueError, match="num_attention_heads: 4 is not divisible by tensor"):
        build_model(arch, "meta", torch.float32, _tp(3))
    with pytest.raises(ValueError, match="moe_intermediate_size: 32 is not divisible"):
        build_model(arch, "meta", torch.float32, _tp(2), dp=DPInfo(0, 32))


def _tp(size: int) -> TPInfo:
    return TPInfo(0, size)


# (executor, tensor_parallel_size, data_parallel_size, enable_tbo)
LAYOUTS = [
    pytest.param("mp", 2, 1, "none", id="mp-tp2"),
    pytest.param("mp", 1, 2, "none", id="mp-dp2"),
    pytest.param("mp", 1, 2, "all", id="mp-dp2-tbo_all"),
    pytest.param("mp", 2, 2, "none", id="mp-dp2-tp2", marks=pytest.mark.slow),
    pytest.param("ray", 2, 1, "none", id="ray-tp2", marks=pytest.mark.slow),
    pytest.param("ray", 1, 2, "prefill", id="ray-dp2-tbo_prefill", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=4, logging_level="WARNING", include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("executor,tp,dp,tbo", LAYOUTS)
def test_parallel_tokens_equal_transformers_generate(
    folders: dict[str, Path], executor: str, tp: int, dp: int, tbo: str, request
) -> None:
    """Over real processes (gloo). TP: query heads, output groups and the experts' intermediate
    size split, the rest whole on each rank. DP: each rank its own requests and cache; the MoE
    layers run every rank's rows, the hash routing every rank's token ids (gathered once a step).
    Two-batch overlap: the microbatches' exchanges interleave with the other's attention and
    experts. The greedy tokens are transformers' `generate`'s."""
    if executor == "ray":
        request.getfixturevalue("local_ray")
    expected = hf_greedy(folders["hca_first"], ENGINE_PROMPTS, MAX_TOKENS)
    got, seen = _engine_tokens(
        folders["hca_first"],
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        enable_tbo=tbo,
        executor=executor,
        worker_timeout_s=90.0,
    )
    assert got == expected
    if dp == 1:
        assert seen["preemptions"] > 0, seen
    assert (seen["split_steps"] > 0) == (tbo != "none"), seen


class _OpLog(torch.overrides.TorchFunctionMode):
    """Appends the name of every atomrt op called to `log` (beside the segment backend's)."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = str(getattr(func, "__name__", func))
        if "v4_" in name:
            self.log.append(("op", name.split(".")[0], args[-1]))
        return func(*args, **(kwargs or {}))


class _LoggedStreams:
    """The stream operations of workers/layers/v4_streams.py on the CPU, each one appended to
    `log` (streams and events by name): what the fork and join would do on CUDA, in order."""

    class Stream:
        def __init__(self, name: str, log: list) -> None:
            self.name, self.log = name, log

        def wait_event(self, event: object) -> None:
            self.log.append(("wait", self.name, event.name))

    class Event:
        def __init__(self, name: str, log: list) -> None:
            self.name, self.log = name, log

        def record(self, stream: object) -> None:
            self.log.append(("record", self.name, stream.name))

    def __init__(self, log: list) -> None:
        self.log, self.made = log, 0
        self.main = self.Stream("main", log)

    def current(self, device: torch.device) -> object:
        return self.main

    def new_stream(self, device: torch.device) -> object:
        self.made += 1
        return self.Stream("side", self.log)

    def new_event(self) -> object:
        self.made += 1
        return self.Event(f"event{self.made}", self.log)

    @contextlib.contextmanager
    def use(self, stream: object):
        self.log.append(("on", stream.name))
        yield
        self.log.append(("off", stream.name))


def test_side_stream_fork_join_order() -> None:
    """The fork: an event on the current stream, the side stream waits on it, the body on the
    side stream, an event there; the join: the current stream waits on that event and lets the
    kept tensors go. A sliding layer's join is a no-op; a fork not joined is an error naming both
    layers. The stream and events are made once and reused by every fork."""
    from atomrt.workers.layers.v4_streams import V4SideStreams

    log: list = []
    api = _LoggedStreams(log)
    pool = V4SideStreams(api)
    dev = torch.device("cpu")
    for _ in range(2):
        kept = torch.ones(3)
        with pool.fork(0, dev, keep=(kept,)):
            log.append(("body", 0))
        assert pool.pending_layer == 0 and pool._pending[2][0] is kept
        pool.join(0, dev)
        assert pool.pending_layer is None
        pool.join(1, dev)  # a sliding layer: nothing open
    once = [
        ("record", "event2", "main"),
        ("wait", "side", "event2"),
        ("on", "side"),
        ("body", 0),
        ("record", "event3", "side"),
        ("off", "side"),
        ("wait", "main", "event3"),
    ]
    assert log == once * 2
    assert api.made == 3  # one stream, two events, for every step
    with pool.fork(2, dev, keep=()):
        pass
    with pytest.raises(RuntimeError, match="fork of layer 3 while layer 2"):
        with pool.fork(3, dev, keep=()):
            pass
    assert pool.pending_layer is None  # the next step starts clean
    with pool.fork(2, dev, keep=()):
        pass
    with pytest.raises(RuntimeError, match="attention of layer 4 while layer 2"):
        pool.join(4, dev)
    # a body that raises leaves no fork open; off CUDA (no stream api) only the bookkeeping runs
    with pytest.raises(ValueError):
        with pool.fork(5, dev, keep=()):
            raise ValueError("body")
    assert pool.pending_layer is None
    plain = V4SideStreams()
    with plain.fork(0, dev, keep=()):
        pass
    assert plain.pending_layer == 0 and plain._made == {}
    plain.join(0, dev)
    assert plain.pending_layer is None


def test_recording_plan(folders: dict[str, Path]) -> None:
    """What a TR_HYBRID decode bucket records, checked on the CPU with a logging segment backend:
    the unit is DeepseekV4ForCausalLM alone; one eager region per CSA layer, the indexer's
    scores and their top-k (`_index_topk`: the attention recorded after it), HCA and sliding
    layers recorded whole (their entries a fixed width), so CSA layers + 1 segments; each
    compressed layer's compressor launch runs inside the recorded segment of its attention,
    forking onto the side stream and joined back in that same segment (the stream operations
    logged as CUDA would run them); decode buckets only."""
    from v4_harness import record_decode_step

    from atomrt.graphs.markers import captured_token_sizes, token_graph_units
    from atomrt.workers.runner.graph_runner import recorded_phases

    model = load_model(Config(model=str(folders["csa_hca"])), "cpu", torch.float32).model
    assert token_graph_units(model) == [model]
    assert recorded_phases(model) == (False,)  # the capture loop's record passes: decode alone
    log: list = []
    model.model.side_streams._streams = _LoggedStreams(log)
    graph = record_decode_step(model, model, [PROMPTS[0], PROMPTS[2]], log, _OpLog(log))
    layer_types = model.arch.v4.layer_types
    csa = [i for i, t in enumerate(layer_types) if t == "compressed_sparse_attention"]
    assert 0 < len(csa) and {"heavily_compressed_attention", "sliding_attention"} < set(layer_types)
    assert graph.num_segments(2, "decode") == len(csa) + 1
    rec = graph._recordings[(2, None)]
    assert [c.fn.__name__ for c in rec.eager_calls] == ["_index_topk"] * len(csa)
    assert [c.args[-1] for c in rec.eager_calls] == csa
    spans = [(log.index(("begin", k)), log.index(("end", k))) for k in range(len(csa) + 1)]

    def segment_of(at: int) -> int:
        (k,) = [k for k, (b, e) in enumerate(spans) if b < at < e]
        return k

    fork_join = [("record", "main"), ("wait", "side"), ("record", "side"), ("wait", "main")]
    for i, t in enumerate(layer_types):
        attn = log.index(("op", "v4_attention", i))
        k = segment_of(attn)  # every layer's attention op inside a recorded segment
        if t == "sliding_attention":
            continue
        launch = log.index(("op", "v4_attn_compress_launch", i))
        assert segment_of(launch) == k
        # fork (the side stream waits on the current one) after the launch and join (the current
        # one waits on the side stream) in the attention, both in the segment; nothing else
        stop = next(j for j in range(attn + 1, len(log)) if log[j][0] in ("op", "end"))
        assert stop <= spans[k][1]
        streams = [e for e in log[launch:stop] if e[0] in ("record", "wait")]
        assert [(e[0], e[2] if e[0] == "record" else e[1]) for e in streams] == fork_join
    assert [e for e in log[spans[-1][1] :] if e[0] == "wait"] == []
    assert captured_token_sizes(model, "decode") == [2]
    assert captured_token_sizes(model, "prefill") == []


def test_csa_region_spans_the_context_not_max_positions(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TR_HYBRID decode bucket's recorded part sizes HCA's entries by max positions // rate, but
    a CSA layer's eager region (`_index_topk`), which runs with the step's lengths at every
    replay, builds, scores and ranks only as many entries as the step's longest context has (here
    21 // 4 = 5 of 128): at a model's default context that is 262144 a row. It hands the recorded
    attention a fixed `index_topk` picks. (That its picks are the graph-safe launch's over all
    entries: the transformers comparisons above, eager and under graph-safe metadata.)"""
    from v4_harness import record_decode_step

    from atomrt.graphs import region_graph
    from atomrt.workers.layers import v4_attention

    widths: list[tuple[str, int]] = []
    picks: list[tuple[int, ...]] = []
    entry_slots, index_topk = v4_attention.entry_slots, v4_attention._index_topk

    def logged_slots(layer, rows, positions, num_entries=None):  # type: ignore[no-untyped-def]
        out = entry_slots(layer, rows, positions, num_entries)
        if region_graph.recording():  # not the prefill before it
            widths.append(("CSA" if layer.indexer is not None else "HCA", out.shape[1]))
        return out

    def logged_topk(iq, iw, rows, positions, every, picked, layer):  # type: ignore[no-untyped-def]
        if region_graph.recording():
            assert every is None  # host-planned: the region makes the context's entries
            picks.append(tuple(picked.shape))
        return index_topk(iq, iw, rows, positions, every, picked, layer)

    monkeypatch.setattr(v4_attention, "entry_slots", logged_slots)
    monkeypatch.setattr(v4_attention, "_index_topk", logged_topk)
    model = load_model(Config(model=str(folders["csa_hca"])), "cpu", torch.float32).model
    record_decode_step(model, model, [PROMPTS[0], PROMPTS[2]], [])
    layer_types = model.arch.v4.layer_types
    num_csa = layer_types.count("compressed_sparse_attention")
    # max positions 512 (the tiny config's): HCA's fixed 512 // 8, CSA's live 5 of 512 // 4
    assert sorted(widths) == sorted([("CSA", 21 // 4)] * num_csa + [("HCA", 512 // 8)])
    assert picks == [(2, 3)] * num_csa  # index_topk 3 of the 128 a row could have


@pytest.mark.parametrize("kind", ["ngram", "self_draft"])
def test_speculation_tokens_equal_transformers_generate(
    folders: dict[str, Path], kind: str
) -> None:
    """Verify steps run several query rows per request through the compressors and the indexer
    (a rejected draft's rows are rewritten when its position is computed again): the greedy
    tokens are transformers' `generate`'s. Repetitive prompts give the n-gram proposer matches;
    the target as its own drafter has every draft accepted."""
    from atomrt.runtime.entrypoints.llm import LLM

    folder = folders["csa_hca"]
    prompts = [[5, 6, 7, 8] * 5 + [5, 6], [9, 10, 11] * 4, ENGINE_PROMPTS[1]]
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    if kind == "self_draft":
        spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
    llm = LLM(
        str(folder),
        device="cpu",
        enforce_eager=True,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        speculative_config=spec,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats.spec_decode
    finally:
        llm.shutdown()
    assert got == expected
    assert stats.num_drafts > 0 and stats.num_eager_draft_passes == 0
    if kind == "self_draft":
        assert stats.num_accepted_tokens == stats.num_draft_tokens


def _cache_logits(model: object, dtype: torch.dtype, prompts: list[list[int]]) -> torch.Tensor:
    """The logits of a prefill and six decode steps through a paged cache of `dtype`."""
    from model_harness import PagedHarness

    from atomrt.workers.runner.kv_cache import allocate_kv_cache

    harness = PagedHarness(model, 40, len(prompts), block_size=4)
    num_blocks = len(harness.block_tables) * harness.max_blocks_per_seq + 1
    harness.kv_cache_data = allocate_kv_cache(
        kv_layer_specs(harness.layers), num_blocks, 4, dtype, "cpu"
    )
    steps = [harness.step(prompts, [0] * len(prompts))]
    computed = [len(p) for p in prompts]
    for t in range(6):
        steps.append(harness.step([[5 + t + s] for s in range(len(prompts))], computed))
        computed = [n + 1 for n in computed]
    assert harness.kv_cache_data["layers.0"].rows.dtype == dtype
    return torch.stack(steps)


# (model, bound on |logits(e4m3 cache) - logits(float32 cache)|)
FP8_CASES = [
    # every choice is the token's (hash-routed experts, the indexer's picks not near a tie): the
    # e4m3 rounding alone (3 mantissa bits, values O(1): seen 0.069 at logits up to 1.5)
    pytest.param("sliding", 0.1, id="sliding"),
    # routed experts and the indexer's top-k: a near-tied choice flips under any rounding of the
    # rows (bfloat16-rounded rows flip them too, seen 0.25; e4m3: 0.26 at logits up to 1.6)
    pytest.param("csa_hca", 0.3, id="csa_hca"),
]


@pytest.mark.parametrize("name,bound", FP8_CASES)
def test_fp8_cache_rows(folders: dict[str, Path], name: str, bound: float) -> None:
    """With an e4m3 cache (kv_cache_dtype fp8: rows written saturated at scale 1, read back
    widened; the rows are RMS-normalised keys and entries or projections of normalised rows, all
    within e4m3's normal range, so a per-tensor scale would not change their precision) the rows
    are stored as bytes the CPU can index, and the logits stay within `bound` of the float
    cache's."""
    model = load_model(Config(model=str(folders[name])), "cpu", torch.float32).model
    prompts = [PROMPTS[0], PROMPTS[1]]
    fp32 = _cache_logits(model, torch.float32, prompts)
    fp8 = _cache_logits(model, torch.float8_e4m3fn, prompts)
    assert (fp32 - fp8).abs().max() < bound


@pytest.mark.skipif(
    DEVICE != "cpu",
    reason="launches the kernels on CPU tensors, which only Triton's interpreter can; "
    "tests/gpu/test_deepseek_v4_gpu.py::test_kernels_read_e4m3_rows runs them on CUDA",
)
@pytest.mark.parametrize("name", ["sliding", "csa_hca"])
def test_fp8_cache_rows_through_the_kernels(
    folders: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the kernels (CUDA's path, here in Triton's interpreter) an e4m3 cache's logits are
    the torch path's."""
    from atomrt.workers.layers import v4_attention

    model = load_model(Config(model=str(folders[name])), "cpu", torch.float32).model
    prompts = [PROMPTS[0], PROMPTS[1]]
    fp8 = _cache_logits(model, torch.float8_e4m3fn, prompts)
    monkeypatch.setattr(v4_attention, "USE_KERNELS_ON_CPU", True)
    kernels = _cache_logits(model, torch.float8_e4m3fn, prompts)
    assert (kernels - fp8).abs().max() < 1e-4


def test_fp8_cache_is_allowed_on_cuda(folders: dict[str, Path]) -> None:
    """The runner's check lets a V4 model's e4m3 cache run on CUDA (its kernels widen the rows);
    tests/gpu/test_deepseek_v4_gpu.py runs them there."""
    from atomrt.runtime.config import CacheConfig
    from atomrt.workers.runner.model_runner import _check_fp8_cache

    config = Config(model=str(folders["csa_hca"]), cache_config=CacheConfig(kv_cache_dtype="fp8"))
    model = load_model(config, "cpu", torch.float32).model
    _check_fp8_cache(config, torch.device("cuda"), collect_attention_layers(model))


def test_graph_safe_metadata_reads_no_host_data(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request graph (FULL) records the whole step inline: under graph-safe metadata the
    entries are the fixed width and the indexer's scores launch over all of them, reading no host
    copy of the step's lengths (a read fails the test); the logits are still transformers'."""
    record_as_request_graphs(monkeypatch)
    loaded = load_model(Config(model=str(folders["csa_hca"])), "cpu", torch.float32)
    result = run_prefill_and_decode(loaded.model, PROMPTS, 4, block_size=4)
    assert max_logit_diff(result, load_hf(folders["csa_hca"]), PROMPTS) <= TOLERANCE


def _random_prompts(seed: int) -> list[list[int]]:
    """Four prompts of 1 to 40 tokens: short ones see no CSA entry, long ones cross windows."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 41, (4,), generator=g).tolist()
    return [torch.randint(2, 150, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("seed", [None, 1, 2], ids=["fixed", "random1", "random2"])
def test_csa_picks_over_the_context_are_those_over_every_entry(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch, seed: Optional[int]
) -> None:
    """The CSA region's picks over the step's own entries (host-planned: eager steps, and every
    TR_HYBRID replay) are, layer by layer and step by step, the ones a graph-safe step takes over
    all T entries it gives a row (FULL's), -1 where a row sees fewer than index_topk; the fixed
    prompts, then random ones."""
    from atomrt.workers.layers import v4_attention

    prompts = PROMPTS if seed is None else _random_prompts(seed)

    index_topk = v4_attention._index_topk
    runs: dict[bool, list[tuple[int, torch.Tensor]]] = {False: [], True: []}

    def logged(iq, iw, rows, positions, every, picked, layer):  # type: ignore[no-untyped-def]
        index_topk(iq, iw, rows, positions, every, picked, layer)
        runs[every is not None].append((layer, picked.clone()))

    monkeypatch.setattr(v4_attention, "_index_topk", logged)
    loaded = load_model(Config(model=str(folders["csa_hca"])), "cpu", torch.float32)
    run_prefill_and_decode(loaded.model, prompts, 6, block_size=4)
    record_as_request_graphs(monkeypatch)
    run_prefill_and_decode(loaded.model, prompts, 6, block_size=4)
    (context, every) = runs[False], runs[True]
    assert len(context) == len(every) == 2 * 7  # two CSA layers, a prefill and 6 decode steps
    for (layer, got), (layer_t, want) in zip(context, every):
        # index_topk 3 of the step's entries (fewer when every sequence has fewer) and of 128
        assert layer == layer_t and want.shape[1] == 3 >= got.shape[1]
        padded = torch.nn.functional.pad(got, (0, want.shape[1] - got.shape[1]), value=-1)
        assert torch.equal(padded, want), f"layer {layer}"
    if seed is None:
        assert any((picks < 0).any() for _, picks in context)  # the 3-token prompt sees none


@pytest.mark.slow  # ~13 s a form: two runs through the kernels in Triton's interpreter
@pytest.mark.parametrize("form", ["merge", "select", "chunked", "torch"])
def test_graph_safe_prefix_kernels_pick_as_every_entry(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """With `GRAPH_SAFE_PREFIX`, a graph-safe (FULL) step's CSA region scores and ranks each row's
    live entries on the device (workers/kernels/v4/v4_index.py, in each form of its top-k)
    instead of all T as [n, T] slots and torch's top-k: the picks are the same, layer by layer
    and step by step (the kernels through Triton's interpreter, as on CUDA), and the logits are
    transformers'."""
    from atomrt.workers.kernels.v4 import v4_index
    from atomrt.workers.layers import v4_attention

    monkeypatch.setattr(v4_attention, "USE_KERNELS_ON_CPU", True)
    monkeypatch.setattr(v4_index, "PICK_FORM", form)
    record_as_request_graphs(monkeypatch)
    index_topk = v4_attention._index_topk
    runs: dict[bool, list[tuple[int, torch.Tensor]]] = {False: [], True: []}
    results = {}
    for prefix in (False, True):
        monkeypatch.setattr(v4_attention, "GRAPH_SAFE_PREFIX", prefix)

        def logged(iq, iw, rows, positions, every, picked, layer, prefix=prefix):  # type: ignore[no-untyped-def]
            assert (every is None) == prefix
            index_topk(iq, iw, rows, positions, every, picked, layer)
            runs[prefix].append((layer, picked.clone()))

        monkeypatch.setattr(v4_attention, "_index_topk", logged)
        loaded = load_model(Config(model=str(folders["csa_hca"])), "cpu", torch.float32)
        results[prefix] = run_prefill_and_decode(loaded.model, PROMPTS, 2, block_size=4)
    assert len(runs[True]) == len(runs[False]) == 2 * 3  # two CSA layers, a prefill, 2 decodes
    for (layer, got), (layer_t, want) in zip(runs[True], runs[False]):
        assert layer == layer_t and torch.equal(got, want), f"layer {layer}"
    assert max_logit_diff(results[True], load_hf(folders["csa_hca"]), PROMPTS) <= TOLERANCE


def test_long_prompt_attends_in_query_chunks(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's query rows attend in chunks (bounded logits memory): 3-row chunks give
    transformers' logits as one chunk does."""
    from atomrt.workers.layers import v4_attention

    monkeypatch.setattr(v4_attention, "_QUERY_CHUNK", 3)
    loaded = load_model(Config(model=str(folders["csa_hca"])), "cpu", torch.float32)
    result = run_prefill_and_decode(loaded.model, PROMPTS, 2, block_size=4)
    assert max_logit_diff(result, load_hf(folders["csa_hca"]), PROMPTS) <= TOLERANCE


@pytest.mark.slow  # ~16 s; test_v4_kernels pins the compressor kernel as a loop
def test_prefill_launches_do_not_grow_with_its_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the kernels (CUDA's path, here in Triton's interpreter) a prefill of 40 tokens and
    one of 136 (eight HCA windows, past the sliding window) run the same torch ops (the CPU's
    expert loop aside) and the same kernel launches, one per compressor and one attention (and
    one indexer score) a layer: no per-row or per-window loop on the host, whatever the prompt's
    length."""
    from collections import Counter

    from model_harness import PagedHarness
    from torch.utils._python_dispatch import TorchDispatchMode

    from atomrt.workers.kernels.v4 import v4_kernels
    from atomrt.workers.layers import v4_attention, v4_moe

    monkeypatch.setattr(v4_attention, "USE_KERNELS_ON_CPU", True)
    launches: Counter = Counter()

    def counted(name: str):
        kernel = getattr(v4_kernels, name)

        def launch(*args, **kwargs):
            launches[name] += 1
            return kernel(*args, **kwargs)

        return launch

    for name in ("v4_pool", "v4_index_scores", "v4_sparse_attention"):
        monkeypatch.setattr(v4_kernels, name, counted(name))

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count, self.paused = 0, False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += not self.paused
            return func(*args, **(kwargs or {}))

    # the CPU's routed experts loop over the experts the rows pick (CUDA: two launches): not
    # counted, as a row count can change how many of the 8 a top-k layer's rows pick
    experts = v4_moe._expert_pairs_impl

    def uncounted_experts(*args):
        ops.paused = True
        try:
            return experts(*args)
        finally:
            ops.paused = False

    monkeypatch.setattr(v4_moe, "_expert_pairs_impl", uncounted_experts)

    config = Config(model="tiny-deepseek-v4", model_config=ModelConfig(load_format="dummy"))
    model = load_model(config, "cpu", torch.float32).model
    seen = []
    for length in (40, 136):
        launches.clear()
        harness = PagedHarness(model, length, 1, block_size=16)
        with Ops() as ops:
            harness.step([list(range(3, 3 + length))], [0])
        seen.append((ops.count, dict(launches)))
    assert seen[0] == seen[1], seen
    # 4 layers (sliding, CSA, HCA, CSA): 5 compressors, 4 attentions, 2 indexers
    assert seen[0][1] == {"v4_pool": 5, "v4_sparse_attention": 4, "v4_index_scores": 2}

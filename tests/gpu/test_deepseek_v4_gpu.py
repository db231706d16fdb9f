"""GPU tier: DeepSeek-V4's compressors on their side stream under CUDA graphs. The tiny V4 preset
(dummy weights, float32) captures its decode buckets with each compressed layer's fork onto the
model's side stream and its join back in the same recorded segment; every bucket, in a random
order, replays to the logits of the same batch run eagerly (TR_HYBRID segment by segment, FULL's
request graphs); the greedy tokens of FULL and TR_HYBRID engines at levels 0 and 3
are an eager engine's; and a profile of one replayed bucket shows the compressors' kernels running
beside the query's and the window key's, which run on the main stream when the step is eager.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_deepseek_v4_gpu.py`.
"""

import json
import random
import tempfile

import pytest
import test_v4_kernels as cpu_tier
import torch
from test_graph_modes_gpu import (
    _bucket_inputs,
    _logits,
    check_matches_eager,
    replay_every_bucket_like_eager,
)

from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.runtime.entrypoints.llm import LLM

pytestmark = pytest.mark.gpu

TINY = "tiny-deepseek-v4"


def _llm(level: int, mode, enforce_eager: bool = False) -> LLM:
    cc = CompilationConfig(level=level, cudagraph_mode=mode, cuda_graph_sizes=[8])
    return LLM(
        TINY,
        load_format="dummy",
        dtype="float32",
        device="cuda",
        enforce_eager=enforce_eager,
        compilation_config=cc,
        max_num_seqs=8,
    )


def _side_streams(llm: LLM):
    runner = llm.engine.executor.worker.runner
    model = getattr(runner.model, "_orig_mod", runner.model)
    return model.model.side_streams


def _close(llm: LLM) -> None:
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()


def test_side_stream_buckets_replay_like_eager() -> None:
    llm = _llm(0, "TR_HYBRID")
    try:
        streams = _side_streams(llm)
        assert list(streams._made) == ["cuda:0"], "the capture forked onto the side stream"
        side = streams._made["cuda:0"][0]
        assert side != torch.cuda.current_stream()
        sizes = replay_every_bucket_like_eager(llm, "TR_HYBRID")
        assert sizes == [1, 2, 3, 4, 5, 6, 7, 8]
        assert streams.pending_layer is None
        assert streams._made["cuda:0"][0] is side  # one stream for every step
    finally:
        _close(llm)


def _requests():
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(1, 50))] for _ in range(12)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1 + (i * 5) % 24, ignore_eos=True)
        for i in range(12)
    ]
    return prompts, params


def _tokens(llm: LLM):
    try:
        prompts, params = _requests()
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [o.token_ids for o in outs], llm.engine.info
    finally:
        _close(llm)


def test_side_stream_request_graphs_replay_like_eager() -> None:
    """FULL's request graphs after all captures: every bucket twice in a random order gives the
    eager batch's logits. (TR_HYBRID's decode steps replay segment by segment here: a CSA layer's
    indexer region records no request graph to join the step around.)"""
    llm = _llm(0, "FULL")
    try:
        assert replay_every_bucket_like_eager(llm, "FULL") == [1, 2, 3, 4, 5, 6, 7, 8]
    finally:
        _close(llm)


@pytest.fixture(scope="module")
def eager_tokens():
    return _tokens(_llm(0, None, enforce_eager=True))[0]


@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("mode", ["TR_HYBRID", "FULL"])
def test_side_stream_graphs_give_eager_tokens(eager_tokens, mode: str, level: int) -> None:
    tokens, info = _tokens(_llm(level, mode))
    check_matches_eager(tokens, info, mode, eager_tokens, f"tiny V4 {mode} level {level}")


def _kernels(run) -> list[tuple[float, float, str, int]]:
    """The CUDA kernels of one call of `run` (after one unprofiled call), from a torch.profiler
    trace: (start µs, end µs, name, the stream CUPTI names), by start."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    kernels = [
        (e["ts"], e["ts"] + e["dur"], e["name"], e.get("args", {}).get("stream", -1))
        for e in events
        if e.get("cat") == "kernel"
    ]
    return sorted(kernels)


def _concurrent(kernels) -> list[tuple[str, str]]:
    """Name pairs of kernels whose runs overlap in time (one stream runs one kernel at a time)."""
    pairs = []
    for i, (_, end, name, _) in enumerate(kernels):
        for start2, _, name2, _ in kernels[i + 1 :]:
            if start2 >= end:
                break
            pairs.append((name, name2))
    return pairs


def test_profile_shows_the_compressors_beside_the_projections() -> None:
    """One decode bucket under torch.profiler, eager, then replayed from its token graph (segment
    by segment: each compressed layer's fork and join inside one). Eagerly the compressors'
    kernels run on a stream of their own; in the replay a kernel only the side stream ran overlaps
    in time a kernel only the main stream ran: the recorded fork runs the compressors beside the
    query's and the window key's work."""
    llm = _llm(0, "TR_HYBRID")
    try:
        runner = llm.engine.executor.worker.runner
        bs = 8
        inputs = _bucket_inputs(runner, bs, seed=0)
        rows = torch.arange(bs, device="cuda")
        eager = ForwardDecision(
            kind=ForwardKind.EAGER, running_bs=bs, running_tokens=bs, is_prefill=False
        )
        graph = ForwardDecision(
            kind=ForwardKind.TOKEN_GRAPH,
            running_bs=bs,
            running_tokens=bs,
            is_prefill=False,
            token_bucket=bs,
        )
        scope = dict(tr_graph=graph.tr_graph, tr_req_key=graph.tr_req_key)
        eager_kernels = _kernels(lambda: _logits(runner, inputs, eager, rows))
        replay_kernels = _kernels(lambda: _logits(runner, inputs, graph, rows, **scope))
    finally:
        _close(llm)
    by_stream: dict[int, set[str]] = {}
    for _, _, name, stream in eager_kernels:
        by_stream.setdefault(stream, set()).add(name)
    counts = {s: sum(k[3] == s for k in eager_kernels) for s in by_stream}
    main = max(counts, key=counts.get)
    side = set().union(*(names for s, names in by_stream.items() if s != main))
    assert side, f"eagerly every kernel ran on one stream: {sorted(by_stream[main])}"
    side_only, main_only = side - by_stream[main], by_stream[main] - side
    assert side_only, f"the side stream ran only kernels the main stream ran too: {sorted(side)}"
    replayed = {k[2] for k in replay_kernels}
    assert side_only & replayed, (
        f"the replay ran none of the side stream's kernels {sorted(side_only)}: {sorted(replayed)}"
    )
    beside = [
        (a, b)
        for a, b in _concurrent(replay_kernels)
        if (a in side_only and b in main_only) or (b in side_only and a in main_only)
    ]
    assert beside, (
        f"in the replay no side-stream kernel {sorted(side_only)} overlapped a main-stream "
        f"kernel; overlapping pairs: {_concurrent(replay_kernels)[:10]}"
    )


def test_kernels_read_e4m3_rows() -> None:
    """kv_cache_dtype fp8 on CUDA: every V4 kernel over an e4m3 cache as over its rows widened."""
    cpu_tier.check_kernels_read_e4m3_rows("cuda")

"""GPU tier: every CUDA-graph mode at levels 0 and 3 gives eager's greedy tokens on the embedded
model's shape, and every captured bucket replays (in random order, after all are captured) to
eager's output. Dummy weights of SmolLM2-135M's shape (the 98 MB GGUF does not travel), float32
so that eager and graph kernels agree to well under a greedy near-tie.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_graph_modes_gpu.py`.
"""

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig, CUDAGraphMode
from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.runtime.entrypoints.llm import LLM

pytestmark = pytest.mark.gpu

MODEL = dict(model="SmolLM2-135M", load_format="dummy", dtype="float32", device="cuda")
LADDER_TOP = 64  # capture [1..8, 16, 32, 48, 64]
NUM_REQUESTS = 64


def _requests():
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 49000) for _ in range(rng.randrange(1, 120))] for _ in range(NUM_REQUESTS)
    ]
    # Staggered lengths: the decode batch shrinks 64 -> 1 through every bucket and between buckets.
    params = [
        SamplingParams(temperature=0.0, max_tokens=1 + (i * 7) % 40, ignore_eos=True)
        for i in range(NUM_REQUESTS)
    ]
    return prompts, params


def _run(level: int, mode, enforce_eager: bool = False, params=None, **settings):
    cc = CompilationConfig(level=level, cudagraph_mode=mode, cuda_graph_sizes=[LADDER_TOP])
    llm = LLM(
        **MODEL,
        enforce_eager=enforce_eager,
        compilation_config=cc,
        max_num_seqs=NUM_REQUESTS,
        **settings,
    )
    try:
        prompts, greedy = _requests()
        outs = llm.generate(prompts, params or greedy)
        return [o.outputs[0].token_ids for o in outs], llm.engine.info
    finally:
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def eager_tokens():
    tokens, _ = _run(0, None, enforce_eager=True)
    return tokens


MODES = ["NONE", "FULL", "TR_HYBRID", "FULL_DECODE_ONLY", "FULL_AND_TR_HYBRID"]


def describe_mismatches(tokens, eager_tokens, mismatched, eager_logprobs=None) -> str:
    """Where each of the first mismatched requests first differs; with eager's logprobs (top 2 per
    position), the margin between eager's two best tokens there: a margin near 0 is a greedy
    near-tie that a different summation order can flip, a large one a wrong result."""
    lines = []
    for i in mismatched[:8]:
        a, b = tokens[i], eager_tokens[i]
        pos = next((p for p, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        line = f"request {i}: first differs at token {pos} of {len(b)} ({a[pos : pos + 1]} vs eager {b[pos : pos + 1]})"
        if eager_logprobs is not None and pos < len(eager_logprobs[i]):
            top = sorted((lp.logprob for lp in eager_logprobs[i][pos].values()), reverse=True)
            if len(top) >= 2:
                line += f", eager's top-2 logprob margin there {top[0] - top[1]:.3g}"
        lines.append(line)
    return "; ".join(lines)


def check_matches_eager(
    tokens, info, mode: str, eager_tokens, label: str, eager_logprobs=None
) -> None:
    """The mode captured the graphs it should (token graphs or request graphs) and every request's
    greedy tokens equal eager's. The TP=2 tier (test_tp_gpu.py) checks with it too."""
    m = CUDAGraphMode[mode]
    if m != CUDAGraphMode.NONE:
        assert info.capture_sizes, "graphs were captured"
        if m.uses_tr_hybrid():
            assert info.decode_token_sizes and not info.req_keys
        else:
            assert info.req_keys and not info.decode_token_sizes
    mismatched = [i for i, (a, b) in enumerate(zip(tokens, eager_tokens)) if a != b]
    assert not mismatched, (
        f"{label}: requests {mismatched[:8]} differ from eager: "
        + describe_mismatches(tokens, eager_tokens, mismatched, eager_logprobs)
    )


@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("mode", MODES)
def test_mode_matches_eager(eager_tokens, level, mode):
    tokens, info = _run(level, mode)
    check_matches_eager(tokens, info, mode, eager_tokens, f"{mode} level {level}")
    if CUDAGraphMode[mode].uses_tr_hybrid():
        # every decode bucket replays as one launch, its attention regions' request graphs joined
        assert set(info.token_req_keys) == {(b, 0) for b in info.capture_sizes}


@pytest.mark.parametrize(
    "level,mode", [(0, "NONE"), (0, "FULL"), (0, "TR_HYBRID"), (3, "FULL"), (3, "TR_HYBRID")]
)
def test_async_scheduling_matches_eager(eager_tokens, level, mode):
    """Step N+1 submitted before step N's tokens are back: decode rows read their pending token
    from the device (gathered inside the request graph under FULL)."""
    tokens, info = _run(level, mode, async_scheduling=True)
    check_matches_eager(tokens, info, mode, eager_tokens, f"async {mode} level {level}")


def test_async_scheduling_with_seeds_penalties_and_logprobs_matches_sync():
    """Rows whose sampling reads their history (seeds, penalties) and logprobs read back, under
    FULL graphs: async gives the synchronous run's tokens and logprobs."""
    kinds = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True, logprobs=3
        ),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
    ]
    params = [kinds[i % 3] for i in range(NUM_REQUESTS)]
    runs = []
    for async_scheduling in (False, True):
        cc = CompilationConfig(level=0, cudagraph_mode="FULL", cuda_graph_sizes=[LADDER_TOP])
        llm = LLM(
            **MODEL,
            compilation_config=cc,
            max_num_seqs=NUM_REQUESTS,
            async_scheduling=async_scheduling,
        )
        try:
            outs = llm.generate(_requests()[0], params)
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        finally:
            llm.shutdown()
            del llm
            torch.cuda.empty_cache()
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
    for (_, a), (_, b) in zip(*runs):
        if a is not None:
            assert [sorted(r) for r in a] == [sorted(r) for r in b]
            assert all(abs(r[k].logprob - s[k].logprob) < 1e-4 for r, s in zip(a, b) for k in r)


def _bucket_inputs(runner, bs: int, seed: int):
    """A real decode batch of `bs` sequences with a few tokens of context in the KV cache."""
    from atomrt.workers.runner.input_batch import StepInputs

    rng = np.random.default_rng(seed)
    ctx = rng.integers(1, 40, size=bs).astype(np.int32)
    blocks_per_seq = -(-int(ctx.max()) // runner.shape.block_size)
    tables = (1 + np.arange(bs * blocks_per_seq, dtype=np.int32)).reshape(bs, blocks_per_seq)
    positions = (ctx - 1).astype(np.int64)
    slots = (
        tables[np.arange(bs), positions // runner.shape.block_size].astype(np.int64)
        * runner.shape.block_size
        + positions % runner.shape.block_size
    )
    cu = np.arange(bs + 1, dtype=np.int32)
    return StepInputs(
        seq_ids=np.arange(bs, dtype=np.int64),
        input_ids=rng.integers(1, runner.arch.vocab_size, size=bs).astype(np.int64),
        positions=positions,
        slot_mapping=slots,
        cu_seqlens_q=cu,
        context_lens=ctx,
        block_tables=tables,
        sample_seq_idx=np.arange(bs, dtype=np.int64),
        sample_rows=np.arange(bs, dtype=np.int64),
    )


@torch.inference_mode()  # as Worker.launch runs a step: eager regions write into recorded buffers
def _logits(runner, inputs, decision, rows, **scope):
    """One forward of `inputs` as `decision` says (eager, or a graph's replay), its logits for
    `rows` (a slice: every row, as a decode step samples them)."""
    from atomrt.runtime.forward_context import set_forward_context

    bs = decision.running_bs
    md, ctx = runner.buffers.prepare(inputs, decision)
    with set_forward_context(
        md,
        runner.config,
        ctx,
        no_compile_layers=runner.attn_layers,
        kv_cache_data=runner.kv_cache,
        **scope,
    ):
        return runner.run_model(runner.buffers.forward_vars["input_ids"][:bs], decision, rows)


def replay_every_bucket_like_eager(llm, mode: str, joined: bool = False, atol: float = 2e-4):
    """After capture, every recorded bucket, twice in a random order, replays to the logits of the
    same batch run eagerly. TR_HYBRID: segment by segment with eager attention between; `joined`:
    the same recordings replayed as one launch with the attention regions' request graphs. FULL
    (and joined): the graph's own logits for every row and the argmax recorded after them too.
    Returns the bucket sizes."""
    runner = llm.engine.executor.worker.runner
    sizes = list(runner.graphs.capture_sizes)
    order = sizes * 2
    random.Random(1).shuffle(order)
    whole = mode == "FULL" or joined
    for i, bs in enumerate(order):
        inputs = _bucket_inputs(runner, bs, seed=i)
        kind = ForwardKind.REQ_GRAPH if mode == "FULL" else ForwardKind.TOKEN_GRAPH
        graph = ForwardDecision(
            kind=kind,
            running_bs=bs,
            running_tokens=bs,
            is_prefill=False,
            req_key=(bs, 0) if whole else None,
            token_bucket=bs if mode != "FULL" else None,
        )
        eager = ForwardDecision(
            kind=ForwardKind.EAGER, running_bs=bs, running_tokens=bs, is_prefill=False
        )
        rows = torch.from_numpy(inputs.sample_rows).cuda()
        ref = _logits(runner, inputs, eager, rows).logits.clone()
        scope = dict(tr_graph=graph.tr_graph, tr_req_key=graph.tr_req_key)
        got = _logits(runner, inputs, graph, rows, **scope).logits
        label = f"{mode} {'joined ' if joined else ''}bucket {bs} (replay #{i})"
        torch.testing.assert_close(got, ref, atol=atol, rtol=1e-4, msg=label)
        if whole:  # every row samples (a slice): the graph's own logits
            out = _logits(runner, inputs, graph, slice(0, bs))
            torch.testing.assert_close(
                out.logits, ref, atol=atol, rtol=1e-4, msg=f"{label}: in-graph logits"
            )
            # ... and the argmax recorded after them is what the sampler computes from them
            assert out.tokens[:bs].tolist() == out.logits.argmax(-1).tolist(), (
                f"{label}: in-graph argmax"
            )
    return sizes


@pytest.mark.parametrize("mode", ["FULL", "TR_HYBRID", "TR_HYBRID+joined"])
def test_every_bucket_replays_like_eager_in_random_order(mode):
    joined = mode == "TR_HYBRID+joined"
    mode = mode.split("+")[0]
    cc = CompilationConfig(level=0, cudagraph_mode=mode, cuda_graph_sizes=[LADDER_TOP])
    llm = LLM(**MODEL, compilation_config=cc, max_num_seqs=NUM_REQUESTS)
    try:
        sizes = replay_every_bucket_like_eager(llm, mode, joined)
        assert sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48, 64]
        runner = llm.engine.executor.worker.runner
        pool, largest = runner.graphs.pool_bytes, runner.graphs.largest_pool_bytes
        assert 0 < largest <= pool
        # Recordings share one pool: the ladder needs about what its largest bucket needs, not the sum.
        assert pool <= 1.25 * largest + 8 * 2**20, (
            f"pool {pool / 2**20:.1f} MiB vs largest {largest / 2**20:.1f} MiB"
        )
        print(
            f"{mode}: graph pool {pool / 2**20:.1f} MiB for {len(sizes)} buckets, capture {llm.engine.info.capture_seconds:.2f} s"
        )
    finally:
        llm.shutdown()


def test_level3_with_one_sequence_starts_and_matches_eager():
    """max_num_seqs=1 at level 3: the only capture bucket is 1, and the first compiled call (KV
    sizing) must still see >= 2 rows. Its greedy tokens equal eager's."""
    prompt, params = [5, 17, 99, 3], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for level, eager in ((0, True), (3, False)):
        cc = CompilationConfig(level=level, cudagraph_mode="FULL", cuda_graph_sizes=[1])
        llm = LLM(**MODEL, enforce_eager=eager, compilation_config=cc, max_num_seqs=1)
        try:
            tokens[level] = llm.generate([prompt], params)[0].outputs[0].token_ids
            if not eager:
                assert llm.engine.info.capture_sizes == (1,)
        finally:
            llm.shutdown()
            torch.cuda.empty_cache()
    assert tokens[3] == tokens[0]


def test_readback_reuses_free_slots_and_passes_over_busy_ones():
    """A step's tokens land in a pinned slot the runner reuses; a slot still waited on, or too small,
    is passed over (a new buffer), so no readback ever overwrites tokens not yet read."""
    from atomrt.workers.runner.readback import Readback, ReadbackSlot
    from atomrt.workers.runner.sampler import SamplerOutput

    dev = torch.device("cuda")
    slot, spare = ReadbackSlot(8), ReadbackSlot(4)

    def start(values, s):
        return Readback(SamplerOutput(torch.tensor(values, dtype=torch.int64, device=dev)), dev, s)

    a = start([3, 1, 4], slot)
    b = start([1, 5, 9, 2, 6], slot)  # `slot` is busy until a.wait()
    c = start(list(range(6)), spare)  # too large for `spare`
    assert a.slot is slot and b.slot is None and c.slot is None and slot.busy
    assert b.wait()[0] == [1, 5, 9, 2, 6] and c.wait()[0] == list(range(6))
    assert a.wait()[0] == [3, 1, 4] and not slot.busy
    d = start([2, 7], slot)
    assert d.slot is slot
    got = d.wait()
    assert got.tokens == [2, 7] and got.logprobs is None and got.prompt_logprobs is None


def test_pool_estimate_counts_logits_where_recordings_hold_an_lm_head():
    """KV sizing reserves a graph-pool estimate: none without graphs; with request graphs, and with
    token graphs (whose decode steps join the LM head), the largest bucket's forward plus every
    row's logits."""
    from atomrt.workers.runner.kv_sizing import determine_num_blocks

    estimates = {}
    for mode in ("NONE", "TR_HYBRID", "FULL"):
        cc = CompilationConfig(level=0, cudagraph_mode=mode, cuda_graph_sizes=[LADDER_TOP])
        llm = LLM(**MODEL, compilation_config=cc, max_num_seqs=NUM_REQUESTS)
        try:
            runner = llm.engine.executor.worker.runner
            estimates[mode] = determine_num_blocks(runner).graph_pool_estimate_bytes
            vocab = runner.arch.vocab_size
        finally:
            llm.shutdown()
    logits = LADDER_TOP * vocab * 4  # fp32 logits of every row of the largest bucket
    assert estimates["NONE"] == 0, estimates
    assert estimates["TR_HYBRID"] >= logits, estimates
    assert estimates["FULL"] >= logits, estimates


_FRESH_START = """
import sys
from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.entrypoints.llm import LLM
cc = CompilationConfig(level=3, cudagraph_mode=sys.argv[1], cuda_graph_sizes=[8])
llm = LLM(model="SmolLM2-135M", load_format="dummy", device="cuda", compilation_config=cc,
          max_num_seqs=8, async_scheduling=True)
out = llm.generate([[5, 17, 99, 3]] * 3, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
print("tokens", [len(o.outputs[0].token_ids) for o in out])
llm.shutdown()
"""


@pytest.mark.parametrize("mode", ["FULL", "TR_HYBRID", "FULL_AND_TR_HYBRID"])
def test_each_mode_starts_in_a_fresh_process(mode):
    """A process's first capture is its first GPU work beyond KV sizing: whatever a recording
    ends with (the LM head, the argmax and its split workspace) must have run eagerly before, or
    start-up fails. Earlier tests in one pytest process would hide that, so each mode starts in a
    process of its own."""
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_START, mode], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert "tokens [6, 6, 6]" in proc.stdout

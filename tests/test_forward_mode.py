"""ForwardMode.decide, table-driven: every graph mode x step kind x batch size x DP size 1 and 2."""

import dataclasses

import pytest

from atomrt.distributed.messages import StepPlan, decode, encode
from atomrt.runtime.config import (
    CompilationConfig,
    Config,
    CUDAGraphMode,
    SchedulerConfig,
    SpeculativeConfig,
)
from atomrt.runtime.decision import BatchShape, CapturedBuckets, ForwardKind
from atomrt.runtime.driver.forward_mode import ForwardMode

LADDER = (1, 2, 4, 8, 16)
PREFILL_TOKEN_SIZES = (16, 64, 256)
EAGER, REQ, TOKEN = ForwardKind.EAGER, ForwardKind.REQ_GRAPH, ForwardKind.TOKEN_GRAPH
M = CUDAGraphMode

# What capture records for each mode (what the runner puts in CapturedBuckets).
CAPTURED = {
    M.NONE: CapturedBuckets(),
    M.FULL: CapturedBuckets(req_keys=[(b, 0) for b in LADDER]),
    M.FULL_DECODE_ONLY: CapturedBuckets(req_keys=[(b, 0) for b in LADDER]),
    M.TR_HYBRID: CapturedBuckets(
        decode_token_sizes=LADDER, prefill_token_sizes=PREFILL_TOKEN_SIZES
    ),
    M.FULL_AND_TR_HYBRID: CapturedBuckets(
        decode_token_sizes=LADDER, prefill_token_sizes=PREFILL_TOKEN_SIZES
    ),
}

# The graph a step of each phase replays under each mode, when a recorded bucket holds it.
GRAPH = {
    M.NONE: {"decode": EAGER, "prefill": EAGER},
    M.FULL: {"decode": REQ, "prefill": EAGER},
    M.FULL_DECODE_ONLY: {"decode": REQ, "prefill": EAGER},
    M.TR_HYBRID: {"decode": TOKEN, "prefill": TOKEN},
    M.FULL_AND_TR_HYBRID: {"decode": TOKEN, "prefill": TOKEN},
}

# The busiest rank's batch per (step kind, size class), and the bucket it pads to (None: beyond).
BATCH = {
    ("decode", "in"): (BatchShape(4, 4, 1, False), 4),
    ("decode", "between"): (BatchShape(5, 5, 1, False), 8),
    ("decode", "beyond"): (BatchShape(20, 20, 1, False), None),
    ("prefill", "in"): (BatchShape(2, 16, 10, True), 16),
    ("prefill", "between"): (BatchShape(2, 40, 30, True), 64),
    ("prefill", "beyond"): (BatchShape(2, 300, 200, True), None),
    ("mixed", "in"): (BatchShape(4, 16, 13, True), 16),
    ("mixed", "between"): (BatchShape(4, 40, 37, True), 64),
    ("mixed", "beyond"): (BatchShape(4, 300, 297, True), None),
}
# A second DP rank's smaller batch of the same kind, or an idle rank.
OTHER = {
    "decode": BatchShape(1, 1, 1, False),
    "prefill": BatchShape(1, 3, 3, True),
    "mixed": BatchShape(2, 4, 3, True),
    "idle": BatchShape.idle(),
}


def make_mode(
    mode: CUDAGraphMode, enforce_eager: bool = False, draft: int = 0, captured=None
) -> ForwardMode:
    config = Config(
        enforce_eager=enforce_eager,
        compilation_config=CompilationConfig(
            cudagraph_mode=mode, cudagraph_capture_sizes=list(LADDER)
        ),
    )
    return ForwardMode(
        config, CAPTURED[mode] if captured is None else captured, num_draft_tokens=draft
    )


CASES = [
    (mode, kind, size, other)
    for mode in CAPTURED
    for kind in ("decode", "prefill", "mixed")
    for size in ("in", "between", "beyond")
    for other in (None, "same", "idle")  # DP=1, DP=2 with a smaller batch, DP=2 with an idle rank
]


@pytest.mark.parametrize("mode, kind, size, other", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_decide_table(mode, kind, size, other):
    batch, bucket = BATCH[(kind, size)]
    batches = [batch] if other is None else [batch, OTHER[kind if other == "same" else "idle"]]
    phase = "decode" if kind == "decode" else "prefill"
    d = make_mode(mode).decide(batches)

    expected_kind = GRAPH[mode][phase] if bucket is not None else EAGER
    assert d.kind is expected_kind, d
    assert d.is_prefill == (phase == "prefill")
    assert d.ubatch_split_bs is None
    assert d.dp_num_tokens == tuple(b.num_tokens for b in batches)
    assert d.dp_padded_tokens == (d.running_tokens,) * len(batches)  # every rank runs the same rows
    if expected_kind is REQ:
        assert d.req_key == (bucket, 0) and d.running_bs == bucket and d.running_tokens == bucket
        assert d.token_bucket is None and d.tr_graph is None
    elif expected_kind is TOKEN:
        assert d.token_bucket == bucket and d.running_tokens == bucket and d.tr_graph == "replay"
        assert d.running_bs == (bucket if phase == "decode" else batch.num_seqs)
        assert d.req_key is None
    else:
        assert d.running_tokens == batch.num_tokens  # the group's largest (the first rank's) count
        assert d.running_bs == batch.num_seqs
        assert d.req_key is None and d.token_bucket is None and d.tr_graph is None


@pytest.mark.parametrize("mode", list(CAPTURED), ids=lambda m: m.name)
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_enforce_eager_always_eager(mode, kind):
    batch, _ = BATCH[(kind, "in")]
    d = make_mode(mode, enforce_eager=True, captured=CAPTURED[mode]).decide([batch, OTHER["idle"]])
    assert (
        d.kind is EAGER
        and d.running_tokens == batch.num_tokens
        and d.dp_padded_tokens == (batch.num_tokens,) * 2
    )


@pytest.mark.parametrize("mode", [M.FULL, M.FULL_DECODE_ONLY, M.TR_HYBRID])
def test_one_rank_prefilling_makes_the_group_a_prefill_step(mode):
    d = make_mode(mode).decide([BatchShape(4, 4, 1, False), BatchShape(1, 8, 8, True)])
    assert d.is_prefill
    if mode == M.TR_HYBRID:
        assert d.kind is TOKEN and d.token_bucket == 16  # the prefill phase's buckets
    else:
        assert d.kind is EAGER and d.running_tokens == 8 and d.dp_padded_tokens == (8, 8)


def test_one_rank_beyond_makes_every_rank_eager():
    d = make_mode(M.FULL).decide([BatchShape(2, 2, 1, False), BatchShape(20, 20, 1, False)])
    assert (
        d.kind is EAGER
        and d.running_tokens == 20
        and d.running_bs == 20
        and d.dp_padded_tokens == (20, 20)
    )


def test_group_bucket_holds_the_largest_rank():
    d = make_mode(M.FULL).decide(
        [BatchShape(3, 3, 1, False), BatchShape(7, 7, 1, False), BatchShape.idle()]
    )
    assert d.kind is REQ and d.req_key == (8, 0) and d.dp_padded_tokens == (8, 8, 8)
    assert d.dp_num_tokens == (3, 7, 0)


def test_every_rank_idle():
    d = make_mode(M.FULL).decide([BatchShape.idle(), BatchShape.idle()])
    assert d.kind is EAGER and d.running_tokens == 0 and d.dp_padded_tokens == (0, 0)


def test_nothing_captured_is_eager():
    for mode in (M.FULL, M.TR_HYBRID):
        d = make_mode(mode, captured=CapturedBuckets()).decide([BatchShape(4, 4, 1, False)])
        assert d.kind is EAGER


def test_tr_hybrid_without_prefill_buckets_runs_prefill_eagerly():
    captured = CapturedBuckets(
        decode_token_sizes=LADDER
    )  # a model that records decode buckets only
    mode = make_mode(M.TR_HYBRID, captured=captured)
    assert mode.decide([BatchShape(1, 4, 4, True)]).kind is EAGER
    assert mode.decide([BatchShape(3, 3, 1, False)]).token_bucket == 4


def test_draft_decode_keys_by_draft_num():
    q = 3  # two draft tokens per sequence
    full = make_mode(M.FULL, draft=2, captured=CapturedBuckets(req_keys=[(b, 2) for b in LADDER]))
    d = full.decide([BatchShape(3, 3 * q, q, False), BatchShape.idle()])
    assert d.kind is REQ and d.req_key == (4, 2) and d.running_tokens == 4 * q and d.running_bs == 4
    assert d.dummy_batch() == BatchShape(4, 12, 3, False)
    # A decode step without its draft rows is not this mode's decode shape: eager.
    assert full.decide([BatchShape(3, 3, 1, False)]).kind is EAGER
    # Recorded for another draft width: no bucket.
    assert make_mode(M.FULL, draft=1).decide([BatchShape(3, 6, 2, False)]).kind is EAGER

    tr = make_mode(
        M.TR_HYBRID, draft=2, captured=CapturedBuckets(decode_token_sizes=[b * q for b in LADDER])
    )
    d = tr.decide([BatchShape(3, 3 * q, q, False)])
    assert d.kind is TOKEN and d.token_bucket == 12 and d.running_bs == 4


def _spec_mode(mode: CUDAGraphMode, async_scheduling: bool, captured) -> ForwardMode:
    config = Config(
        compilation_config=CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2]),
        scheduler_config=SchedulerConfig(async_scheduling=async_scheduling),
        speculative_config=SpeculativeConfig.parse(
            {"method": "ngram", "num_speculative_tokens": 2}
        ),
    )
    return ForwardMode(config, captured, num_draft_tokens=config.max_q_len - 1)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_steps_without_drafts_replay_the_plain_buckets_capture_records(async_scheduling):
    # adaptive n-gram speculation under async scheduling also runs steps without drafts, and
    # capture records plain decode buckets for them beside the verify ones
    plain = async_scheduling
    keys = [(b, d) for b in (1, 2) for d in ((2, 0) if plain else (2,))]
    full = _spec_mode(M.FULL, async_scheduling, CapturedBuckets(req_keys=keys))
    verify = full.decide([BatchShape(2, 6, 3, False)])
    assert verify.kind is REQ and verify.req_key == (2, 2) and verify.running_tokens == 6
    d = full.decide([BatchShape(2, 2, 1, False), BatchShape.idle()])
    if plain:
        assert d.kind is REQ and d.req_key == (2, 0) and d.draft_num == 0
        assert d.running_tokens == 2 and d.dummy_batch() == BatchShape(2, 2, 1, False)
    else:  # synchronous speculation pads every decode step to its drafts: no plain buckets
        assert d.kind is EAGER
    assert full.decide([BatchShape(2, 5, 4, True)]).kind is EAGER  # a prefill step

    sizes = [b * q for b in (1, 2) for q in ((3, 1) if plain else (3,))]
    tr = _spec_mode(M.TR_HYBRID, async_scheduling, CapturedBuckets(decode_token_sizes=sizes))
    d = tr.decide([BatchShape(2, 2, 1, False)])
    if plain:
        assert d.kind is TOKEN and not d.is_prefill
        assert d.token_bucket == 2 and d.running_bs == 2 and d.draft_num == 0
    else:
        assert d.kind is EAGER
    d = tr.decide([BatchShape(1, 3, 3, False)])
    assert d.kind is TOKEN and d.token_bucket == 3 and d.running_bs == 1 and d.draft_num == 2


def test_repeated_shapes_reuse_the_decision_and_new_shapes_get_their_own():
    steps = [
        [BatchShape(3, 3, 1, False)],
        [BatchShape(3, 3, 1, False)],
        [BatchShape(5, 5, 1, False)],
        [BatchShape(1, 9, 9, True)],
        [BatchShape(3, 3, 1, False)],
        [BatchShape(3, 3, 1, False), BatchShape.idle()],
        [BatchShape(3, 3, 1, False), BatchShape(3, 3, 1, False)],
    ]
    mode = make_mode(M.FULL)
    decisions = [mode.decide(s) for s in steps]
    assert decisions == [
        make_mode(M.FULL).decide(s) for s in steps
    ]  # as if each step were decided afresh
    assert decisions[1] is decisions[0]  # a steady decode reuses the frozen decision


def test_a_probed_step_decides_eager_and_the_next_replays_graphs_again():
    """What a probed step needs (its probe reads it in Python): `eager=True` runs it eagerly (a
    repeated shape too); the next unprobed step of the same shape replays the recorded bucket."""
    for m, graph in ((M.FULL, REQ), (M.TR_HYBRID, TOKEN)):
        mode = make_mode(m)
        decode = [BatchShape(4, 4, 1, False)]
        assert mode.decide(decode).kind is graph
        for _ in range(2):
            probed = mode.decide(decode, eager=True)
            assert probed.kind is EAGER and (probed.running_bs, probed.running_tokens) == (4, 4)
        assert mode.decide([BatchShape(2, 16, 10, True)], eager=True).kind is EAGER
        assert mode.decide(decode).kind is graph


def test_decision_is_frozen_and_ships_in_a_plan():
    d = make_mode(M.TR_HYBRID).decide([BatchShape(5, 5, 1, False), BatchShape.idle()])
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.running_tokens = 3
    back = decode(encode(StepPlan(step=0, decision=d))).decision
    assert back == d and back.kind is TOKEN
    eager = make_mode(M.NONE).decide([BatchShape(1, 9, 9, True)])
    assert decode(encode(StepPlan(step=1, decision=eager))).decision == eager


def test_dummy_batch_shapes():
    d = make_mode(M.TR_HYBRID).decide([BatchShape(2, 40, 30, True), BatchShape.idle()])
    assert d.dummy_batch() == BatchShape(1, 64, 64, True)
    d = make_mode(M.FULL).decide([BatchShape(5, 5, 1, False), BatchShape.idle()])
    assert d.dummy_batch() == BatchShape(8, 8, 1, False)


def test_mode_helpers_the_decision_relies_on():
    assert M.FULL_AND_TR_HYBRID.uses_tr_hybrid() and M.TR_HYBRID.uses_tr_hybrid()
    assert not M.FULL_DECODE_ONLY.uses_tr_hybrid()
    assert M.FULL_DECODE_ONLY.decode_mode() == M.FULL and M.FULL_DECODE_ONLY.mixed_mode() == M.NONE


def test_tr_hybrid_decode_at_a_bucket_with_region_graphs_gets_its_request_key():
    """Decode steps whose token bucket holds region graphs for its request bucket carry that
    `req_key` (staged graph-safe, replayed as one launch); prefill steps, buckets without them and
    other draft widths do not."""
    captured = CapturedBuckets(
        decode_token_sizes=LADDER,
        prefill_token_sizes=PREFILL_TOKEN_SIZES,
        token_req_keys=[(b, 0) for b in LADDER if b != 8],
    )
    mode = make_mode(M.TR_HYBRID, captured=captured)
    d = mode.decide([BatchShape(3, 3, 1, False)])
    assert d.kind is TOKEN and d.token_bucket == 4 and d.req_key == (4, 0) == d.tr_req_key
    d = mode.decide([BatchShape(5, 5, 1, False)])
    assert d.kind is TOKEN and d.token_bucket == 8 and d.req_key is None
    d = mode.decide([BatchShape(2, 16, 10, True)])
    assert d.kind is TOKEN and d.is_prefill and d.req_key is None
    d = mode.decide([BatchShape(3, 3, 1, False), BatchShape.idle()])  # the same on every rank
    assert d.req_key == (4, 0) and d.dummy_batch() == BatchShape(4, 4, 1, False)
    assert decode(encode(StepPlan(step=1, decision=d))).decision == d


def test_the_engine_gets_only_the_whole_step_buckets_every_rank_joined():
    """Every rank follows one decision: a bucket one rank could not join as a whole step is not
    offered to ForwardMode (the executors' gather_infos keeps what every rank joined)."""
    from atomrt.runtime.executors.channel import gather_infos
    from atomrt.workers.worker import WorkerInfo

    def info(keys, report):
        return WorkerInfo(
            num_kv_blocks=8,
            vocab_size=32,
            max_model_len=64,
            eos_token_ids=(0,),
            capture_seconds=0.0,
            compile_seconds=0.0,
            capture_sizes=(1, 2, 4),
            req_keys=(),
            prefill_token_sizes=(1, 2, 4),
            decode_token_sizes=(1, 2, 4),
            token_req_keys=keys,
            compile_reports=(report,),
        )

    gathered = gather_infos([info(((1, 0), (2, 0), (4, 0)), "r0"), info(((1, 0), (4, 0)), "r1")])
    assert gathered.token_req_keys == ((1, 0), (4, 0))
    assert gathered.compile_reports == ("r0", "r1")
    captured = CapturedBuckets(
        decode_token_sizes=gathered.decode_token_sizes, token_req_keys=gathered.token_req_keys
    )
    mode = make_mode(M.TR_HYBRID, captured=captured)
    assert mode.decide([BatchShape(2, 2, 1, False)]).req_key is None
    assert mode.decide([BatchShape(3, 3, 1, False)]).req_key == (4, 0)

"""Two-batch overlap: the split arithmetic, table-driven. Where a decode bucket and a prefill step
are cut, what `ForwardMode` decides per `enable_tbo` mode x graph mode x DP ranks (odd batch sizes,
buckets of at most two requests, draft rows, idle ranks, a rank that cannot split), and how a rank
lays its rows out for an eager split (a request straddling the prefill cut, padding, sampled rows,
async tokens). Every DP rank must run the same rows in each microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import pytest

from atomrt.distributed.messages import StepPlan, decode, encode
from atomrt.graphs.ubatch import (
    decode_bucket_splits,
    decode_ubatch_request_ranges,
    uniform_decode_decisions,
)
from atomrt.runtime.config import (
    CompilationConfig,
    Config,
    ConfigError,
    CUDAGraphMode,
    ParallelConfig,
)
from atomrt.runtime.decision import BatchShape, CapturedBuckets, ForwardDecision, ForwardKind
from atomrt.runtime.driver.forward_mode import ForwardMode
from atomrt.runtime.driver.ubatch_policy import check_tbo
from atomrt.workers.runner.input_batch import StepInputs, dummy_idle_inputs
from atomrt.workers.runner.ubatch import split_step

EAGER, REQ, TOKEN = ForwardKind.EAGER, ForwardKind.REQ_GRAPH, ForwardKind.TOKEN_GRAPH
FULL, TR, NONE = CUDAGraphMode.FULL, CUDAGraphMode.TR_HYBRID, CUDAGraphMode.NONE
LADDER = (1, 2, 3, 4, 8, 16)
IDLE = BatchShape.idle()


def decode_shape(seqs: int, draft: int = 0) -> BatchShape:
    return BatchShape(seqs, seqs * (1 + draft), 1 + draft, False)


def prefill_shape(seqs: int, tokens: int, longest: int) -> BatchShape:
    return BatchShape(seqs, tokens, longest, True)


@pytest.mark.parametrize(
    "bs,splits,first,second",
    [
        (0, False, range(0, 0), range(0, 0)),
        (1, False, range(0, 0), range(0, 1)),
        (2, False, range(0, 1), range(1, 2)),
        (3, True, range(0, 1), range(1, 3)),
        (4, True, range(0, 2), range(2, 4)),
        (7, True, range(0, 3), range(3, 7)),
        (16, True, range(0, 8), range(8, 16)),
    ],
)
def test_decode_bucket_cut(bs: int, splits: bool, first: range, second: range) -> None:
    assert decode_bucket_splits(bs) is splits
    assert decode_ubatch_request_ranges(bs) == (first, second)


@dataclass(frozen=True)
class Case:
    tbo: str
    mode: CUDAGraphMode
    ranks: tuple[BatchShape, ...]
    kind: ForwardKind
    rows: Optional[tuple[int, int]]  # (R0, R1), None: no split
    split_bs: Optional[int] = None
    draft: int = 0
    running_bs: Optional[int] = None  # checked when given


# TBO recordings under FULL: every ladder bucket that splits (enable_tbo all / auto).
TIMINGS = ((4, 0.010, 0.008), (8, 0.020, 0.025), (16, 0.040, 0.030))  # split wins at 4 and 16
CASES = {
    # --- decode, eager: each rank cuts its own requests; the largest rank's cut sets the rows
    "eager decode, odd": Case("all", NONE, (decode_shape(5), decode_shape(4)), EAGER, (2, 3), 2),
    "eager decode, idle rank": Case("all", NONE, (decode_shape(7), IDLE), EAGER, (3, 4), 3),
    "eager decode, a rank of one request": Case(
        "all", NONE, (decode_shape(5), decode_shape(1)), EAGER, None
    ),
    "eager decode, two requests": Case(
        "all", NONE, (decode_shape(2), decode_shape(2)), EAGER, None
    ),
    "eager decode, three and two": Case(
        "all", NONE, (decode_shape(3), decode_shape(2)), EAGER, (1, 2), 1
    ),
    "eager decode, draft rows": Case(
        "all", NONE, (decode_shape(5, 2), decode_shape(3, 2)), EAGER, (6, 9), 2, draft=2
    ),
    # --- decode under FULL: the TBO graph of the bucket, whatever each rank scheduled into it
    "full decode, TBO graph": Case(
        "all", FULL, (decode_shape(5), decode_shape(1)), REQ, (4, 4), 4, running_bs=8
    ),
    "full decode, odd bucket": Case(
        "all", FULL, (decode_shape(3), IDLE), REQ, (1, 2), 1, running_bs=3
    ),
    "full decode, bucket of two": Case("all", FULL, (decode_shape(2), IDLE), REQ, None),
    "full decode beyond the ladder: eager split": Case(
        "all", FULL, (decode_shape(17), decode_shape(3)), EAGER, (8, 9), 8, running_bs=17
    ),
    "full decode, draft rows": Case(
        "all", FULL, (decode_shape(3, 1), IDLE), REQ, (2, 4), 1, draft=1, running_bs=3
    ),
    "full decode under prefill: plain graph": Case(
        "prefill", FULL, (decode_shape(5), IDLE), REQ, None
    ),
    # --- decode under TR_HYBRID: token graphs have no split recording, the split runs eagerly
    "token decode splits eagerly": Case(
        "all", TR, (decode_shape(5), decode_shape(3)), EAGER, (2, 3), 2, running_bs=5
    ),
    "token decode of two stays a graph": Case(
        "all", TR, (decode_shape(2), decode_shape(1)), TOKEN, None
    ),
    # --- prefill and mixed steps: cut by rows at the midpoint, every rank the same rows
    "prefill, idle rank": Case("prefill", NONE, (prefill_shape(1, 11, 11), IDLE), EAGER, (5, 6)),
    "prefill beside decode": Case(
        "all", FULL, (prefill_shape(2, 40, 30), decode_shape(5)), EAGER, (20, 20)
    ),
    "token prefill splits eagerly": Case(
        "prefill", TR, (prefill_shape(2, 9, 5), decode_shape(3)), EAGER, (4, 5), running_bs=3
    ),
    "prefill of one row does not split": Case(
        "all", NONE, (prefill_shape(1, 1, 1), IDLE), EAGER, None
    ),
    "a rank with one decode row blocks the prefill split": Case(
        "prefill", NONE, (prefill_shape(1, 8, 8), decode_shape(1)), EAGER, None
    ),
    "none never splits": Case(
        "none", NONE, (prefill_shape(1, 40, 40), decode_shape(9)), EAGER, None
    ),
    # --- auto: decode buckets where the start-up measurement says the split wins
    "auto, bucket 4 wins": Case("auto", FULL, (decode_shape(4), IDLE), REQ, (2, 2), 2),
    "auto, bucket 8 loses": Case("auto", FULL, (decode_shape(6), IDLE), REQ, None, running_bs=8),
    "auto, eager decode by its bucket": Case(
        "auto", NONE, (decode_shape(11), decode_shape(9)), EAGER, (5, 6), 5
    ),
    "auto, beyond the measured buckets": Case("auto", NONE, (decode_shape(20), IDLE), EAGER, None),
    "auto, prefill does not split": Case(
        "auto", NONE, (prefill_shape(1, 40, 40), IDLE), EAGER, None
    ),
}


def _mode(case: Case) -> ForwardMode:
    config = Config(
        enforce_eager=case.mode == NONE,
        compilation_config=CompilationConfig(
            cudagraph_mode=case.mode, cudagraph_capture_sizes=list(LADDER)
        ),
        parallel_config=ParallelConfig(enable_tbo=case.tbo),
    )
    q = 1 + case.draft
    splitting = [b for b in LADDER if decode_bucket_splits(b)]
    records_tbo = case.mode == FULL and case.tbo in ("all", "auto")
    captured = {
        NONE: CapturedBuckets(),
        # under `all` a splitting bucket is recorded only as a TBO graph
        FULL: CapturedBuckets(
            req_keys=[(b, case.draft) for b in LADDER if case.tbo != "all" or b not in splitting],
            tbo_req_keys=[(b, case.draft) for b in splitting] if records_tbo else [],
        ),
        TR: CapturedBuckets(
            decode_token_sizes=[b * q for b in LADDER], prefill_token_sizes=(16, 64, 256)
        ),
    }[case.mode]
    captured = replace(captured, tbo_timings=TIMINGS if case.tbo == "auto" else ())
    return ForwardMode(config, captured, num_draft_tokens=case.draft)


@pytest.mark.parametrize("name", list(CASES))
def test_split_table(name: str) -> None:
    case = CASES[name]
    mode = _mode(case)
    d = mode.decide(case.ranks)
    assert d.kind is case.kind, d
    assert d.ubatch_rows == case.rows, d
    assert d.ubatch_split_bs == case.split_bs and mode.ubatch_split_bs == case.split_bs
    if case.running_bs is not None:
        assert d.running_bs == case.running_bs
    if d.ubatch_rows is None:
        return
    r0, r1 = d.ubatch_rows
    assert r0 > 0 and r1 > 0 and r0 + r1 == d.running_tokens  # every rank runs both microbatches
    if case.split_bs is not None:  # a decode split is at a request boundary
        assert r0 == case.split_bs * (1 + case.draft)
    else:
        assert r0 == d.running_tokens // 2
    # every rank, an idle one's dummy batch included, fits its own cut into the step's microbatches
    for shape in case.ranks:
        if d.kind is EAGER:
            cut = _cut(shape if shape.num_seqs else d.dummy_batch(), d)
            assert 0 < cut <= r0 and 0 < (shape.num_tokens or d.running_tokens) - cut <= r1
    # the decision crosses to the workers unchanged
    plan = decode(encode(StepPlan(step=3, decision=d, ranks=[])))
    assert plan.decision == d


def _cut(shape: BatchShape, d: ForwardDecision) -> int:
    from atomrt.graphs.ubatch import rank_cut

    q = shape.max_seqlen_q if not shape.is_prefill else 0
    cu = np.arange(shape.num_seqs + 1) * q if q else [0, shape.num_tokens]
    return rank_cut(shape.num_seqs, shape.num_tokens, cu, d)


def test_decision_is_cached_per_shape_and_auto_follows_its_measurements() -> None:
    mode = _mode(CASES["auto, bucket 4 wins"])
    assert [v.splits for v in mode.ubatch.verdicts] == [True, False, True]
    assert mode.ubatch.describe()[1] == (
        "decode bucket 8: 20.000 ms unsplit, 25.000 ms split -> unsplit"
    )
    first = mode.decide([decode_shape(4), IDLE])
    assert mode.decide([decode_shape(4), IDLE]) is first
    assert mode.decide([decode_shape(12), IDLE]).ubatch_split_bs == 8  # bucket 16 wins


def test_uniform_decode_decisions_mirror_forward_mode() -> None:
    """What `auto` measures is what ForwardMode runs under `all`, unsplit and split."""
    for case_name in ("full decode, TBO graph", "eager decode, odd", "token decode splits eagerly"):
        case = CASES[case_name]
        mode = _mode(replace(case, tbo="all"))
        captured = mode.captured
        plain, split = uniform_decode_decisions(8, captured, dp_size=2)
        assert split == mode.decide([decode_shape(8), decode_shape(8)])
        assert plain.ubatch_rows is None and split.ubatch_rows == (4, 4)
        assert plain.dp_num_tokens == split.dp_padded_tokens == (8, 8)


# ---------------------------------------------------------------- one rank's rows, eager split


def step_inputs(
    q_lens: list[int], computed: list[int], pending: tuple[int, ...] = ()
) -> StepInputs:
    """Sequences of `q_lens` rows after `computed` tokens, blocks of 4 (sequence s owns blocks
    10 s, 10 s + 1, ...); the last row of each sequence samples."""
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n = int(cu[-1])
    seq_of_row = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = np.asarray(computed)[seq_of_row] + np.arange(n) - cu[:-1][seq_of_row]
    tables = np.asarray([[10 * s + b for b in range(4)] for s in range(len(q_lens))], np.int32)
    token_src = np.arange(n, dtype=np.int64)
    for row in pending:  # async scheduling: this row's token is the previous step's sample
        token_src[row] = 1000 + row
    return StepInputs(
        seq_ids=np.arange(len(q_lens), dtype=np.int64),
        input_ids=np.arange(100, 100 + n, dtype=np.int64),
        positions=positions.astype(np.int64),
        slot_mapping=(tables[seq_of_row, positions // 4] * 4 + positions % 4).astype(np.int64),
        cu_seqlens_q=cu,
        context_lens=(np.asarray(computed) + np.asarray(q_lens)).astype(np.int32),
        block_tables=tables,
        sample_seq_idx=np.arange(len(q_lens), dtype=np.int64),
        sample_rows=cu[1:].astype(np.int64) - 1,
        token_src=token_src if pending else None,
    )


def eager_split(tokens: int, bs: int, split_bs: Optional[int], prefill: bool) -> ForwardDecision:
    d = ForwardDecision(EAGER, bs, tokens, prefill)
    r0 = tokens // 2 if split_bs is None else split_bs
    return replace(d, ubatch_split_bs=split_bs, ubatch_split_tokens=r0)


def test_prefill_straddler_is_in_both_microbatches() -> None:
    """Rows 0-2: a decode row and a 2-row chunk; rows 3-7: a prompt of 5 after 6 computed tokens.
    The step runs 10 rows (another rank has 10): cut at row 4 here, microbatches of 5 + 5."""
    inputs = step_inputs([1, 2, 5], computed=[9, 0, 6], pending=(0,))
    split = split_step(inputs, eager_split(10, 3, None, True))
    assert split.rows == (5, 5) and split.cut == 4
    first, second = split.seqs
    # microbatch 0: sequences 0, 1 and the straddler's first row, its context ending at the cut
    assert first.cu_seqlens_q.tolist() == [0, 1, 3, 4]
    assert first.context_lens.tolist() == [10, 2, 7]
    # microbatch 1: the straddler's other 4 rows, over its whole context (first part's KV included)
    assert second.cu_seqlens_q.tolist() == [0, 4] and second.context_lens.tolist() == [11]
    assert second.block_tables.tolist() == [[20, 21, 22, 23]]
    s = split.inputs  # one padding row after the cut, so microbatch 1 starts at row 5
    assert s.input_ids.tolist() == [100, 101, 102, 103, 0, 104, 105, 106, 107]
    assert s.positions.tolist() == [9, 0, 1, 6, 0, 7, 8, 9, 10]
    assert s.slot_mapping[4] == -1 and s.slot_mapping[5] == inputs.slot_mapping[4]
    assert s.sample_rows.tolist() == [0, 2, 8]  # the straddler samples its last row, moved by 1
    # async: a pending row keeps its pool slot; staged rows and the padding read their own
    assert s.token_src.tolist() == [1000, 1, 2, 3, 4, 5, 6, 7, 8]


def test_decode_rank_cuts_its_own_requests() -> None:
    """An eager decode of 7 requests on the largest rank (3 | 4): a rank of 3 cuts 1 | 2."""
    d = eager_split(7, 7, 3, False)
    split = split_step(step_inputs([1, 1, 1], computed=[4, 5, 6]), d)
    assert (split.rows, split.cut) == ((3, 4), 1)
    assert [m.cu_seqlens_q.tolist() for m in split.seqs] == [[0, 1], [0, 1, 2]]
    assert [m.context_lens.tolist() for m in split.seqs] == [[5], [6, 7]]
    assert split.inputs.input_ids.tolist() == [100, 0, 0, 101, 102]
    assert split.inputs.sample_rows.tolist() == [0, 3, 4]


def test_decode_draft_rows_cut_at_a_request() -> None:
    d = replace(eager_split(12, 4, 2, False), draft_num=2, ubatch_split_tokens=6)
    split = split_step(step_inputs([3, 3, 3], computed=[4, 4, 4]), d)
    assert split.cut == 3 and split.rows == (6, 6)
    assert [m.cu_seqlens_q.tolist() for m in split.seqs] == [[0, 3], [0, 3, 6]]


@pytest.mark.parametrize("prefill", [True, False])
def test_idle_rank_dummy_batch_splits_like_the_step(prefill: bool) -> None:
    d = eager_split(9, 9 if not prefill else 1, None if prefill else 4, prefill)
    shape = d.dummy_batch()
    dummy = dummy_idle_inputs(shape.num_tokens, shape.max_seqlen_q, 64, 128)
    split = split_step(dummy, d)
    assert split.cut == d.ubatch_rows[0] and split.inputs.num_tokens == 9
    assert sum(int(m.cu_seqlens_q[-1]) for m in split.seqs) == 9


# ---------------------------------------------------------------- the knob


def test_enable_tbo_knob() -> None:
    assert ParallelConfig().enable_tbo == "none"
    with pytest.raises(ConfigError, match="parallel_config.enable_tbo"):
        ParallelConfig(enable_tbo="yes")
    config = Config.from_dict({"parallel_config": {"enable_tbo": "auto"}})
    assert config.parallel_config.enable_tbo == "auto"

    from atomrt.runtime.entrypoints.cli import build_parser
    from atomrt.runtime.entrypoints.config_args import config_from_args

    args = build_parser().parse_args(["generate", "--enable-tbo", "prefill", "--prompt", "x"])
    assert config_from_args(args).parallel_config.enable_tbo == "prefill"


def test_tbo_needs_a_moe_model() -> None:
    from atomrt.workers.models.arch import ModelArch

    dense = ModelArch("LlamaForCausalLM", 128, 64, 2, 4, 2, 16, 96, 256)
    check_tbo("none", dense)
    with pytest.raises(ConfigError, match="enable_tbo: 'all' needs a mixture-of-experts"):
        check_tbo("all", dense)
    check_tbo("all", replace(dense, architecture="Qwen3MoeForCausalLM", num_experts=8))

"""The padding arithmetic of data-parallel steps, table-driven: what every DP rank runs, what an
idle rank's dummy batch is, and how many rows are padding, for prefill, decode and draft rows
(a decode sequence runs 1 + draft rows: the arithmetic is running_bs x max_q_len), eager and
graph steps, with idle ranks. Then the `dp_prefill_align` admission rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from atomrt.runtime.config import CompilationConfig, Config, ConfigError, CUDAGraphMode
from atomrt.runtime.decision import BatchShape, CapturedBuckets, ForwardKind
from atomrt.runtime.driver.dp_align import PrefillAligner
from atomrt.runtime.driver.forward_mode import ForwardMode
from atomrt.runtime.driver.stats import EngineStats
from atomrt.runtime.forward_context import DPMetadata
from atomrt.workers.runner.input_batch import dummy_idle_inputs

EAGER, REQ, TOKEN = ForwardKind.EAGER, ForwardKind.REQ_GRAPH, ForwardKind.TOKEN_GRAPH
LADDER = (1, 2, 4, 8, 16)


def decode(seqs: int, draft: int = 0) -> BatchShape:
    return BatchShape(seqs, seqs * (1 + draft), 1 + draft, False)


def prefill(seqs: int, tokens: int, longest: int) -> BatchShape:
    return BatchShape(seqs, tokens, longest, True)


IDLE = BatchShape.idle()


@dataclass(frozen=True)
class Case:
    mode: CUDAGraphMode
    draft: int
    ranks: tuple[BatchShape, ...]
    kind: ForwardKind
    running_bs: int
    running_tokens: int
    dummy: BatchShape  # what an idle rank runs (rows == running_tokens)


FULL, TR, NONE = CUDAGraphMode.FULL, CUDAGraphMode.TR_HYBRID, CUDAGraphMode.NONE
CASES = {
    # eager: every rank runs the group's largest row count
    "eager decode, idle rank": Case(NONE, 0, (decode(3), IDLE), EAGER, 3, 3, decode(3)),
    "eager prefill beside decode": Case(
        NONE, 0, (prefill(2, 40, 30), decode(5)), EAGER, 5, 40, prefill(1, 40, 40)
    ),
    "eager draft decode": Case(NONE, 2, (decode(3, 2), decode(1, 2)), EAGER, 3, 9, decode(3, 2)),
    "eager three ranks, two idle": Case(
        NONE, 0, (IDLE, prefill(1, 7, 7), IDLE), EAGER, 1, 7, prefill(1, 7, 7)
    ),
    # FULL: decode steps pad to the request bucket of the largest sequence count
    "full decode": Case(FULL, 0, (decode(3), decode(5)), REQ, 8, 8, decode(8)),
    "full decode, idle rank": Case(FULL, 0, (IDLE, decode(2)), REQ, 2, 2, decode(2)),
    "full draft decode": Case(FULL, 2, (decode(3, 2), IDLE), REQ, 4, 12, decode(4, 2)),
    "full prefill is eager": Case(
        FULL, 0, (prefill(1, 20, 20), IDLE), EAGER, 1, 20, prefill(1, 20, 20)
    ),
    "full beyond the ladder is eager": Case(
        FULL, 0, (decode(20), decode(1)), EAGER, 20, 20, decode(20)
    ),
    # TR_HYBRID: any step pads to the token bucket of the largest row count, for its phase
    "token decode": Case(TR, 0, (decode(5), decode(2)), TOKEN, 8, 8, decode(8)),
    "token draft decode": Case(TR, 2, (decode(3, 2), IDLE), TOKEN, 4, 12, decode(4, 2)),
    "token prefill beside decode": Case(
        TR, 0, (prefill(2, 40, 30), decode(3)), TOKEN, 3, 64, prefill(1, 64, 64)
    ),
    "token prefill, idle rank": Case(
        TR, 0, (IDLE, prefill(1, 5, 5)), TOKEN, 1, 16, prefill(1, 16, 16)
    ),
    "token prefill beyond is eager": Case(
        TR, 0, (prefill(1, 300, 300), decode(4)), EAGER, 4, 300, prefill(1, 300, 300)
    ),
}


def _mode(case: Case) -> ForwardMode:
    config = Config(
        compilation_config=CompilationConfig(
            cudagraph_mode=case.mode, cudagraph_capture_sizes=list(LADDER)
        )
    )
    q = 1 + case.draft
    captured = {
        NONE: CapturedBuckets(),
        FULL: CapturedBuckets(req_keys=[(b, case.draft) for b in LADDER]),
        # token graphs of decode steps are recorded at bs * (1 + draft) rows
        TR: CapturedBuckets(
            decode_token_sizes=[b * q for b in LADDER], prefill_token_sizes=(16, 64, 256)
        ),
    }[case.mode]
    return ForwardMode(config, captured, num_draft_tokens=case.draft)


@pytest.mark.parametrize("name", list(CASES))
def test_padding_table(name: str) -> None:
    case = CASES[name]
    d = _mode(case).decide(case.ranks)
    assert (d.kind, d.running_bs, d.running_tokens) == (
        case.kind,
        case.running_bs,
        case.running_tokens,
    )
    real = tuple(b.num_tokens for b in case.ranks)
    # every rank, an idle one included, runs running_tokens rows
    assert d.dp_num_tokens == real
    assert d.dp_padded_tokens == (case.running_tokens,) * len(case.ranks)
    waste = len(case.ranks) * case.running_tokens - sum(real)
    stats = EngineStats()
    assert (
        stats.count(d) == waste == DPMetadata.make(list(real), d.running_tokens).num_padded_tokens
    )
    assert stats.dummy_batches == sum(1 for b in case.ranks if b.num_seqs == 0)
    assert d.dummy_batch() == case.dummy
    assert case.dummy.num_tokens == d.running_tokens
    if d.kind is REQ:  # a request bucket's rows are its sequences x (1 + draft)
        assert d.running_tokens == d.running_bs * (1 + case.draft)
        assert d.req_key == (d.running_bs, case.draft)
    inputs = dummy_idle_inputs(
        case.dummy.num_tokens, case.dummy.max_seqlen_q, max_model_len=128, vocab_size=64
    )
    assert inputs.num_tokens == d.running_tokens
    if not case.dummy.is_prefill:  # decode dummies are whole sequences of 1 + draft rows
        assert inputs.num_seqs == case.dummy.num_seqs


def test_engine_stats_accumulate_waste() -> None:
    mode = _mode(CASES["full decode"])
    stats = EngineStats()
    for ranks in [(decode(3), decode(5)), (decode(8), decode(8)), (IDLE, decode(1))]:
        stats.count(mode.decide(ranks))
    assert stats.padded_tokens == 8 + 0 + 1 and stats.real_tokens == 8 + 16 + 1
    assert stats.dummy_batches == 1
    assert stats.pad_fraction == pytest.approx(9 / 34)


# ------------------------------------------------------------------- dp_prefill_align


@dataclass
class Rank:
    waiting: list
    running: list


def ranks(*spec: str) -> list[Rank]:
    """'w': prompts waiting, 'r': sequences running, 'wr': both, '': idle."""
    return [Rank(["p"] if "w" in s else [], ["s"] if "r" in s else []) for s in spec]


@pytest.mark.parametrize(
    "spec,admit",
    [
        (("w", "r"), [False, True]),  # a lone prompt while the other rank decodes: held
        (("wr", "r"), [False, True]),  # held too when its own rank also decodes
        (("w", "w"), [True, True]),  # prompts on both ranks share the step
        (("w", ""), [True, True]),  # nobody else works: holding gains nothing
        (("r", "r"), [True, True]),  # no prompt waits
        (("", "w", "r"), [True, False, True]),
    ],
)
def test_prefill_aligner_table(spec: tuple[str, ...], admit: list[bool]) -> None:
    assert PrefillAligner(3, len(spec)).admits(ranks(*spec)) == admit


def test_prefill_aligner_holds_at_most_n_steps_then_releases() -> None:
    aligner = PrefillAligner(2, 2)
    lone = ranks("w", "r")
    assert [aligner.admits(lone)[0] for _ in range(4)] == [False, False, True, False]
    assert aligner.num_held_steps == 3
    # another rank's prompt arrives: both admit, the count starts over
    assert aligner.admits(ranks("w", "wr")) == [True, True]
    assert aligner.held == [0, 0]


def test_prefill_aligner_off() -> None:
    assert PrefillAligner(0, 2).admits(ranks("w", "r")) == [True, True]
    assert PrefillAligner(5, 1).admits(ranks("w")) == [True]
    with pytest.raises(ConfigError, match="scheduler_config.dp_prefill_align"):
        Config.from_dict({"scheduler_config": {"dp_prefill_align": -1}})


def test_scheduler_without_admission_runs_only_its_running_sequences() -> None:
    """What the rule asks of a rank's scheduler: `schedule(admit=False)` leaves prompts waiting."""
    from atomrt.runtime.config import CacheConfig, SchedulerConfig
    from atomrt.runtime.driver.block_manager import BlockManager
    from atomrt.runtime.driver.scheduler import Scheduler
    from atomrt.runtime.driver.sequence import Sequence
    from atomrt.runtime.sampling_params import SamplingParams

    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=4), BlockManager(32, 4, True))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first, second = Sequence("a", [1, 2, 3], params), Sequence("b", [4, 5], params)
    sched.add(first)
    out = sched.schedule()
    sched.advance(out)
    sched.postprocess(out, {first.seq_id: 7})
    sched.add(second)
    held = sched.schedule(admit=False)
    assert [r.seq.request_id for r in held.scheduled] == ["a"] and not held.is_prefill
    assert list(sched.waiting) == [second]
    sched.advance(held)
    sched.postprocess(held, {first.seq_id: 8})
    assert [r.seq.request_id for r in sched.schedule().scheduled] == ["a", "b"]

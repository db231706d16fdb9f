"""Speculative decoding on the driver, against a deterministic fake model (no workers).

The "workers" here verify each row's drafts greedily against the fake model, exactly as the
rejection sampler does for greedy requests, and a fake draft model proposes for DRAFT_TOKEN rows.
An MTP drafter's proposals come back with a step's result (`StepResult.draft_token_ids`), made
by the fake draft model from each sequence's tokens after the step; every sampled row's KV slots
then reach `num_lookahead_tokens` past the step's rows (its later passes write there).
Under random traffic (chunked prefill, prefix caching, preemption under a small KV pool, EOS and
length stops, n-gram, draft-model and MTP drafts, synchronous and one-step-ahead scheduling) every
request gets exactly the tokens and finish reason it gets without speculation, no KV block leaks or
is double-owned, rejected rows are rolled back, and a repetitive model needs fewer steps than
tokens. The planner ships the drafts as the rows after each sequence's last token.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_block_manager import check_invariants
from test_scheduler import make

from atomrt.distributed.messages import DRAFT_TOKEN, StepResult
from atomrt.runtime.config import SpeculativeConfig
from atomrt.runtime.driver.planner import RankPlanner
from atomrt.runtime.driver.scheduler import RequestRejectedError, Scheduler, SchedulerOutput
from atomrt.runtime.driver.sequence import Sequence
from atomrt.runtime.driver.speculation import Speculation
from atomrt.runtime.sampling_params import SamplingParams

VOCAB = 11
EOS = 10


def cyclic_model(history: list[int]) -> int:
    """Greedy 'model' that mostly repeats itself with period 3 (so n-gram drafts often hit), with
    a deterministic twist every fifth position (so some drafts miss)."""
    if len(history) < 3:
        return (sum(history) + 1) % VOCAB
    return (history[-3] + (len(history) % 5 == 0)) % VOCAB


def fake_drafter(history: list[int]) -> int:
    """A weaker 'draft model': right about the period, never about the twist."""
    return history[-3] % VOCAB if len(history) >= 3 else 0


def _verify(
    out: SchedulerOutput, truth: dict[int, list[int]], proposals: Optional[dict] = None, k: int = 0
) -> dict[int, object]:
    """What the workers return for each sampled row: its token (no drafts) or its tokens; and in
    `proposals` (MTP) its k drafts for the next step."""
    sampled: dict[int, object] = {}
    for row in out.scheduled:
        seq = row.seq
        hist = truth.setdefault(seq.seq_id, list(seq.prompt_token_ids))
        assert seq.token_ids == hist[: seq.num_tokens]
        if not row.is_sampled:
            continue
        base = row.context_len - row.num_draft_tokens  # the tokens before this step's first draft
        context = hist[:base]
        drafts = list(row.draft_token_ids)
        if drafts and drafts[0] == DRAFT_TOKEN:  # the worker's draft model proposes them now
            drafts = []
            for _ in row.draft_token_ids:
                drafts.append(fake_drafter(context + drafts))
        tokens = []
        for d in drafts + [None]:
            predicted = cyclic_model(context + tokens)
            tokens.append(predicted)
            if d != predicted:
                break
        if base == len(hist):
            hist.extend(tokens)
        sampled[seq.seq_id] = tokens if row.num_draft_tokens else tokens[0]
        if proposals is not None:
            proposals[seq.seq_id] = []
            for _ in range(k):
                proposals[seq.seq_id].append(fake_drafter(context + tokens + proposals[seq.seq_id]))
    return sampled


def _mtp_result(out: SchedulerOutput, sampled: dict, proposals: dict) -> StepResult:
    """The StepResult the workers send back for an MTP step (the tokens and the next drafts)."""
    rows = [r for r in out.scheduled if r.is_sampled]
    tokens = [sampled[r.seq.seq_id] for r in rows]
    tokens = [t if isinstance(t, list) else [t] for t in tokens]
    return StepResult(
        0,
        0,
        np.array([r.seq.seq_id for r in rows], np.int64),
        np.array([t[0] for t in tokens], np.int32),
        num_accepted=np.array([len(t) - 1 for t in tokens], np.int32),
        more_token_ids=np.array([x for t in tokens for x in t[1:]], np.int32),
        draft_token_ids=np.array([d for r in rows for d in proposals[r.seq.seq_id]], np.int32),
    )


def _run(sched: Scheduler, seqs: list[Sequence], pipelined: bool) -> tuple[dict, int]:
    truth: dict[int, list[int]] = {}
    inflight: deque[tuple[SchedulerOutput, dict, dict]] = deque()
    planner = RankPlanner()
    spec = sched.speculation
    mtp = spec is not None and spec.config.method == "mtp"
    steps = 0
    for _ in range(5000):
        if not sched.has_unfinished() and not inflight:
            break
        out = sched.schedule()
        if not out.is_empty:
            steps += 1
            batch = planner.batch(out)
            at = 0
            for row in out.scheduled:  # the drafts are each sequence's last rows
                at += row.num_new_tokens
                if row.num_draft_tokens:
                    assert batch.input_ids[at - row.num_draft_tokens : at].tolist() == list(
                        row.draft_token_ids
                    )
            assert batch.num_draft_tokens.tolist() in (
                [],
                [r.num_draft_tokens for r in out.scheduled],
            )
            proposals: dict = {}
            sampled = _verify(out, truth, proposals if mtp else None, spec.k if mtp else 0)
            for row in out.scheduled:  # an MTP drafter's later passes write past the rows
                if mtp and row.is_sampled:
                    need = row.context_len + sched.lookahead
                    assert len(row.seq.block_table) * sched.block_manager.block_size >= need
            sched.advance(out)
            inflight.append((out, sampled, proposals))
        else:
            assert inflight, "nothing scheduled and nothing in flight, yet requests are unfinished"
        if inflight and (not pipelined or len(inflight) == 2 or out.is_empty):
            done, sampled, proposals = inflight.popleft()
            if mtp:  # the drafts come back with the step, before its tokens are appended
                spec.observe(done, _mtp_result(done, sampled, proposals))
            planner.forget([s.seq_id for s in sched.postprocess(done, sampled)])
        check_invariants(sched.block_manager, sched.running)
        for s in sched.running:  # rolled back: nothing past the known tokens counts as computed
            assert s.num_pending or s.num_computed_tokens < s.num_tokens
    else:
        raise AssertionError("did not finish")
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return {s.request_id: (s.output_token_ids, s.finish_reason) for s in seqs}, steps


def _schedule_all(requests, speculation, pipelined, num_blocks, block_size, budget, max_seqs):
    sched = make(num_blocks, block_size, budget, max_seqs, True, True, speculation=speculation)
    seqs = []
    for i, (prompt, max_tokens, ignore_eos) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        s = Sequence(f"r{i}", prompt, params, eos_token_ids={EOS})
        try:
            sched.add(s)
            seqs.append(s)
        except RequestRejectedError:
            pass
    return _run(sched, seqs, pipelined)


@settings(max_examples=50, deadline=None)
@given(
    data=st.data(),
    k=st.integers(1, 4),
    method=st.sampled_from(["ngram", "draft_model", "mtp"]),
    pipelined=st.booleans(),
    num_blocks=st.integers(10, 30),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(6, 24),
    max_seqs=st.integers(1, 4),
)
def test_speculation_gives_the_tokens_of_plain_decoding(
    data, k, method, pipelined, num_blocks, block_size, budget, max_seqs
):
    requests = data.draw(
        st.lists(
            st.tuples(
                st.lists(st.integers(0, 9), min_size=1, max_size=16),
                st.integers(1, 12),
                st.booleans(),
            ),
            min_size=1,
            max_size=5,
        ),
        label="requests",
    )
    shape = (num_blocks, block_size, max(budget, k + 1), max_seqs)
    plain, _ = _schedule_all(requests, None, False, *shape)
    if method == "ngram":
        config = SpeculativeConfig(k, method, prompt_lookup_min=1, prompt_lookup_max=3)
    elif method == "mtp":
        config = SpeculativeConfig(k, method)
    else:
        config = SpeculativeConfig(k, method, model="/draft")
    spec, _ = _schedule_all(requests, Speculation(config), pipelined, *shape)
    # a request rejected for its size without drafts may be rejected with them (k more KV slots,
    # and MTP's k - 1 lookahead slots)
    assert {r: v for r, v in plain.items() if r in spec} == spec


def test_repetitive_text_takes_fewer_steps_than_tokens():
    requests = [([1, 2, 3] * 4, 40, True)]
    plain, plain_steps = _schedule_all(requests, None, False, 64, 4, 32, 4)
    config = SpeculativeConfig(4, "ngram", prompt_lookup_min=1, prompt_lookup_max=3)
    spec, spec_steps = _schedule_all(requests, Speculation(config), False, 64, 4, 32, 4)
    assert spec == plain and len(spec["r0"][0]) == 40
    assert plain_steps == 40 and spec_steps < 0.6 * 40, spec_steps


def test_stats_count_drafts_and_acceptance_per_position():
    config = SpeculativeConfig(3, "ngram", prompt_lookup_min=1, prompt_lookup_max=3)
    speculation = Speculation(config)
    sched = make(64, 4, 32, 4, speculation=speculation)
    s = Sequence("a", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0, max_tokens=9))
    sched.add(s)
    truth: dict[int, list[int]] = {}
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = _verify(out, truth)
        sched.advance(out)
        tokens = sampled[s.seq_id]
        tokens = tokens if isinstance(tokens, list) else [tokens]
        res = StepResult(0, 0, np.array([s.seq_id]), np.array(tokens[:1], np.int32))
        if out.scheduled[0].num_draft_tokens:
            res.num_accepted = np.array([len(tokens) - 1], np.int32)
            res.more_token_ids = np.array(tokens[1:], np.int32)
        speculation.observe(out, res)
        sched.postprocess(out, sampled)
    stats = speculation.stats
    assert (
        stats.num_drafts >= 2 and stats.num_drafts <= stats.num_draft_tokens <= 3 * stats.num_drafts
    )
    per_pos = stats.accepted_per_position
    assert per_pos[0] >= per_pos[1] >= per_pos[2] and sum(per_pos) == stats.num_accepted_tokens
    assert stats.mean_acceptance_length == 1 + stats.num_accepted_tokens / stats.num_drafts
    assert "mean acceptance length" in stats.summary()

# Hot path (driver, once per step): a SchedulerOutput -> the RankBatch that workers need.
# What may live here: deciding what workers lack (new requests, new block-table entries).
"""Building `StepPlan`s: ship the minimum. A sequence's prompt and sampling parameters go once, as a
`NewRequest`; a decode step ships its new token and any new block ids only. Under async scheduling
a row whose token is still pending ships `PENDING_TOKEN`: the workers take it from their previous
step's sample of that sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from atomrt.distributed.messages import (
    PENDING_TOKEN,
    NewRequest,
    RankBatch,
    StepPlan,
    WorkerSamplingParams,
)
from atomrt.runtime.decision import ForwardDecision
from atomrt.runtime.driver.scheduler import SchedulerOutput
from atomrt.runtime.driver.sequence import Sequence
from atomrt.runtime.sampling_params import SamplingParams


def worker_sampling_params(
    p: SamplingParams, bad_words_token_ids: Optional[list[list[int]]] = None
) -> WorkerSamplingParams:
    """The fields of a request's SamplingParams that its workers sample with (its bad words as
    the driver tokenized them)."""
    return WorkerSamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        logit_bias=p.logit_bias,
        allowed_token_ids=p.allowed_token_ids,
        bad_words_token_ids=bad_words_token_ids or None,
    )


def new_request(seq: Sequence) -> NewRequest:
    """What workers need of a sequence they do not hold: its tokens so far (the output tokens too,
    after workers were reset: penalties read them) and its sampling parameters."""
    return NewRequest(
        seq_id=seq.seq_id,
        token_ids=np.asarray(seq.prompt_token_ids, dtype=np.int32),
        output_token_ids=np.asarray(seq.output_token_ids, dtype=np.int32),
        sampling_params=worker_sampling_params(seq.sampling_params, seq.bad_words_token_ids),
    )


@dataclass
class _Known:
    """What a rank's workers hold of one sequence."""

    epoch: int  # the sequence's num_preemptions when its block table was last sent from entry 0
    num_blocks: int  # block-table entries the workers hold


class RankPlanner:
    """The one source of truth for what a DP rank's workers know of each sequence, so a plan ships
    what changed and never a stale count.

    A sequence's blocks are reallocated from scratch when it is preempted (whether or not the step
    that preempted it sent a plan): the workers' table is then stale, which the planner sees from
    the sequence's preemption count and answers by sending the table from entry 0. Finished and
    aborted sequences are freed on the workers by the next plan (`forget`); `reset` forgets every
    sequence and has the next plan clear the workers' state (after a step was discarded).
    """

    def __init__(self, next_tokens: bool = False) -> None:
        """`next_tokens`: ship the token after each prompt chunk that samples nothing
        (`RankBatch.next_token_ids`, which an MTP drafter reads)."""
        self.next_tokens = next_tokens
        self.known: dict[int, _Known] = {}  # seq_id -> what the workers hold
        self.pending_finished: list[int] = []
        self.pending_reset = False

    def forget(self, seq_ids: list[int]) -> None:
        """Sequences that finished or were aborted: the next plan tells the workers to free them."""
        for s in seq_ids:
            if self.known.pop(s, None) is not None:
                self.pending_finished.append(s)

    def reset(self) -> None:
        """The workers' state is gone or untrusted: the next plan clears it and re-sends what it runs."""
        self.known.clear()
        self.pending_finished.clear()
        self.pending_reset = True

    def batch(self, out: SchedulerOutput) -> RankBatch:
        known = self.known
        new_requests, input_ids = [], []
        new_block_seq_ids, new_block_starts, num_new_blocks, new_block_ids = [], [], [], []
        seq_ids, row_new_tokens, row_computed_tokens, sample_mask = [], [], [], []
        num_draft_tokens, next_token_ids = [], []
        grammar_rows, logits_row = [], 0  # structured outputs: the logits rows a grammar masks
        for row in out.scheduled:
            seq = row.seq
            seq_id, block_table, token_ids = seq.seq_id, seq.block_table, seq.token_ids
            k = known.get(seq_id)
            if k is None:
                new_requests.append(new_request(seq))
                k = known[seq_id] = _Known(seq.num_preemptions, 0)
            elif k.epoch != seq.num_preemptions:  # preempted since: its blocks were reallocated
                k.epoch, k.num_blocks = seq.num_preemptions, 0
            num_blocks = len(block_table)
            if num_blocks > k.num_blocks:
                new_block_seq_ids.append(seq_id)
                new_block_starts.append(k.num_blocks)
                num_new_blocks.append(num_blocks - k.num_blocks)
                new_block_ids.extend(block_table[k.num_blocks :])
            k.num_blocks = num_blocks
            start, num_new, drafts = (
                row.num_computed_tokens,
                row.num_new_tokens,
                row.draft_token_ids,
            )
            end = start + num_new - len(drafts)
            input_ids.extend(token_ids[start:end])
            if end > len(token_ids):  # the last row's token is the previous step's, still in flight
                input_ids.append(PENDING_TOKEN)
            input_ids.extend(drafts)
            seq_ids.append(seq_id)
            row_new_tokens.append(num_new)
            row_computed_tokens.append(start)
            sample_mask.append(row.is_sampled)
            num_draft_tokens.append(len(drafts))
            if row.is_sampled:  # its logits rows: its verify rows, then its own
                if seq.grammar is not None:
                    grammar_rows.extend(range(logits_row, logits_row + 1 + len(drafts)))
                logits_row += 1 + len(drafts)
            if self.next_tokens:
                sampled = row.is_sampled or end >= len(token_ids)
                next_token_ids.append(-1 if sampled else token_ids[end])
        finished, self.pending_finished = self.pending_finished, []
        reset, self.pending_reset = self.pending_reset, False
        return RankBatch(
            new_requests=new_requests,
            seq_ids=np.asarray(seq_ids, dtype=np.int64),
            num_new_tokens=np.asarray(row_new_tokens, dtype=np.int32),
            num_computed_tokens=np.asarray(row_computed_tokens, dtype=np.int32),
            input_ids=np.asarray(input_ids, dtype=np.int32),
            new_block_seq_ids=np.asarray(new_block_seq_ids, dtype=np.int64),
            new_block_starts=np.asarray(new_block_starts, dtype=np.int32),
            num_new_blocks=np.asarray(num_new_blocks, dtype=np.int32),
            new_block_ids=np.asarray(new_block_ids, dtype=np.int32),
            sample_mask=np.asarray(sample_mask, dtype=np.bool_),
            finished_seq_ids=np.asarray(finished, dtype=np.int64),
            reset=reset,
            num_draft_tokens=np.asarray(
                num_draft_tokens if any(num_draft_tokens) else (), np.int32
            ),
            next_token_ids=np.asarray(
                next_token_ids if any(t >= 0 for t in next_token_ids) else (), np.int32
            ),
            grammar_rows=np.asarray(grammar_rows, dtype=np.int32),
        )


def make_plan(
    step: int, decision: ForwardDecision, batches: list[RankBatch], pipelined: bool = False
) -> StepPlan:
    return StepPlan(step=step, decision=decision, ranks=batches, pipelined=pipelined)

"""`Scheduler`: picks each step's batch for one DP rank (continuous batching) and applies its
results.

schedule(): running sequences first (decodes and unfinished chunked prefills, oldest first), each
taking min(tokens left, budget) rows; when the KV cache cannot grow, the most recently admitted
running sequence is preempted (recompute: its blocks are freed, num_computed_tokens = 0, and it
goes back to the front of the waiting queue keeping its output tokens). Then, if nothing was
preempted, waiting sequences in FCFS order with what is left of the token budget, after their
prefix-cache hits; one that is not `ready` yet (structured outputs: its grammar still compiles)
is passed over and keeps its place. A sequence is sampled iff its rows reach the end of its
token_ids.

advance(): when the step is submitted, moves every scheduled sequence's num_computed_tokens past
its rows and counts each sampled row as a pending token (`Sequence.num_pending`).

postprocess(): when the step's results are back, registers newly full blocks in the prefix cache,
appends sampled tokens, applies the stop rules (runtime/driver/stop_checker.py) and frees finished
sequences' blocks.

Synchronous scheduling calls advance() and postprocess() back to back. Async scheduling schedules
and submits step N+1 before step N's results are back: a sequence sampled in step N then decodes in
step N+1 from its pending token (the workers take it from their own step-N sample), and one that
turns out to have stopped at step N wastes its step-N+1 row, whose result is dropped. A sequence
whose pending tokens already reach its length limit is not scheduled again.

Speculative decoding (runtime/driver/speculation.py): a decode row of a speculating sequence
carries draft tokens as extra query rows; postprocess() rolls back the rows of rejected drafts
(`num_computed_tokens`; their slots are rewritten later) and appends the accepted tokens. Under
async scheduling no step with drafts is scheduled while a step's tokens are out: how many drafts it
accepts decides where each sequence's next rows start (every step then holds every running
sequence). While `Speculation.wants_drafts` says no (its policy paused n-gram speculation), steps
run ahead as plain async steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from atomrt.runtime.config import CacheConfig, SchedulerConfig
from atomrt.runtime.driver.block_manager import BlockManager
from atomrt.runtime.driver.detokenizer import Detokenizer
from atomrt.runtime.driver.sequence import Sequence, SequenceStatus
from atomrt.runtime.driver.stop_checker import check_stop, refused_token

if TYPE_CHECKING:
    from atomrt.runtime.driver.speculation import Speculation


class RequestRejectedError(ValueError):
    """A request that this scheduler can never run; the message says what to change."""


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # query rows this step (draft rows included)
    draft_token_ids: list[int] = field(default_factory=list)  # the last rows' tokens: drafts
    # Captured when scheduled (postprocess moves the sequence on):
    num_computed_tokens: int = field(init=False)  # position of the first row
    num_tokens: int = field(
        init=False
    )  # the sequence's length at schedule time (pending tokens included)
    # Whether this row block reaches the end of the sequence, so a token is sampled (stored: the
    # planner, advance() and postprocess() each read it for every row).
    is_sampled: bool = field(init=False)
    token_applied: bool = field(
        init=False, default=False
    )  # postprocess appended this row's sampled token

    def __post_init__(self) -> None:
        self.num_computed_tokens = self.seq.num_computed_tokens
        self.num_tokens = self.seq.num_tokens + self.seq.num_pending
        self.is_sampled = self.context_len - len(self.draft_token_ids) == self.num_tokens

    @property
    def context_len(self) -> int:
        """Tokens of context after this step (this step's rows included)."""
        return self.num_computed_tokens + self.num_new_tokens

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def is_decode(self) -> bool:
        """One row of the sequence's last token, plus its drafts."""
        return (
            self.num_new_tokens == 1 + len(self.draft_token_ids)
            and self.num_computed_tokens >= self.seq.num_prompt_tokens
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    is_prefill: bool = False  # any row block that is not a single-token decode
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def num_tokens(self) -> int:
        return self.num_batched_tokens

    @property
    def max_seqlen_q(self) -> int:
        return max((s.num_new_tokens for s in self.scheduled), default=0)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampled_seq_ids(self) -> list[int]:
        return [s.seq.seq_id for s in self.scheduled if s.is_sampled]


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        block_manager: BlockManager,
        tokenizer: Optional[Any] = None,
        max_model_len: Optional[int] = None,
        speculation: Optional[Speculation] = None,
        ready: Optional[Callable[[Sequence], bool]] = None,
    ) -> None:
        self.config = scheduler_config
        # whether a waiting sequence may start (structured outputs: its grammar is compiled); one
        # that may not is passed over, keeping its place, and later ones go first
        self.ready = ready
        self.speculation = speculation  # speculative decoding: draft rows, else None
        # KV slots a drafter writes past a sampled row's step (MTP), allocated with the step's
        self.lookahead = 0
        if speculation is not None:
            self.lookahead = speculation.config.num_lookahead_tokens
        self.cache_config = cache_config
        self.block_manager = block_manager
        self.tokenizer = tokenizer  # gives each sequence a Detokenizer (stop strings need text)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0  # since start

    # ---- requests ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        params = seq.sampling_params
        if seq.detokenizer is None and self.tokenizer is not None and params.detokenize:
            seq.detokenizer = Detokenizer(
                self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens, params.stop
            )
        if params.stop and seq.detokenizer is None:
            raise RequestRejectedError(
                f"request {seq.request_id!r}: stop strings need text; give the Scheduler a tokenizer"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def check_fits(self, seq: Sequence) -> None:
        """Reject what could never finish: the KV it may need (prompt + max_tokens - 1 tokens;
        the last sampled token is never computed) beyond the whole cache or max_model_len."""
        params = seq.sampling_params
        if self.max_model_len is not None and seq.num_prompt_tokens >= self.max_model_len:
            raise RequestRejectedError(
                f"request {seq.request_id!r}: the prompt has {seq.num_prompt_tokens} tokens, "
                f"max_model_len is {self.max_model_len}; shorten the prompt"
            )
        # with speculative decoding the last step's draft rows reach k positions further (and an
        # MTP drafter's lookahead further still), up to position max_model_len - 1
        drafts = self.speculation.k + self.lookahead if self.speculation is not None else 0
        max_kv_tokens = seq.num_prompt_tokens + params.max_tokens - 1 + drafts
        if self.max_model_len is not None:
            max_kv_tokens = min(
                max_kv_tokens, self.max_model_len if drafts else self.max_model_len - 1
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and seq.num_prompt_tokens > budget:
            raise RequestRejectedError(
                f"request {seq.request_id!r}: the prompt has {seq.num_prompt_tokens} tokens but "
                f"scheduler_config.max_num_batched_tokens is {budget} and chunked prefill is off; "
                "raise max_num_batched_tokens or set enable_chunked_prefill"
            )
        capacity = self.block_manager.capacity_tokens
        if max_kv_tokens > capacity:
            raise RequestRejectedError(
                f"request {seq.request_id!r}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                f"({params.max_tokens}) needs {max_kv_tokens} KV slots but the cache holds {capacity} "
                f"({self.block_manager.num_blocks} blocks x {self.block_manager.block_size}); shorten the "
                "prompt, lower max_tokens, or give the KV cache more memory"
            )

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of request_id with reason "abort" and free its blocks."""
        aborted = [s for s in list(self.waiting) + self.running if s.request_id == request_id]
        for seq in aborted:
            if seq in self.running:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self.block_manager.free(seq)
            seq.finish("abort")
        return aborted

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, admit: bool = True) -> SchedulerOutput:
        """`admit=False` schedules running sequences only (runtime/driver/dp_align.py)."""
        out = SchedulerOutput()
        drafts = self.speculation is not None and self.speculation.wants_drafts()
        if drafts and self._in_flight():
            return out  # a verify step's accepted count decides where the next rows start
        budget = self.config.max_num_batched_tokens - self._schedule_running(out, drafts)
        if not out.preempted and admit:
            budget -= self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.is_prefill = any(not s.is_decode for s in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, drafts: bool = False) -> int:
        """Schedule running sequences oldest first, preempting the newest when blocks run out;
        `drafts`: decode rows verify draft tokens (speculative decoding). Returns the tokens
        scheduled."""
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        queue = deque(self.running)
        kept: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            num_new = min(seq.num_tokens + seq.num_pending - seq.num_computed_tokens, budget)
            if (
                num_new <= 0
                or len(out.scheduled) >= self.config.max_num_seqs
                or self._pending_at_limit(seq)
            ):
                kept.append(seq)  # no budget left this step: stays running, unscheduled
                continue
            proposal = self._drafts(seq, num_new, budget) if drafts else []
            num_new += len(proposal)
            slots = num_new + self._lookahead(seq, num_new, len(proposal))
            if bm.blocks_needed(seq, slots):  # a decode mostly fits in its last block: no check
                while not bm.can_append(seq, slots) and queue:
                    self._preempt(queue.pop(), out)
                if not bm.can_append(seq, slots):
                    self._preempt(seq, out)
                    break
                bm.append_slots(seq, slots)
            out.scheduled.append(ScheduledSeq(seq, num_new, proposal))
            budget -= num_new
            kept.append(seq)
        self.running = kept
        return self.config.max_num_batched_tokens - budget

    def _drafts(self, seq: Sequence, num_new: int, budget: int) -> list[int]:
        """Draft tokens a decode row verifies this step (speculative decoding): as many as the
        budget and max_model_len leave room for."""
        if num_new != 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            return []  # a prompt chunk
        room = budget - 1
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - seq.num_tokens)
        return self.speculation.drafts(seq, room)

    def _lookahead(self, seq: Sequence, num_new: int, num_drafts: int) -> int:
        """The KV slots past `num_new` rows that a drafter writes when the rows are sampled (an MTP
        drafter's later passes), within max_model_len."""
        if not self.lookahead:
            return 0
        end = seq.num_computed_tokens + num_new
        if end - num_drafts < seq.num_tokens + seq.num_pending:
            return 0  # a prompt chunk that samples nothing
        return self._within_max_len(end)

    def _lookahead_waiting(self, seq: Sequence, num_new: int, remaining: int) -> int:
        """`_lookahead` for a sequence not yet allocated: `remaining` tokens left after its cache
        hits, of which this step runs `num_new`."""
        if not self.lookahead or num_new < remaining:
            return 0
        return self._within_max_len(seq.num_tokens)

    def _within_max_len(self, end: int) -> int:
        """The lookahead after a step whose rows end at `end`, short of max_model_len."""
        if self.max_model_len is None:
            return self.lookahead
        return max(0, min(self.lookahead, self.max_model_len - end))

    def _in_flight(self) -> bool:
        """Whether a submitted step's tokens are still out (async scheduling)."""
        return any(s.num_pending for s in self.running) or any(s.num_pending for s in self.waiting)

    def _pending_at_limit(self, seq: Sequence) -> bool:
        """Whether the tokens in flight already reach the sequence's length limit (async scheduling)."""
        if not seq.num_pending:
            return False
        if seq.num_output_tokens + seq.num_pending >= seq.sampling_params.max_tokens:
            return True
        return (
            self.max_model_len is not None
            and seq.num_tokens + seq.num_pending >= self.max_model_len
        )

    def _preempt(self, seq: Sequence, out: Optional[SchedulerOutput]) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)  # older victims end up in front of newer ones
        if out is not None:
            out.preempted.append(seq)
            self.num_preemptions += 1

    def requeue_running(self) -> None:
        """The steps in flight were discarded: every running sequence goes back to the front of the
        waiting queue (oldest first, its blocks freed, to recompute), and no sampled token is in
        flight any more."""
        for seq in reversed(self.running):
            self._preempt(seq, None)
        self.running = []
        for seq in self.waiting:
            seq.num_pending = 0

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences FCFS with what is left of the budget, while fewer than
        max_num_seqs sequences run. Returns the tokens scheduled."""
        bm = self.block_manager
        used = 0
        passed: list[Sequence] = []  # not ready: back to the front of the queue after
        while self.waiting and used < budget and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.ready is not None and not self.ready(seq):
                passed.append(self.waiting.popleft())
                continue
            if self._waits_for_parent(seq):
                break
            remaining = seq.num_tokens - bm.num_cached_tokens(seq)
            num_new = min(remaining, budget - used)
            # Without chunked prefill a prompt runs whole; one longer than the full budget (only
            # a long preempted sequence) is chunked anyway, else it could never run again.
            must_chunk = remaining > self.config.max_num_batched_tokens
            if num_new < remaining and not self.config.enable_chunked_prefill and not must_chunk:
                break
            # num_new counts from the cached tokens; the lookahead, from where this chunk ends
            slots = num_new + self._lookahead_waiting(seq, num_new, remaining)
            if not bm.can_allocate(seq, slots):
                break
            self.waiting.popleft()
            bm.allocate(seq, slots)
            seq.status = SequenceStatus.RUNNING
            if (
                seq.first_scheduled_time is None
            ):  # only ever set here: every running sequence came this way
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            used += num_new
        self.waiting.extendleft(reversed(passed))
        return used

    def _waits_for_parent(self, seq: Sequence) -> bool:
        """Sample 2.. of n waits while its parent runs and has yet to put the prompt's blocks in
        the prefix cache, which it then shares. A parent that finished, or waits itself (preempted:
        it may be behind this sample in the queue, and may finish there from a token in flight),
        holds nothing up."""
        parent = seq.parent
        if parent is None or parent.status is not SequenceStatus.RUNNING:
            return False
        shareable = (seq.num_prompt_tokens - 1) // self.block_manager.block_size
        return parent.num_cached_blocks < shareable

    def advance(self, output: SchedulerOutput) -> None:
        """The step was submitted: its rows count as computed, its sampled rows as pending tokens."""
        for row in output.scheduled:
            seq = row.seq
            assert seq.num_computed_tokens == row.num_computed_tokens, (
                f"seq {seq.seq_id} moved since schedule()"
            )
            seq.num_computed_tokens += row.num_new_tokens
            if row.is_sampled:
                seq.num_pending += 1

    def postprocess(
        self,
        output: SchedulerOutput,
        sampled: dict[int, Union[int, list[int]]],
        logprobs: Optional[dict[int, dict[int, float]]] = None,
    ) -> list[Sequence]:
        """Apply one advanced step's results: `sampled` maps seq_id -> token id for every sampled
        row (or, with speculative decoding, its tokens: the accepted drafts and the target's next
        token); `logprobs` (optional) maps seq_id -> {token id: logprob} (sampled token + top ones).
        Returns the sequences that finished this step (their blocks are freed). Rows of sequences
        that finished before (aborted, or stopped at the previous step) are skipped."""
        bm = self.block_manager
        finished: list[Sequence] = []
        for row in output.scheduled:
            seq = row.seq
            if seq.is_finished:
                continue
            if row.is_sampled and seq.seq_id not in sampled:
                raise KeyError(
                    f"postprocess: no sampled token for seq {seq.seq_id} (request {seq.request_id!r})"
                )
            token_ids = sampled[seq.seq_id] if row.is_sampled else ()
            if not isinstance(token_ids, (list, tuple)):
                token_ids = (token_ids,)
            if row.num_draft_tokens and seq.num_computed_tokens == row.context_len:
                # rejected drafts: their KV is void (not if preempted meanwhile: it recomputes)
                seq.num_computed_tokens -= row.num_draft_tokens - (len(token_ids) - 1)
            bm.cache_computed_blocks(seq)
            if not row.is_sampled:
                continue
            seq.num_pending -= 1
            for i, token_id in enumerate(token_ids):
                token_id = int(token_id)
                refused = refused_token(seq, token_id)
                if refused is not None:  # no token satisfied the constraints: it is not emitted
                    seq.error = refused
                    row.token_applied = True
                    seq.finish("abort")
                    finished.append(seq)
                    break
                seq.append_token(token_id, logprobs.get(seq.seq_id) if logprobs and not i else None)
                row.token_applied = True
                reason = check_stop(seq, token_id, self.max_model_len)
                if reason is not None:
                    seq.finish(reason)
                    finished.append(seq)
                    break
        if finished:
            done = {id(s) for s in finished}
            self.running = [s for s in self.running if id(s) not in done]
            if any(s in self.waiting for s in finished):  # preempted while its token was in flight
                self.waiting = deque(s for s in self.waiting if id(s) not in done)
            for seq in finished:
                bm.free(seq)
        return finished

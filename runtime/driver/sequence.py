"""`Sequence`: one request's state on the driver (tokens, KV progress, block table, status).

`token_ids` is prompt + output. `num_computed_tokens` counts the tokens whose KV is in the cache
(or is being written by a submitted step); the scheduler advances it, the block manager owns
`block_table` and `num_cached_blocks`. With async scheduling a step is submitted before the previous
one's tokens are back: `num_pending` counts this sequence's sampled tokens still in flight, which
count towards its length but are not in `token_ids` yet.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional

from atomrt.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atomrt.runtime.driver.detokenizer import Detokenizer
    from atomrt.runtime.driver.grammar_backend import GrammarMatcher

FinishReason = Literal["stop", "length", "abort"]

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"

    def __init__(self, value: str) -> None:
        # A plain attribute of each member: read several times per running sequence per step,
        # where a property testing set membership would call Enum.__hash__ (Python code) each time.
        self.is_finished: bool = value.startswith("finished_")


_STATUS_OF_REASON = {
    "stop": SequenceStatus.FINISHED_STOPPED,
    "length": SequenceStatus.FINISHED_LENGTH,
    "abort": SequenceStatus.FINISHED_ABORTED,
}


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt + output
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset[int] = frozenset()  # the model's EOS ids (ignored with ignore_eos)
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    num_prompt_tokens: int = -1  # -1: all of token_ids at construction
    num_computed_tokens: int = 0
    num_pending: int = 0  # sampled tokens of submitted steps whose results are not back yet
    block_table: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    num_blocks_behind: int = 0  # leading blocks a windowed model's block manager has passed
    block_hashes: list[int] = field(
        default_factory=list
    )  # chained hashes of full blocks of token_ids
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[object] = None  # the stop token id or stop string that ended it
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    detokenizer: Optional[Detokenizer] = None
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    num_streamed_tokens: int = 0  # output tokens already returned by a delta RequestOutput
    index: int = 0  # which of its request's n samples this is
    # Sample 0 of the request, for samples 1..n-1 when their prompt's KV can be shared through the
    # prefix cache: they wait while it runs and has yet to cache the prompt's blocks (never on a
    # parent that waits or finished: see Scheduler._waits_for_parent). None otherwise.
    parent: Optional[Sequence] = field(default=None, repr=False)
    # sampling_params.bad_words as token sequences (the engine tokenizes them)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # With sampling_params.prompt_logprobs: [None, then {token id: Logprob} per prompt token
    # scored so far] (runtime/driver/prompt_logprobs.py); None otherwise.
    prompt_logprobs: Optional[list] = None
    num_cached_tokens: int = -1  # prompt tokens its first allocation found in the prefix cache
    # MTP drafting: the drafts the workers proposed for the step after token `proposed_at - 1`
    # (valid while the sequence is that long)
    proposed_drafts: list[int] = field(default_factory=list, repr=False)
    proposed_at: int = -1
    # structured outputs: its matcher (runtime/driver/grammar_backend.py), which the stop rules
    # advance on every token it emits; None for an unconstrained sequence
    grammar: Optional[GrammarMatcher] = field(default=None, repr=False)
    # why it ended with finish_reason "abort" when something other than a client's abort ended it
    # (no token satisfied its constraints); None otherwise
    error: Optional[str] = None
    # sampling_params.allowed_token_ids as a set, made when a token is first checked against it
    allowed_token_set: Optional[frozenset[int]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)
        if self.num_prompt_tokens == 0:
            raise ValueError(
                f"request {self.request_id!r}: the prompt must hold at least one token"
            )
        self.eos_token_ids = frozenset(self.eos_token_ids)
        self._prompt_token_ids = self.token_ids[: self.num_prompt_tokens]  # see prompt_token_ids

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt, one list for the sequence's life: every RequestOutput of the request holds
        this same list (a streamed row would otherwise copy the whole prompt every step), so it
        must not be modified."""
        return self._prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def output_text(self) -> str:
        """The detokenized output so far (cut before a stop string); "" without a tokenizer."""
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def append_token(self, token_id: int, logprobs: Optional[dict[int, float]] = None) -> None:
        self.token_ids.append(int(token_id))
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.get(int(token_id), 0.0)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def finish(self, reason: FinishReason) -> None:
        self.status = _STATUS_OF_REASON[reason]
        self.finish_reason = reason
        self.finished_time = time.monotonic()

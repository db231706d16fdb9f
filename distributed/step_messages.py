"""The messages of the step path: what the driver sends each worker (`StepPlan`, its per-DP-rank
`RankBatch`es and their `NewRequest`s, `GrammarBitmask`, `Flush`), what a worker sends back
(`StepResult`), and the handshake (`Hello`, `Ready`). Plain dataclasses: their wire form and codec
live in distributed/messages.py, which re-exports every name here.

A decode step ships only what the worker lacks: the new token of each sequence (`input_ids`), its
context length (`num_computed_tokens`, from which the worker derives positions), and the block-table
entries it has not seen. Those travel flat, as four declared arrays (bytes on the wire, no Python
per update): update i replaces sequence `new_block_seq_ids[i]`'s entries from `new_block_starts[i]`
on with the next `num_new_blocks[i]` ids of `new_block_ids` (every update's ids, concatenated in
update order). A sequence's prompt and sampling settings travel once, in its `NewRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

import numpy as np

from atomrt.distributed.wire_arrays import _bool, _i32, _i64
from atomrt.runtime.decision import ForwardDecision

PENDING_TOKEN = (
    -1
)  # RankBatch.input_ids: the sequence's token sampled in the previous step, still in flight
# RankBatch.input_ids: a draft row whose token the worker's draft model proposes in this step
DRAFT_TOKEN = -2


# ---------------------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class WorkerSamplingParams:
    """How a worker samples one sequence's rows: the `SamplingParams` fields the sampler reads, and
    the one shape they have on the worker side. Frozen: what is derived from it is computed once
    per sequence, not once per step."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: Optional[int] = None  # None: unseeded
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Optional[int] = None  # None: none; 0: the sampled token's; k: plus the top k
    # None: none; k: each prompt token's logprob (and rank) plus the top k, from the prefill's rows
    prompt_logprobs: Optional[int] = None
    # Added to the logits before penalties (workers/runner/logit_additions.py):
    logit_bias: Optional[dict[int, float]] = None  # token id -> value
    allowed_token_ids: Optional[list[int]] = None  # every other token is masked
    # token sequences never generated: the last token is masked where the output ends with the rest
    bad_words_token_ids: Optional[list[list[int]]] = None

    @cached_property
    def needs_history(self) -> bool:
        """Whether sampling reads the sequence's output so far (penalties; a seeded row's draw
        number; bad words of several tokens)."""
        return (
            self.seed is not None
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or any(len(w) > 1 for w in self.bad_words_token_ids or ())
        )

    @cached_property
    def changes_logits(self) -> bool:
        """Whether sampling adds to the logits (logit_bias, allowed_token_ids, bad words)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)


@dataclass
class NewRequest:
    """A sequence a worker has not seen: what it prefills and how its rows are sampled."""

    seq_id: int
    token_ids: np.ndarray = field(default_factory=_i32)  # int32 [n]: the prompt
    # int32 [m]: the outputs so far (penalties read them); empty unless the workers were reset
    output_token_ids: np.ndarray = field(default_factory=_i32)
    sampling_params: WorkerSamplingParams = field(default_factory=WorkerSamplingParams)


@dataclass
class RankBatch:
    """One DP rank's share of a step: the step path's one batch type, its sequences (`seq_ids`)
    and their query rows (`input_ids`). Row order of every [bs] array is `seq_ids` order.

    It carries what the worker lacks, not the forward's arrays: the worker derives those, with
    its mirror of the sequences, as a `StepInputs` (workers/runner/input_batch.py), which is not a
    batch (its docstring says why the two stay apart)."""

    new_requests: list[NewRequest] = field(default_factory=list)
    seq_ids: np.ndarray = field(default_factory=_i64)  # int64 [bs]
    num_new_tokens: np.ndarray = field(default_factory=_i32)  # int32 [bs]: query rows per sequence
    num_computed_tokens: np.ndarray = field(
        default_factory=_i32
    )  # int32 [bs]: context before this step
    input_ids: np.ndarray = field(
        default_factory=_i32
    )  # int32 [num_tokens]: this step's rows (or PENDING_TOKEN)
    # The block-table entries the worker lacks, one update per sequence that has any: update i
    # replaces sequence new_block_seq_ids[i]'s entries from new_block_starts[i] on with the next
    # num_new_blocks[i] ids of new_block_ids. Declared together, in this order (the codec's
    # _NEW_BLOCK_FIELDS).
    new_block_seq_ids: np.ndarray = field(default_factory=_i64)  # int64 [num_updates]
    new_block_starts: np.ndarray = field(
        default_factory=_i32
    )  # int32 [num_updates]: first entry replaced
    num_new_blocks: np.ndarray = field(
        default_factory=_i32
    )  # int32 [num_updates]: ids of each update
    new_block_ids: np.ndarray = field(
        default_factory=_i32
    )  # int32 [sum(num_new_blocks)], in update order
    sample_mask: np.ndarray = field(default_factory=_bool)  # bool [bs]: last row sampled this step
    finished_seq_ids: np.ndarray = field(default_factory=_i64)  # int64: free the worker's mirror
    # Drop every mirrored sequence (and pending token) before applying this batch: the driver
    # discarded a step, and re-sends what it runs as new requests.
    reset: bool = False
    # Speculative decoding: int32 [bs], the draft tokens each sequence verifies (its last rows);
    # empty when no row verifies drafts.
    num_draft_tokens: np.ndarray = field(default_factory=_i32)
    # MTP drafting: int32 [bs], the token after a sequence's rows where the step samples none for
    # it (a prompt chunk that is not the last; -1 where unknown or sampled): the MTP layer's input
    # at its last row. Empty when every sequence samples.
    next_token_ids: np.ndarray = field(default_factory=_i32)
    # Structured outputs: int32 [m], the rows of the step's logits (its sampled rows, each with its
    # verify rows) that a grammar constrains, ascending; empty for a step with none. Their masks
    # follow in a `GrammarBitmask` for this step, to this DP rank's sampling worker only.
    grammar_rows: np.ndarray = field(default_factory=_i32)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """The step's query rows on this rank."""
        return int(self.input_ids.shape[0])


@dataclass
class StepPlan:
    """Driver -> every worker, once per step: the ForwardMode decision and each DP rank's batch."""

    step: int
    decision: Optional[ForwardDecision] = None  # None only on the shutdown plan
    ranks: list[RankBatch] = field(default_factory=list)  # index = DP rank
    shutdown: bool = False
    # Async scheduling: the driver publishes the next plan (or a `Flush`) before it waits for this
    # step's result, so a worker launches the next step before it hands this one back.
    pipelined: bool = False
    # A probe the step's workers count (workers/probes.py; "" for none): its result comes back in
    # each DP rank's `StepResult.probe`.
    probe: str = ""


def _f32(x: Any = ()) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


@dataclass
class PromptLogprobs:
    """The prompt logprobs a step computed (in its `StepResult`): for each sequence that asked
    (`WorkerSamplingParams.prompt_logprobs`) and ran prompt rows, one entry per row whose next
    token is a prompt token, in row order. Row i of a sequence whose rows start at position p
    scores prompt token p + i + 1."""

    seq_ids: np.ndarray = field(default_factory=_i64)  # int64 [m]
    num_positions: np.ndarray = field(default_factory=_i32)  # int32 [m]: entries of each
    token_logprobs: np.ndarray = field(default_factory=_f32)  # float32 [rows]: the prompt token's
    token_ranks: np.ndarray = field(default_factory=_i32)  # int32 [rows]: its rank, 1 = best
    top_token_ids: np.ndarray = field(default_factory=_i32)  # int32 [rows, k], best first
    top_logprobs: np.ndarray = field(default_factory=_f32)  # float32 [rows, k]


@dataclass
class StepResult:
    """TP-rank-0 of a DP rank -> driver: the tokens it sampled this step (or the error it hit)."""

    step: int
    dp_rank: int
    seq_ids: np.ndarray = field(default_factory=_i64)  # int64 [n]: sampled rows' sequences
    sampled_token_ids: np.ndarray = field(default_factory=_i32)  # int32 [n]
    logprobs: Optional[np.ndarray] = None  # float32 [n]: the sampled token's logprob
    top_logprob_ids: Optional[np.ndarray] = None  # int32 [n, k]
    top_logprobs: Optional[np.ndarray] = None  # float32 [n, k]
    error: Optional[str] = None
    # Speculative decoding: int32 [n], the drafts each sequence accepted: it emitted
    # `sampled_token_ids[i]` then `num_accepted[i]` more tokens, which `more_token_ids` holds
    # (int32, every sequence's in turn). Both empty: one token each.
    num_accepted: np.ndarray = field(default_factory=_i32)
    more_token_ids: np.ndarray = field(default_factory=_i32)
    # Draft-model passes this step ran eagerly although graphs are on (a missing DraftGraph bucket)
    num_eager_draft_passes: int = 0
    prompt_logprobs: Optional[PromptLogprobs] = None  # when a row asked and ran prompt rows
    # MTP drafting: int32 [n * k], each sampled sequence's k drafts for its next step, in turn
    draft_token_ids: np.ndarray = field(default_factory=_i32)
    # Seconds the step's draft passes took (device time, measured on TP rank 0)
    draft_seconds: float = 0.0
    # What the plan's probe counted on this DP rank (workers/probes.py); None: the step was not
    # probed, or the rank had no rows
    probe: Optional[np.ndarray] = None


@dataclass
class GrammarBitmask:
    """Driver -> the sampling worker (TP rank 0) of DP rank `dp_rank`: the grammar masks of step
    `step`'s `RankBatch.grammar_rows`, one packed row each (bit `t % 32` of word `t // 32` set:
    token `t` allowed). Sent once the masks are known: right after the plan, or, under async
    scheduling, once the previous step's tokens have advanced the grammars. `dp_rank` comes first:
    a worker subscribes to its own rank's masks by the message's leading bytes."""

    dp_rank: int
    step: int
    bitmask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))  # [m, words]


@dataclass
class Flush:
    """Driver -> workers: "send me step `step`'s result now; no plan follows it for a while"
    (async scheduling, when the driver has nothing to submit after a pipelined plan)."""

    step: int


@dataclass
class Hello:
    """Driver -> workers over PUB, repeated until every worker has answered with `Ready`."""

    step: int = -1  # the handshake precedes step 0
    instance: str = ""  # the engine instance: a worker ignores another engine's probe
    nonce: int = 0


@dataclass
class Ready:
    """Worker -> driver over PUSH: "my SUB receives your plans"."""

    rank: int
    nonce: int = 0
    step: int = -1
    pid: int = 0

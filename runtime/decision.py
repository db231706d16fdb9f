"""The step-decision types: what `ForwardMode` (runtime/driver/forward_mode.py) decides once per
step on the driver, and what every worker follows. Plain data: they ship in a msgpack plan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Optional


class ForwardKind(str, enum.Enum):
    """How a step runs. A `str` enum: it ships in a msgpack plan as its value."""

    EAGER = "eager"
    REQ_GRAPH = "req_graph"  # FULL: replay ReqGraph at `req_key`
    TOKEN_GRAPH = "token_graph"  # TR_HYBRID: replay the unit's TokenGraph at `token_bucket`


@dataclass(frozen=True)
class BatchShape:
    """One DP rank's scheduled batch, as the decision needs it. An idle rank has `num_seqs == 0`."""

    num_seqs: int
    num_tokens: int  # query rows this step
    max_seqlen_q: int  # the longest sequence's query rows
    is_prefill: bool  # any prompt rows (prefill or mixed)

    @classmethod
    def idle(cls) -> BatchShape:
        return cls(0, 0, 0, False)


class TboTiming(NamedTuple):
    """`enable_tbo: auto`'s start-up measurement of one decode bucket (the slowest rank's)."""

    running_bs: int
    unsplit_s: float  # seconds of the step unsplit
    split_s: float  # seconds of the step as two microbatches


@dataclass(frozen=True)
class CapturedBuckets:
    """What capture actually recorded (filled by the runner after `capture_cudagraph`).

    `req_keys`: the ReqGraph keys `(running_bs, draft_num)`; `prefill_token_sizes` /
    `decode_token_sizes`: `captured_token_sizes(model, phase)` of the token-graph units.
    `token_req_keys` (TR_HYBRID): the request buckets whose decode steps run as one launch: the token
    bucket's recording joined with the step's unpack, its eager regions recorded for the bucket and
    the LM head (`GraphRunner.step_keys`).
    Two-batch overlap: `tbo_req_keys` are the request buckets recorded as TBO graphs (split at
    `decode_ubatch_request_ranges`); `tbo_timings` are `enable_tbo: auto`'s start-up measurements
    (`TboTiming`), one per decode bucket that splits.
    """

    req_keys: tuple[tuple[int, int], ...] = ()
    prefill_token_sizes: tuple[int, ...] = ()
    decode_token_sizes: tuple[int, ...] = ()
    tbo_req_keys: tuple[tuple[int, int], ...] = ()
    tbo_timings: tuple[TboTiming, ...] = ()
    token_req_keys: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for name in ("req_keys", "tbo_req_keys", "token_req_keys"):
            keys = tuple(sorted((int(b), int(d)) for b, d in getattr(self, name)))
            object.__setattr__(self, name, keys)
        object.__setattr__(
            self, "prefill_token_sizes", tuple(sorted(set(self.prefill_token_sizes)))
        )
        object.__setattr__(self, "decode_token_sizes", tuple(sorted(set(self.decode_token_sizes))))
        timings = tuple(
            sorted(TboTiming(int(b), float(a), float(s)) for b, a, s in self.tbo_timings)
        )
        object.__setattr__(self, "tbo_timings", timings)

    def token_sizes(self, is_prefill: bool) -> tuple[int, ...]:
        return self.prefill_token_sizes if is_prefill else self.decode_token_sizes

    def req_batch_sizes(self, draft_num: int) -> tuple[int, ...]:
        """The request buckets recorded for `draft_num`, as a plain or a TBO graph."""
        keys = set(self.req_keys) | set(self.tbo_req_keys)
        return tuple(sorted(bs for bs, d in keys if d == draft_num))


@dataclass(frozen=True)
class ForwardDecision:
    """One step's decision, the same for every DP rank. Plain fields: ships in a msgpack plan.

    `running_tokens` is the padded row count every rank runs (a graph bucket's rows; eager under DP:
    the group's largest token count; eager on one rank: the real count). `running_bs` is the padded
    sequence count (a request bucket; a decode token bucket's rows / (1 + draft); else the group's
    largest sequence count). `dp_num_tokens` are the real rows per rank, `dp_padded_tokens` the rows
    each rank runs (`running_tokens` each, an idle rank's dummy batch included).

    Two-batch overlap: a split step runs two microbatches, `ubatch_split_tokens` rows then
    `running_tokens - ubatch_split_tokens`, on every rank (`ubatch_rows`). A split decode step has
    `ubatch_split_bs`, the requests of the first microbatch (`ForwardMode.ubatch_split_bs`: the
    bucket's cut in a TBO graph; the largest rank's eagerly); a split prefill step cuts rows at the
    midpoint and has no request count.
    """

    kind: ForwardKind
    running_bs: int
    running_tokens: int
    is_prefill: bool
    draft_num: int = 0
    # REQ_GRAPH: the request graph. TOKEN_GRAPH: a decode step whose token bucket's recording runs
    # as the whole step in one launch, joined with the unpack, its eager regions' request graphs
    # and the LM head (CapturedBuckets.token_req_keys). Either way the step is staged packed as
    # that request bucket's, attention metadata graph-safe, and the graph returns its logits.
    req_key: Optional[tuple[int, int]] = None
    token_bucket: Optional[int] = None  # TOKEN_GRAPH only
    ubatch_split_bs: Optional[int] = None
    ubatch_split_tokens: Optional[int] = None  # rows of the first microbatch; None: no split
    dp_num_tokens: tuple[int, ...] = field(default_factory=tuple)
    dp_padded_tokens: tuple[int, ...] = field(default_factory=tuple)

    @property
    def is_eager(self) -> bool:
        return self.kind is ForwardKind.EAGER

    @property
    def ubatch_rows(self) -> Optional[tuple[int, int]]:
        """Rows of the two microbatches of a split step (the same on every rank), else None."""
        if self.ubatch_split_tokens is None:
            return None
        return self.ubatch_split_tokens, self.running_tokens - self.ubatch_split_tokens

    @property
    def tr_graph(self) -> Optional[str]:
        """What `set_forward_context(..., tr_graph=...)` takes for this step."""
        return "replay" if self.kind is ForwardKind.TOKEN_GRAPH else None

    @property
    def tr_req_key(self) -> Optional[tuple[int, int]]:
        """What `set_forward_context(..., tr_req_key=...)` takes for this step."""
        return self.req_key if self.kind is ForwardKind.TOKEN_GRAPH else None

    def dummy_batch(self) -> BatchShape:
        """The batch an idle rank runs so its collectives match the others'."""
        if self.is_prefill:
            return BatchShape(1, self.running_tokens, self.running_tokens, True)
        q = 1 + self.draft_num
        return BatchShape(self.running_tokens // q, self.running_tokens, q, False)

# Hot path (driver, once per step): only the graph/eager/bucket decision lives here -- pure
# arithmetic over the DP ranks' batch shapes and the buckets capture recorded. No torch, no I/O.
"""`ForwardMode`: the one owner of the step's graph / eager / bucket decision, on the driver.

`ForwardMode(config, captured).decide(batches)` looks at every DP rank's batch at once and returns
one frozen `ForwardDecision` that every rank follows, so the ranks' collectives match:

- `enforce_eager`, or mode NONE: eager.
- A step is *decode* when every rank with work is pure decode, each sequence running
  `1 + draft` query rows (`max_seqlen_q == 1 + draft`, `num_tokens == num_seqs * (1 + draft)`);
  otherwise it is a *prefill* step (prefill or mixed on any rank).
- FULL: a decode step replays the request graph at the smallest recorded bucket
  `(running_bs, draft)` with `running_bs >=` the group's largest `num_seqs`; prefill and mixed steps,
  and decode steps beyond the recorded ladder, run eagerly.
- FULL_DECODE_ONLY: FULL for decode, eager for prefill / mixed.
- TR_HYBRID, and FULL_AND_TR_HYBRID (recorded and run exactly as TR_HYBRID): the step replays the
  token graph at the smallest token bucket recorded for its phase that holds the group's largest
  `num_tokens`; none holds it: eager.
- If one rank must run eagerly, every rank does. Every rank gets the same bucket; a rank with no
  work (`num_seqs == 0`) runs a dummy batch of the decision's shape (`dummy_batch`).

Two-batch overlap (TBO) is not implemented: `ForwardDecision.ubatch_split_bs` is always None.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

from atomrt.graphs.buckets import bucket_for
from atomrt.runtime.config import Config, CUDAGraphMode


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
    def idle(cls) -> "BatchShape":
        return cls(0, 0, 0, False)


@dataclass(frozen=True)
class CapturedBuckets:
    """What capture actually recorded (filled by the runner after `capture_cudagraph`).

    `req_keys`: the ReqGraph keys `(running_bs, draft_num)`; `prefill_token_sizes` /
    `decode_token_sizes`: `captured_token_sizes(model, phase)` of the token-graph units.
    """

    req_keys: tuple[tuple[int, int], ...] = ()
    prefill_token_sizes: tuple[int, ...] = ()
    decode_token_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "req_keys", tuple(sorted((int(b), int(d)) for b, d in self.req_keys)))
        object.__setattr__(self, "prefill_token_sizes", tuple(sorted(set(self.prefill_token_sizes))))
        object.__setattr__(self, "decode_token_sizes", tuple(sorted(set(self.decode_token_sizes))))

    def token_sizes(self, is_prefill: bool) -> tuple[int, ...]:
        return self.prefill_token_sizes if is_prefill else self.decode_token_sizes

    def req_batch_sizes(self, draft_num: int) -> tuple[int, ...]:
        return tuple(bs for bs, d in self.req_keys if d == draft_num)


@dataclass(frozen=True)
class ForwardDecision:
    """One step's decision, the same for every DP rank. Plain fields: ships in a msgpack plan.

    `running_tokens` is the padded row count every rank runs (a graph bucket's rows; eager under DP:
    the group's largest token count; eager on one rank: the real count). `running_bs` is the padded
    sequence count (a request bucket; a decode token bucket's rows / (1 + draft); else the group's
    largest sequence count). `dp_num_tokens` are the real rows per rank, `dp_padded_tokens` the rows
    each rank runs (`running_tokens` each, an idle rank's dummy batch included).
    `ubatch_split_bs` is always None: two-batch overlap is not implemented.
    """

    kind: ForwardKind
    running_bs: int
    running_tokens: int
    is_prefill: bool
    draft_num: int = 0
    req_key: Optional[tuple[int, int]] = None  # REQ_GRAPH only
    token_bucket: Optional[int] = None  # TOKEN_GRAPH only
    ubatch_split_bs: Optional[int] = None
    dp_num_tokens: tuple[int, ...] = field(default_factory=tuple)
    dp_padded_tokens: tuple[int, ...] = field(default_factory=tuple)

    @property
    def is_eager(self) -> bool:
        return self.kind is ForwardKind.EAGER

    @property
    def tr_graph(self) -> Optional[str]:
        """What `set_forward_context(..., tr_graph=...)` takes for this step."""
        return "replay" if self.kind is ForwardKind.TOKEN_GRAPH else None

    def dummy_batch(self) -> BatchShape:
        """The batch an idle rank runs so its collectives match the others'."""
        if self.is_prefill:
            return BatchShape(1, self.running_tokens, self.running_tokens, True)
        q = 1 + self.draft_num
        return BatchShape(self.running_tokens // q, self.running_tokens, q, False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
        d["req_key"] = list(self.req_key) if self.req_key is not None else None
        d["dp_num_tokens"] = list(self.dp_num_tokens)
        d["dp_padded_tokens"] = list(self.dp_padded_tokens)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ForwardDecision":
        d = dict(d)
        d["kind"] = ForwardKind(d["kind"])
        d["req_key"] = tuple(d["req_key"]) if d.get("req_key") is not None else None
        d["dp_num_tokens"] = tuple(d.get("dp_num_tokens", ()))
        d["dp_padded_tokens"] = tuple(d.get("dp_padded_tokens", ()))
        return cls(**d)


class ForwardMode:
    """Decides, once per step on the driver, how every DP rank runs the step (see the module docstring)."""

    def __init__(self, config: Config, captured: CapturedBuckets, num_draft_tokens: int = 0) -> None:
        assert num_draft_tokens >= 0
        self.mode: CUDAGraphMode = config.cudagraph_mode or CUDAGraphMode.NONE
        self.enforce_eager = bool(config.enforce_eager) or self.mode == CUDAGraphMode.NONE
        self.tr_hybrid = self.mode.uses_tr_hybrid()  # FULL_AND_TR_HYBRID runs as TR_HYBRID
        self.captured = captured
        self.draft_num = num_draft_tokens
        self.ubatch_split_bs: Optional[int] = None  # TBO is not implemented
        # The decision is a pure function of the shapes: a steady decode repeats the last one.
        self._last: tuple[tuple[BatchShape, ...], Optional[ForwardDecision]] = ((), None)

    def decide(self, batches: Sequence[BatchShape]) -> ForwardDecision:
        shapes = tuple(batches)
        last_shapes, last_decision = self._last
        if shapes == last_shapes:
            return last_decision
        decision = self._decide(shapes)
        self._last = (shapes, decision)
        return decision

    def _decide(self, batches: tuple[BatchShape, ...]) -> ForwardDecision:
        assert batches, "decide needs one BatchShape per DP rank"
        for b in batches:
            assert b.num_seqs >= 0 and b.num_tokens >= b.num_seqs, f"bad batch shape {b}"
        busy = [b for b in batches if b.num_seqs > 0]
        dp_num_tokens = tuple(b.num_tokens for b in batches)
        max_seqs = max((b.num_seqs for b in busy), default=0)
        max_tokens = max(dp_num_tokens)
        is_decode = bool(busy) and all(self._is_decode(b) for b in busy)
        decision = None
        if busy and not self.enforce_eager:
            if self.tr_hybrid:
                decision = self._pad_to_token_graph(is_decode, max_seqs, max_tokens)
            elif is_decode and self.mode.decode_mode() == CUDAGraphMode.FULL:
                decision = self._pad_to_req_graph(max_seqs)
        if decision is None:
            decision = self._eager(len(batches), not is_decode and bool(busy), max_seqs, max_tokens)
        return _with_dp(decision, dp_num_tokens)

    def _is_decode(self, b: BatchShape) -> bool:
        q = 1 + self.draft_num
        return not b.is_prefill and b.max_seqlen_q == q and b.num_tokens == b.num_seqs * q

    def _pad_to_req_graph(self, max_seqs: int) -> Optional[ForwardDecision]:
        bs = bucket_for(max_seqs, self.captured.req_batch_sizes(self.draft_num))
        if bs is None:
            return None
        q = 1 + self.draft_num
        return ForwardDecision(
            kind=ForwardKind.REQ_GRAPH,
            running_bs=bs,
            running_tokens=bs * q,
            is_prefill=False,
            draft_num=self.draft_num,
            req_key=(bs, self.draft_num),
        )

    def _pad_to_token_graph(self, is_decode: bool, max_seqs: int, max_tokens: int) -> Optional[ForwardDecision]:
        bucket = bucket_for(max_tokens, self.captured.token_sizes(not is_decode))
        if bucket is None:
            return None
        q = 1 + self.draft_num
        return ForwardDecision(
            kind=ForwardKind.TOKEN_GRAPH,
            running_bs=bucket // q if is_decode else max_seqs,
            running_tokens=bucket,
            is_prefill=not is_decode,
            draft_num=self.draft_num,
            token_bucket=bucket,
        )

    def _eager(self, dp_size: int, is_prefill: bool, max_seqs: int, max_tokens: int) -> ForwardDecision:
        # One rank runs its real rows; DP ranks step in lockstep, padded to the group's largest count.
        return ForwardDecision(
            kind=ForwardKind.EAGER,
            running_bs=max_seqs,
            running_tokens=max_tokens,
            is_prefill=is_prefill,
            draft_num=self.draft_num,
        )


def _with_dp(d: ForwardDecision, dp_num_tokens: tuple[int, ...]) -> ForwardDecision:
    return replace(d, dp_num_tokens=dp_num_tokens, dp_padded_tokens=(d.running_tokens,) * len(dp_num_tokens))

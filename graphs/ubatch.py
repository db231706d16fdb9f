"""Two-batch overlap (TBO): where a step splits into two microbatches. Pure arithmetic over ints,
shared by the driver (`ForwardMode` decides the split once, for every DP rank) and the workers
(which cut their batch at it, or record a TBO graph at it).

A split step runs two microbatches of `R0` and `R1` rows on every DP rank, so each one's MoE
exchanges across DP ranks line up (`ForwardDecision.ubatch_rows`). Where each rank's own rows fall:

- A decode bucket splits when it holds more than two requests (`decode_bucket_splits`); its
  requests are cut at `decode_ubatch_request_ranges(running_bs)`: the first half (rounded down),
  then the rest. Every request runs `q = 1 + draft_num` rows, so `R0 = len(first) * q`. A TBO graph
  is recorded at the bucket's cut; an eager split decode cuts each rank's own scheduled requests
  with the same function (`rank_cut`), so a rank's microbatches are at most the bucket's.
- A prefill (or mixed) step is cut by rows at the midpoint: `R0 = running_tokens // 2`, and each
  rank cuts its own rows at their midpoint. A request that straddles the cut runs its first rows
  in microbatch 0 and the rest in microbatch 1, whose attention sees the first part's KV as context.
- A rank that cannot split its batch (an eager decode rank with one request, a rank with one row)
  makes no rank split: `rank_can_split`. An idle rank runs a dummy batch of the decision's shape,
  which always splits; a TBO graph pads every rank to the bucket, which always splits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from atomrt.runtime.decision import BatchShape, CapturedBuckets, ForwardDecision, ForwardKind


class RequestRanges(NamedTuple):
    """The requests of the two microbatches, as `range`s over a batch's request indices."""

    first: range
    second: range


def decode_bucket_splits(running_bs: int) -> bool:
    """Whether a decode bucket of `running_bs` requests splits into two microbatches."""
    return running_bs > 2


def decode_ubatch_request_ranges(running_bs: int) -> RequestRanges:
    """Requests `[0, running_bs // 2)` then `[running_bs // 2, running_bs)`."""
    assert running_bs >= 0, f"running_bs must be >= 0, got {running_bs}"
    half = running_bs // 2
    return RequestRanges(range(0, half), range(half, running_bs))


def prefill_ubatch_cut(num_tokens: int) -> int:
    """The row a prefill step is cut at: its midpoint, rounded down."""
    return num_tokens // 2


def rank_can_split(shape: BatchShape, q: int) -> bool:
    """Whether one DP rank can cut its own batch into two microbatches with work in each, in an
    eager split (a TBO graph's bucket always splits). An idle rank runs the decision's dummy batch:
    it always can. `q`: rows per decode request (1 + draft_num)."""
    if shape.num_seqs == 0:
        return True
    if shape.is_prefill or shape.num_tokens != shape.num_seqs * q:
        return shape.num_tokens >= 2
    return len(decode_ubatch_request_ranges(shape.num_seqs).first) > 0


def split_decision(d: ForwardDecision, ubatch_split_bs: int | None) -> ForwardDecision:
    """`d` split: a decode step after `ubatch_split_bs` requests, a prefill step (None) at the
    midpoint of its rows."""
    if ubatch_split_bs is None:
        return replace(d, ubatch_split_tokens=prefill_ubatch_cut(d.running_tokens))
    q = 1 + d.draft_num
    return replace(d, ubatch_split_bs=ubatch_split_bs, ubatch_split_tokens=ubatch_split_bs * q)


def rank_cut(
    num_seqs: int, num_tokens: int, cu_seqlens_q: Sequence[int], d: ForwardDecision
) -> int:
    """The row one rank cuts its own `num_tokens` rows at in the split step `d` (eager: its own
    midpoint; see the module docstring). Never beyond the decision's first microbatch."""
    assert d.ubatch_rows is not None, "not a split step"
    if d.is_prefill:
        cut = prefill_ubatch_cut(num_tokens)
    else:
        cut = int(cu_seqlens_q[decode_ubatch_request_ranges(num_seqs).first.stop])
    r0, r1 = d.ubatch_rows
    assert cut <= r0 and num_tokens - cut <= r1, (
        f"a rank's cut ({cut} | {num_tokens - cut} rows) exceeds the step's microbatches {r0} | {r1}"
    )
    return cut


def uniform_decode_decisions(
    bs: int, captured: CapturedBuckets, dp_size: int
) -> tuple[ForwardDecision, ForwardDecision]:
    """(unsplit, split) decisions of a decode step of `bs` single-row requests on every DP rank, as
    `ForwardMode` takes them under `enable_tbo: all`: what `enable_tbo: auto` measures at start-up.
    Unsplit: the request graph, else the token graph, else eager; split: the TBO graph, else eager."""
    key = (bs, 0)
    if key in captured.req_keys:
        plain = ForwardDecision(ForwardKind.REQ_GRAPH, bs, bs, False, req_key=key)
    elif bs in captured.decode_token_sizes:
        plain = ForwardDecision(ForwardKind.TOKEN_GRAPH, bs, bs, False, token_bucket=bs)
    else:
        plain = ForwardDecision(ForwardKind.EAGER, bs, bs, False)
    if key in captured.tbo_req_keys:
        split = ForwardDecision(ForwardKind.REQ_GRAPH, bs, bs, False, req_key=key)
    else:
        split = ForwardDecision(ForwardKind.EAGER, bs, bs, False)
    split = split_decision(split, len(decode_ubatch_request_ranges(bs).first))
    dp = dict(dp_num_tokens=(bs,) * dp_size, dp_padded_tokens=(bs,) * dp_size)
    return replace(plain, **dp), replace(split, **dp)

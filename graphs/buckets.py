"""Bucket arithmetic for CUDA graphs: request-bucket keys, bucket lookup, capture order.

Pure functions over ints, no CUDA: the driver (`ForwardMode`) and the worker
(`ModelRunner`) both use them, and the CPU test suite covers them.

- A request bucket (FULL graphs) is `request_bucket(running_bs, max_seqlen_q) == (running_bs,
  draft_num)`: the padded sequence count and the draft tokens each sequence verifies.
- A token bucket (TR_HYBRID graphs) is a padded row count.
- `bucket_for(n, sizes)` is the smallest captured bucket that holds `n`, or None beyond the ladder.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Optional


class RequestBucket(NamedTuple):
    """Key of a FULL request graph."""

    running_bs: int  # padded sequence count
    draft_num: int  # draft tokens each sequence verifies (0: plain decode)


def request_bucket(running_bs: int, max_seqlen_q: int) -> RequestBucket:
    """The guide's key: `(running_bs, max_seqlen_q - 1)`; a decode row plus its draft rows."""
    assert running_bs > 0, f"running_bs must be positive, got {running_bs}"
    assert max_seqlen_q >= 1, f"max_seqlen_q must be >= 1, got {max_seqlen_q}"
    return RequestBucket(int(running_bs), int(max_seqlen_q) - 1)


def sorted_sizes(sizes: Iterable[int]) -> tuple[int, ...]:
    """Ascending, without duplicates; every size positive."""
    out = tuple(sorted(set(int(s) for s in sizes)))
    assert all(s > 0 for s in out), f"bucket sizes must be positive, got {out}"
    return out


def bucket_for(n: int, sizes: Sequence[int]) -> Optional[int]:
    """Smallest size in ascending `sizes` that is >= n; None when n is beyond the largest."""
    assert n >= 0, f"a count cannot be negative, got {n}"
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def capture_order(sizes: Iterable[int]) -> list[int]:
    """Largest first: the first recording sizes the shared pool, the smaller ones reuse it."""
    return sorted(set(int(s) for s in sizes), reverse=True)

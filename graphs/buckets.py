"""Bucket arithmetic for CUDA graphs: request-bucket keys, bucket lookup, padding of static buffers.

Pure functions over ints and tensors, no CUDA: the driver (`ForwardMode`) and the worker
(`ModelRunner`) both use them, and the CPU test suite covers them.

- A request bucket (FULL graphs) is `request_bucket(running_bs, max_seqlen_q) == (running_bs,
  draft_num)`: the padded sequence count and the draft tokens each sequence verifies.
- A token bucket (TR_HYBRID graphs) is a padded row count.
- `bucket_for(n, sizes)` is the smallest captured bucket that holds `n`, or None beyond the ladder.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterable, NamedTuple, Optional, Sequence

import torch


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


def token_buckets(batch_sizes: Iterable[int], max_seqlen_q: int) -> tuple[int, ...]:
    """Token buckets a decode record pass visits: `bs * max_seqlen_q` for each batch size."""
    return sorted_sizes(bs * max_seqlen_q for bs in batch_sizes)


def fill_padded(buffer: torch.Tensor, values: torch.Tensor, num_padded: int, pad_value: int | float = 0) -> torch.Tensor:
    """Copy `values` into the head of a static `buffer` and fill rows up to `num_padded` with `pad_value`.

    Returns `buffer[:num_padded]`, a view of the static buffer (its address is what a graph recorded).
    Rows are the first dimension: `slot_mapping` pads with -1, `input_ids`/`positions` with 0,
    `block_tables` rows of padded sequences with -1.
    """
    n = values.shape[0]
    assert n <= num_padded <= buffer.shape[0], (
        f"{n} rows padded to {num_padded} do not fit a static buffer of {buffer.shape[0]} rows"
    )
    assert values.shape[1:] == buffer.shape[1:], f"row shape {tuple(values.shape[1:])} != {tuple(buffer.shape[1:])}"
    buffer[:n].copy_(values, non_blocking=True)
    if num_padded > n:
        buffer[n:num_padded].fill_(pad_value)
    return buffer[:num_padded]


def cu_seqlens_padded(query_lens: Sequence[int], running_bs: int, num_padded_tokens: int) -> list[int]:
    """`cu_seqlens_q` for `running_bs` sequences: the real ones, then padding sequences.

    Padding sequences take the leftover rows in equal steps where they can (a padded decode bucket:
    one row each), the last one absorbing the rest, so `cu[-1] == num_padded_tokens`.
    """
    bs = len(query_lens)
    assert bs <= running_bs, f"{bs} sequences do not fit running_bs={running_bs}"
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + int(q))
    assert cu[-1] <= num_padded_tokens, f"{cu[-1]} rows do not fit {num_padded_tokens} padded rows"
    num_pad_seqs = running_bs - bs
    if num_pad_seqs:
        step = (num_padded_tokens - cu[-1]) // num_pad_seqs
        for _ in range(num_pad_seqs - 1):
            cu.append(cu[-1] + step)
        cu.append(num_padded_tokens)
    return cu

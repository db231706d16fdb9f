"""Collectives the model calls, safe inside a CUDA-graph capture, and the DP padding arithmetic.

Hot path. What may live here: in-place or preallocated collectives with no host synchronisation
and no Work.wait() (so a capture can record them), and pure functions on token counts.
"""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from atomrt.runtime.forward_context import DPMetadata
from atomrt.distributed.parallel_state import GroupInfo, get_dp_group, get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor, group: Optional[GroupInfo] = None) -> torch.Tensor:
    """Sum `x` over the TP group, in place; returns `x`. A no-op for one rank."""
    g = group or get_tp_group()
    if g.world_size == 1:
        return x
    dist.all_reduce(x, group=g.group)
    return x


def tensor_model_parallel_all_gather(
    x: torch.Tensor, group: Optional[GroupInfo] = None, dim: int = -1
) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim` (rank order). A no-op for one rank."""
    g = group or get_tp_group()
    if g.world_size == 1:
        return x
    if x.dim() == 0:
        raise ValueError("tensor_model_parallel_all_gather: need a tensor with at least one dimension")
    dim = dim % x.dim()
    x = x.contiguous()
    # gloo wants the output concatenated along dim 0: [ws * d0, d1, ..]
    out = torch.empty((g.world_size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=g.group)
    if dim == 0:
        return out
    # [ws, d0, .., d_dim, ..] -> [d0, .., ws * d_dim, ..]
    out = out.view((g.world_size,) + tuple(x.shape)).movedim(0, dim)
    return out.reshape(x.shape[:dim] + (g.world_size * x.shape[dim],) + x.shape[dim + 1 :])


def dp_all_gather_num_tokens(num_tokens: int, group: Optional[GroupInfo] = None) -> list[int]:
    """Every DP rank's token count, in DP-rank order, over the gloo group (host-side, no device sync)."""
    g = group or get_dp_group()
    if g.world_size == 1:
        return [int(num_tokens)]
    mine = torch.tensor([int(num_tokens)], dtype=torch.int64)
    out = torch.empty(g.world_size, dtype=torch.int64)
    dist.all_gather_into_tensor(out, mine, group=g.cpu_group)
    return out.tolist()


def dp_pad(num_tokens_per_rank: Sequence[int], buckets: Sequence[int]) -> Optional[int]:
    """The row count every DP rank runs: the smallest bucket holding the group's largest count.

    `buckets` are the captured sizes (any order). None when no bucket holds the max: the step runs
    eagerly on every rank, padded to `max(num_tokens_per_rank)`.
    """
    if not num_tokens_per_rank:
        raise ValueError("dp_pad: need at least one rank's token count")
    need = max(num_tokens_per_rank)
    ordered = sorted(buckets)
    i = bisect.bisect_left(ordered, need)
    return ordered[i] if i < len(ordered) else None


def make_dp_metadata(num_tokens_per_rank: Sequence[int], buckets: Sequence[int]) -> DPMetadata:
    """DPMetadata for a step: real rows per rank and the padded row count (bucket, else the max)."""
    padded = dp_pad(num_tokens_per_rank, buckets)
    return DPMetadata.make(list(num_tokens_per_rank), padded if padded is not None else max(num_tokens_per_rank))

"""The one home of the collectives a model calls, and `TPInfo`, which says who calls them.

Hot path. What may live here: collectives with no host synchronisation and no `Work.wait()`, so a
CUDA-graph capture can record them. A model receives a `TPInfo` and passes it down to every
parallel layer; with `tp_size == 1` every collective is the identity, so a single-rank model never
touches torch.distributed. The process groups themselves are built in `parallel_state`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    """This rank's place in its tensor-parallel group."""

    tp_rank: int = 0
    tp_size: int = 1
    group: Optional[Any] = None  # a torch.distributed ProcessGroup when tp_size > 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"TPInfo: need 0 <= tp_rank < tp_size, got rank {self.tp_rank} of {self.tp_size}"
            )


def tp_all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Sum `x` over the TP group, in place; returns `x`."""
    if tp.tp_size == 1:
        return x
    dist.all_reduce(x, group=tp.group)
    return x


def tp_all_gather(x: torch.Tensor, tp: TPInfo, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim`, in rank order."""
    if tp.tp_size == 1:
        return x
    if x.dim() == 0:
        raise ValueError("tp_all_gather: need a tensor with at least one dimension")
    x = x.contiguous()
    # all_gather into a list works on both NCCL and gloo (the CPU tier runs TP on gloo)
    parts = [torch.empty_like(x) for _ in range(tp.tp_size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=dim)  # [..., tp_size * x.shape[dim], ...]


def tp_broadcast(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Every TP rank's `x` becomes TP rank 0's, in place; returns `x`."""
    if tp.tp_size == 1:
        return x
    dist.broadcast(x, group=tp.group, group_src=0)
    return x

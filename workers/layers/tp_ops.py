"""Tensor parallelism as the layers see it: who am I (`TPInfo`) and the two collectives.

The process groups are built elsewhere (atomrt.distributed); a model receives a `TPInfo` and
passes it down to every parallel layer. With `tp_size == 1` both collectives are the identity,
so a single-rank model never touches torch.distributed.
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
            raise ValueError(f"TPInfo: need 0 <= tp_rank < tp_size, got rank {self.tp_rank} of {self.tp_size}")


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division, with an error that names what did not split evenly."""
    if numerator % denominator != 0:
        raise ValueError(f"{what}: {numerator} is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator


def tp_all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Sum `x` over the TP group (in place); the identity when tp_size == 1."""
    if tp.tp_size == 1:
        return x
    dist.all_reduce(x, group=tp.group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension, in rank order."""
    if tp.tp_size == 1:
        return x
    x = x.contiguous()
    # all_gather with a list works on both NCCL and gloo (the CPU tier runs TP on gloo)
    parts = [torch.empty_like(x) for _ in range(tp.tp_size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=-1)  # [..., tp_size * last]

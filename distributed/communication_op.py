"""The one home of the collectives a model calls, and `TPInfo` / `DPInfo`, which say who calls them.

Hot path. What may live here: collectives with no host synchronisation and no `Work.wait()` on the
device, so a CUDA-graph capture can record them. A model receives a `TPInfo` and a `DPInfo` at
construction and passes them down to every parallel layer: that is the one way a layer reaches its
groups. With `tp_size == 1` (`dp_size == 1`) every TP (DP) collective is the identity, so a
single-rank model never touches torch.distributed. The process groups themselves are built in
`parallel_state`.

The DP collectives (a MoE layer's gather of every DP rank's rows and the scatter back) carry a
deadline: on a host (gloo) group each waits at most `DPInfo.timeout_s` and then raises
`CollectiveTimeout` naming the DP rank (the worker's step loop adds the step); on a device (NCCL)
group, where a CUDA graph may record the collective, the process group's own timeout bounds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
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


@dataclass(frozen=True)
class DPInfo:
    """This rank's place among the data-parallel ranks of its TP index: `group` holds one rank per
    DP rank (the ranks `{t, t + tp, t + 2 tp, ...}`). Only MoE layers communicate across DP ranks."""

    dp_rank: int = 0
    dp_size: int = 1
    group: Optional[Any] = None  # a torch.distributed ProcessGroup when dp_size > 1
    timeout_s: float = 120.0  # the deadline of each DP collective on a host group

    def __post_init__(self) -> None:
        if self.dp_size < 1 or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(
                f"DPInfo: need 0 <= dp_rank < dp_size, got rank {self.dp_rank} of {self.dp_size}"
            )


class CollectiveTimeout(RuntimeError):
    """A collective across ranks did not complete by its deadline; the message names the rank."""


# The names torch 2.12+ gives all_gather_into_tensor / reduce_scatter_tensor (the old ones warn).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def dp_all_gather(x: torch.Tensor, dp: DPInfo) -> torch.Tensor:
    """[n, ...] on every DP rank (the same n everywhere: the step's `running_tokens`) ->
    [dp_size * n, ...], the ranks' rows in DP-rank order."""
    if dp.dp_size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((dp.dp_size * x.shape[0], *x.shape[1:]))
    _dp_collective(_all_gather_single, "all_gather", out, x, dp)
    return out


def dp_reduce_scatter(x: torch.Tensor, dp: DPInfo) -> torch.Tensor:
    """[dp_size * n, ...] -> [n, ...]: on DP rank d, the sum over the DP ranks of rows
    [d * n, (d + 1) * n) (what `dp_all_gather` took from rank d, once processed)."""
    if dp.dp_size == 1:
        return x
    if x.shape[0] % dp.dp_size:
        raise ValueError(
            f"dp_reduce_scatter: {x.shape[0]} rows do not split over {dp.dp_size} ranks"
        )
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // dp.dp_size, *x.shape[1:]))
    _dp_collective(_reduce_scatter_single, "reduce_scatter", out, x, dp)
    return out


def _dp_collective(op: Any, name: str, out: torch.Tensor, x: torch.Tensor, dp: DPInfo) -> None:
    if x.is_cuda or torch.compiler.is_compiling():
        op(out, x, group=dp.group)  # graph-safe; bounded by the process group's timeout
        return
    work = op(out, x, group=dp.group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=dp.timeout_s))
    except RuntimeError as e:
        raise CollectiveTimeout(
            f"dp rank {dp.dp_rank} of {dp.dp_size}: {name} of {x.shape[0]} rows over the "
            f"data-parallel group failed, or passed its deadline of {dp.timeout_s:.0f} s "
            f"(parallel_config.worker_timeout_s): {e}"
        ) from e


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

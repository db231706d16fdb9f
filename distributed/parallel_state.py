"""Process groups of one worker: the world, its TP and DP groups, and gloo twins for host-side control.

Layout: `rank = dp_rank * tp_size + tp_rank`. TP group `d` holds ranks `[d*tp, (d+1)*tp)`; DP group
`t` holds ranks `{t, t + tp, t + 2*tp, ...}`. Each group has a device group (NCCL on GPU, gloo on
CPU) and a gloo `cpu_group` for small host-side exchanges. On a gloo world the two are the same.

The groups are process-global by nature (torch.distributed's are); this module keeps them in one
`_groups` slot that `init_distributed` fills and `destroy_distributed` clears, and nowhere else.
"""

from __future__ import annotations

import gc
import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class DistributedInitError(RuntimeError):
    """Forming the process groups failed or timed out; the message names the rank and the phase."""


@dataclass(frozen=True)
class GroupInfo:
    """One group as seen from this process."""

    rank: int  # this process's rank within the group
    world_size: int
    group: Any  # torch ProcessGroup on the device backend (NCCL on GPU, gloo on CPU)
    cpu_group: Any  # gloo ProcessGroup over the same ranks, for host-side control
    ranks: tuple[int, ...]  # global ranks, in group-rank order


@dataclass(frozen=True)
class ParallelGroups:
    backend: str
    world: GroupInfo
    tp: GroupInfo
    dp: GroupInfo
    tp_rank: int
    dp_rank: int


_groups: Optional[ParallelGroups] = None


def tp_group_ranks(dp_rank: int, tp_size: int) -> list[int]:
    return [dp_rank * tp_size + t for t in range(tp_size)]


def dp_group_ranks(tp_rank: int, tp_size: int, dp_size: int) -> list[int]:
    return [d * tp_size + tp_rank for d in range(dp_size)]


def init_distributed(
    world_size: int,
    rank: int,
    dp_size: int,
    tp_size: int,
    master_addr: str,
    master_port: int,
    backend: str = "auto",
    timeout_s: float = 120.0,
) -> ParallelGroups:
    """Join the world and carve the TP and DP groups. Every rank must call it with the same sizes.

    backend: "nccl", "gloo" or "auto" (NCCL when CUDA is available). `timeout_s` bounds the
    rendezvous and every later collective's set-up (torch.distributed's own timeout).
    """
    global _groups
    if _groups is not None:
        raise DistributedInitError(
            f"rank {rank}: init_distributed: already initialized; call destroy_distributed() first"
        )
    if dp_size * tp_size != world_size:
        raise DistributedInitError(
            f"rank {rank}: init_distributed: world_size={world_size} != data_parallel_size={dp_size} x "
            f"tensor_parallel_size={tp_size}"
        )
    if not 0 <= rank < world_size:
        raise DistributedInitError(
            f"rank {rank}: init_distributed: rank outside 0..{world_size - 1}"
        )
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise DistributedInitError(
            f"rank {rank}: init_distributed: backend must be nccl, gloo or auto, got {backend!r}"
        )
    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{master_port}",
            world_size=world_size,
            rank=rank,
            timeout=timeout,
        )
    except Exception as e:  # a store timeout or a refused connection: say who and where
        raise DistributedInitError(
            f"rank {rank}: init_distributed: rendezvous at {master_addr}:{master_port} failed "
            f"(world_size={world_size}, timeout {timeout_s:.0f} s): {e}"
        ) from e
    try:
        _groups = _carve_groups(backend, world_size, rank, dp_size, tp_size, timeout)
    except Exception as e:
        raise DistributedInitError(
            f"rank {rank}: init_distributed: creating TP/DP groups failed: {e}"
        ) from e
    logger.debug(
        "rank %d: joined %s world of %d (dp=%d, tp=%d)", rank, backend, world_size, dp_size, tp_size
    )
    return _groups


def _carve_groups(
    backend: str, world_size: int, rank: int, dp_size: int, tp_size: int, timeout: timedelta
) -> ParallelGroups:
    world_ranks = list(range(world_size))
    cpu_world = (
        dist.group.WORLD
        if backend == "gloo"
        else dist.new_group(world_ranks, backend="gloo", timeout=timeout)
    )
    world = GroupInfo(rank, world_size, dist.group.WORLD, cpu_world, tuple(world_ranks))
    tp_rank, dp_rank = rank % tp_size, rank // tp_size

    def make(all_ranks: list[list[int]]) -> GroupInfo:
        # Every rank creates every group, in the same order (torch.distributed requires it).
        mine = None
        for ranks in all_ranks:
            dev = dist.new_group(ranks, backend=backend, timeout=timeout)
            cpu = (
                dev if backend == "gloo" else dist.new_group(ranks, backend="gloo", timeout=timeout)
            )
            if rank in ranks:
                mine = GroupInfo(ranks.index(rank), len(ranks), dev, cpu, tuple(ranks))
        assert mine is not None
        return mine

    tp = make([tp_group_ranks(d, tp_size) for d in range(dp_size)])
    dp = make([dp_group_ranks(t, tp_size, dp_size) for t in range(tp_size)])
    return ParallelGroups(backend, world, tp, dp, tp_rank, dp_rank)


def _process_groups(groups: Optional[ParallelGroups]) -> list[Any]:
    """This rank's distinct process-group objects (world first), without non-member placeholders."""
    if groups is None:
        return []
    found: list[Any] = []
    for info in (groups.tp, groups.dp, groups.world):
        for pg in (info.group, info.cpu_group):
            if isinstance(pg, dist.ProcessGroup) and not any(pg is f for f in found):
                found.append(pg)
    return found


def _require() -> ParallelGroups:
    if _groups is None:
        raise RuntimeError("process groups are not initialized: call init_distributed() first")
    return _groups


def is_distributed_initialized() -> bool:
    return _groups is not None


def get_parallel_groups() -> ParallelGroups:
    return _require()


def get_world_group() -> GroupInfo:
    return _require().world


def get_tp_group() -> GroupInfo:
    return _require().tp


def get_dp_group() -> GroupInfo:
    return _require().dp


def destroy_distributed(timeout_s: float = 10.0) -> bool:
    """Leave the world without ever waiting unbounded; True if torch's teardown returned in time.

    `dist.destroy_process_group()` was seen not returning (> 90 s) after CUDA-graph captures of
    NCCL collectives (pytorch issue 115388), so it runs in a daemon thread; if it has not returned
    within `timeout_s` we log it and move on (the process is about to exit anyway).
    Drop your own references to the groups (GroupInfo, a model's TP group) first: a group object
    that lives until interpreter exit is destroyed there, which gloo does not always survive.
    """
    global _groups
    groups, _groups = _groups, None
    if not (dist.is_available() and dist.is_initialized()):
        return True
    errors: list[BaseException] = []

    def teardown() -> None:
        try:
            # Stop each group's threads now: a group object still referenced (a model layer's TP
            # group, a caller's GroupInfo) is otherwise destroyed during interpreter exit, where a
            # gloo group aborted the process ("terminate called without an active exception") in
            # about one exit in five.
            for pg in _process_groups(groups):
                pg.shutdown()
            dist.destroy_process_group()
        except Exception as e:  # reported below, from the caller's thread
            errors.append(e)

    t = threading.Thread(target=teardown, name="atomrt-destroy-process-group", daemon=True)
    t.start()
    t.join(timeout_s)
    gc.collect()  # groups nobody references any more are destroyed now, not during interpreter exit
    if t.is_alive():
        logger.warning(
            "destroy_process_group() did not return within %.1f s; leaving it behind", timeout_s
        )
        return False
    if errors:
        logger.warning("destroy_process_group() failed: %s", errors[0])
        return False
    return True

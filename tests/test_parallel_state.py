"""Process groups and collectives on a real gloo world: 2 ranks (tp=2) and 4 ranks (dp=2, tp=2)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from atomrt.distributed.net_utils import get_free_port
from atomrt.distributed.parallel_state import (
    DistributedInitError,
    destroy_distributed,
    dp_group_ranks,
    init_distributed,
    tp_group_ranks,
)

_RANK = r"""
import sys, torch
import atomrt.distributed.parallel_state as ps
from atomrt.distributed.communication_op import TPInfo, tp_all_gather, tp_all_reduce, tp_broadcast
torch.set_num_threads(1)
rank, world, dp, tp, port = map(int, sys.argv[1:6])
g = ps.init_distributed(world, rank, dp, tp, "127.0.0.1", port, backend="gloo", timeout_s=60)
tp_rank, dp_rank = rank % tp, rank // tp
assert (g.tp_rank, g.dp_rank) == (tp_rank, dp_rank)
w, t, d = ps.get_world_group(), ps.get_tp_group(), ps.get_dp_group()
assert (w.rank, w.world_size) == (rank, world)
assert t.ranks == tuple(dp_rank * tp + i for i in range(tp)) and t.rank == tp_rank and t.world_size == tp
assert d.ranks == tuple(i * tp + tp_rank for i in range(dp)) and d.rank == dp_rank and d.world_size == dp

tp_info = TPInfo(t.rank, t.world_size, t.group)
x = torch.full((3, 2), float(rank + 1))
assert tp_all_reduce(x, tp_info) is x
assert torch.equal(x, torch.full((3, 2), float(sum(r + 1 for r in t.ranks))))

y = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * rank
for dim in (-1, 0, 1):
    got = tp_all_gather(y, tp_info, dim=dim)
    want = torch.cat([torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * r for r in t.ranks], dim=dim)
    assert torch.equal(got, want), (dim, got, want)

z = torch.full((4,), float(rank))
assert tp_broadcast(z, tp_info) is z and torch.equal(z, torch.full((4,), float(t.ranks[0])))
del g, w, t, d  # destroy_distributed's contract: callers drop their group references first
assert ps.destroy_distributed(timeout_s=20)
assert not ps.is_distributed_initialized()
print("rank", rank, "ok")
"""


def _run_world(dp: int, tp: int) -> None:
    world, port = dp * tp, get_free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), str(world), str(dp), str(tp), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out}"


def test_gloo_world_of_2_tp2():
    _run_world(dp=1, tp=2)


def test_gloo_world_of_4_dp2_tp2():
    _run_world(dp=2, tp=2)


def test_group_layout():
    assert tp_group_ranks(1, 4) == [4, 5, 6, 7]
    assert dp_group_ranks(1, tp_size=2, dp_size=3) == [1, 3, 5]


def test_bad_sizes_name_the_knobs():
    with pytest.raises(DistributedInitError, match="data_parallel_size=2 x tensor_parallel_size=2"):
        init_distributed(3, 0, 2, 2, "127.0.0.1", 1)


def test_single_rank_world_and_bounded_destroy():
    init_distributed(1, 0, 1, 1, "127.0.0.1", get_free_port(), backend="gloo", timeout_s=30)
    try:
        from atomrt.distributed.communication_op import (
            TPInfo,
            tp_all_gather,
            tp_all_reduce,
            tp_broadcast,
        )

        x, tp = torch.ones(2), TPInfo()
        assert tp_all_reduce(x, tp) is x and tp_all_gather(x, tp) is x and tp_broadcast(x, tp) is x
        with pytest.raises(DistributedInitError, match="already initialized"):
            init_distributed(1, 0, 1, 1, "127.0.0.1", 1)
    finally:
        assert destroy_distributed(timeout_s=20)


def test_drain_is_a_no_op_without_nccl():
    from atomrt.distributed.nccl_watchdog import drain_nccl_works, graph_capture_kwargs

    drain_nccl_works(timeout_s=1)  # no process group
    init_distributed(1, 0, 1, 1, "127.0.0.1", get_free_port(), backend="gloo", timeout_s=30)
    try:
        drain_nccl_works(timeout_s=1)  # gloo only
    finally:
        destroy_distributed(timeout_s=20)
    assert graph_capture_kwargs() == {"capture_error_mode": "thread_local"}

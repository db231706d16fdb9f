"""A CUDA-graph capture right after an eager NCCL collective succeeds with the drain (2 GPUs, 50x).

Each of 2 processes (one per GPU, NCCL world of 2, tp=2): eager all_reduce, `drain_nccl_works()`,
capture a graph holding an all_reduce, replay it, check both results. Runs in well under a minute.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.multigpu

LOOPS = 50

_RANK = r"""
import os, sys, time
import torch
import torch.distributed as dist
import atomrt.distributed.parallel_state as ps
from atomrt.distributed.communication_op import TPInfo, tp_all_reduce
from atomrt.distributed.nccl_watchdog import drain_nccl_works, graph_capture_kwargs

rank, port, loops = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
ps.init_distributed(2, rank, 1, 2, "127.0.0.1", port, backend="nccl", timeout_s=60)
tp = TPInfo(rank, 2, ps.get_tp_group().group)
pool = torch.cuda.graph_pool_handle()
n = 4096
t0 = time.monotonic()
for i in range(loops):
    eager = torch.full((n,), float(rank + 1 + i), device=dev)
    tp_all_reduce(eager, tp)               # eager collective, still pending ...
    drain_nccl_works(timeout_s=30)                         # ... until completed and retired
    static_in = torch.zeros(n, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, **graph_capture_kwargs()):
        out = static_in * 2
        tp_all_reduce(out, tp)
    static_in.fill_(float(rank + 1 + i))
    graph.replay()
    torch.cuda.synchronize()
    want = float(2 * i + 3)                                # (1 + i) + (2 + i)
    assert torch.all(eager == want).item(), (i, eager[:4].tolist(), want)
    assert torch.all(out == 2 * want).item(), (i, out[:4].tolist(), 2 * want)
    del graph, out
print(f"rank {rank}: {loops} drained captures ok in {time.monotonic() - t0:.1f} s", flush=True)
ps.destroy_distributed(timeout_s=10)
os._exit(0)  # a teardown left behind (seen after captures) must not hold the process
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_capture_after_eager_collective_with_drain():
    from atomrt.distributed.net_utils import get_free_port

    port = get_free_port()
    env = dict(os.environ, TORCH_NCCL_BLOCKING_WAIT="0", PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), str(port), str(LOOPS)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and "drained captures ok" in out, f"rank {r} failed:\n{out}"

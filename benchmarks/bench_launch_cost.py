"""What one host launch costs on this machine: graph replays and kernel launches.

    python benchmarks/bench_launch_cost.py
Prints host us per call (median of 5 loops of 3000 calls) and GPU us per call over the same loop,
for: a torch `CUDAGraph.replay` of graphs of 1, 7 and 20 tiny kernels, the same graphs launched
with `cuGraphLaunch` through ctypes (what graphs/composite.py does), a torch op (`x.add_(1)`) and a
Triton kernel through its Python dispatch. Where the GPU figure equals the host figure the loop was
host-bound and the host figure is the launch's cost; where it is larger, the GPU was the bound and
the launch costs at most the host figure. What a step's launches add up to: docs/perf.md.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import triton
import triton.language as tl

from atomrt.graphs.composite import _libcuda


def per_call(name: str, fn, calls: int = 3000, loops: int = 5) -> None:
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(loops):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - t0) / calls * 1e6
        end.record()
        torch.cuda.synchronize()
        runs.append((host, start.elapsed_time(end) / calls * 1e3))
    host = statistics.median(r[0] for r in runs)
    gpu = statistics.median(r[1] for r in runs)
    print(f"{name:44s} host {host:7.2f} us/call   GPU {gpu:7.2f} us/call", flush=True)


@triton.jit
def _add_one(p, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(p + offs, tl.load(p + offs, mask=offs < n) + 1, mask=offs < n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="calls per timed loop")
    parser.add_argument("--loops", type=int, default=5, help="timed loops (the median is printed)")
    args = parser.parse_args()
    timed = functools.partial(per_call, calls=args.calls, loops=args.loops)
    if not torch.cuda.is_available():
        raise SystemExit("bench_launch_cost needs a CUDA GPU")
    x = torch.zeros(16, device="cuda")
    side = torch.cuda.Stream()
    stream = torch.cuda.current_stream().cuda_stream
    launch = _libcuda().cuGraphLaunch
    for kernels in (1, 7, 20):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            for _ in range(3):
                for _ in range(kernels):
                    x.add_(1)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(kernels):
                x.add_(1)
        timed(f"torch CUDAGraph.replay, {kernels} kernels", graph.replay)
        exec_handle = graph.raw_cuda_graph_exec()
        timed(f"cuGraphLaunch (ctypes), {kernels} kernels", lambda: launch(exec_handle, stream))
    timed("torch x.add_(1)", lambda: x.add_(1))
    timed("Triton dispatch, 2 arguments", lambda: _add_one[(1,)](x, 16, BLOCK=16))


if __name__ == "__main__":
    main()

"""GPU time of one call of a kernel benchmark's function, from a CUDA graph of many calls.

The kernel benchmarks (benchmarks/bench_*.py) time launches too short for the host to keep up with:
recorded once in a graph and replayed, their GPU time is what a decode step's graph would see."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_call_us(fn: Callable[[int], object], calls: int, replays: int = 15) -> float:
    """Median µs of one call: `fn(i)` for i in range(calls), recorded in one CUDA graph (callers
    cycle weight copies by `i`, so that the weights stream from HBM rather than L2), replayed
    `replays` times. The first calls run on a side stream first (Triton's compiles, cuBLAS's
    workspace), as torch.cuda.graph requires."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(calls, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]

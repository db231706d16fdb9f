"""Greedy argmax: workers/kernels/argmax.argmax_rows against torch.argmax, bf16 logits.

    python benchmarks/bench_argmax.py
Prints, per (rows, vocab) of the latency targets' shapes (and the splits per row planned there): GPU
us per call, for torch, this kernel and this kernel with one program per row (200 calls captured in a
CUDA graph, so launch gaps do not count) and host us per eager call (the sampler launches it eagerly).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from atomrt.runtime.bench.records import (
    Figure,
    Quantity,
    add_record_flag,
    figure,
    resolve_record_flag,
    save,
)
from atomrt.workers.kernels.argmax import argmax_rows, plan_splits
from atomrt.workers.kernels.device_info import sm_count


def gpu_us(fn, logits: torch.Tensor, calls: int = 200) -> float:
    fn(logits)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(logits)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def host_us(fn, logits: torch.Tensor, calls: int = 2000) -> float:
    fn(logits)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn(logits)
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_record_flag(parser)
    args = parser.parse_args()
    resolve_record_flag(args, parser)
    measured = []
    torch_argmax = lambda x: x.argmax(dim=-1)  # noqa: E731
    print("us per call:")
    print(
        f"{'rows':>5} {'vocab':>7} {'splits':>6}  {'torch GPU':>9} {'ours GPU':>8} {'1 split GPU':>11}  "
        f"{'torch host':>10} {'ours host':>9}"
    )
    one_split = lambda x: argmax_rows(x, num_splits=1)  # noqa: E731
    for rows, vocab in [(1, 49152), (8, 49152), (1, 128256), (32, 128256), (128, 128256)]:
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(argmax_rows(logits), torch_argmax(logits))
        splits = plan_splits(rows, vocab, sm_count(logits.device))
        gpu = [gpu_us(fn, logits) for fn in (torch_argmax, argmax_rows, one_split)]
        host = [host_us(fn, logits) for fn in (torch_argmax, argmax_rows)]
        print(
            f"{rows:5d} {vocab:7d} {splits:6d}  {gpu[0]:9.1f} {gpu[1]:8.1f} {gpu[2]:11.1f}  "
            f"{host[0]:10.1f} {host[1]:9.1f}"
        )
        measured.append((rows, vocab, splits, gpu, host))
    if args.record is not None:
        program = "python benchmarks/bench_argmax.py"
        save(
            args.record,
            "bench_argmax",
            sys.argv[1:],
            figures(measured),
            on_gpu=True,
            program=program,
        )


def figures(measured: list[tuple]) -> list[Figure]:
    """argmax: the kernel's GPU µs per call against torch.argmax's, per (rows, vocab)."""
    return [
        figure(
            "argmax",
            f"{n} × {vocab}, {splits} splits",
            round(gpu[1], 1),
            "µs",
            anchor=round(gpu[0], 1),
            anchor_name="torch.argmax",
            extra={
                "one program per row": Quantity(round(gpu[2], 1), "µs"),
                "host": Quantity(round(host[1], 1), "µs"),
                "torch's host": Quantity(round(host[0], 1), "µs"),
            },
        )
        for n, vocab, splits, gpu, host in measured
    ]


if __name__ == "__main__":
    main()

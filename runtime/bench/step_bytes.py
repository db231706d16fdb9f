"""What a decode step reads, for the floor of `atomrt bench latency` (runtime/bench/latency.py):
the bytes of the weights and KV cache a step of a model reads, and the copy bandwidth they are
divided by, measured in the same run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch


def measure_copy_bandwidth(device: torch.device) -> float:
    """GB/s of a large tensor copy, counting bytes read plus bytes written (CUDA events on GPU)."""
    on_cuda = device.type == "cuda"
    nbytes, iters = (1 << 30, 20) if on_cuda else (64 << 20, 5)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if on_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    return 2 * nbytes * iters / seconds / 1e9


@dataclass(frozen=True)
class StepBytes:
    """What a decode step of a model reads, in bytes: `weights` once, then per sequence one input
    embedding row (`row`, when the table is not also the LM head) and `kv_per_token` per token of
    its context."""

    weights: int
    row: int
    kv_per_token: int

    def of(self, bs: int, ctx: int) -> int:
        return self.weights + bs * self.row + bs * ctx * self.kv_per_token


def inproc_step_bytes(llm: Any) -> Optional[StepBytes]:
    """StepBytes read from the in-process worker's model; None through other executors."""
    from atomrt.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding

    worker = getattr(llm.engine.executor, "worker", None)
    if worker is None:
        return None
    runner = worker.runner
    modules = list(runner.model.modules())
    heads = {m.weight.data_ptr() for m in modules if isinstance(m, ParallelLMHead)}
    lookups = [
        m.weight
        for m in modules
        if type(m) is VocabParallelEmbedding and m.weight.data_ptr() not in heads
    ]  # a tied table is read whole by the LM head
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    weights -= sum(w.numel() * w.element_size() for w in lookups)
    row = sum(w.shape[1] * w.element_size() for w in lookups)
    return StepBytes(weights, row, runner.kv_bytes_per_block() // runner.shape.block_size)

"""What a decode step reads, for the floor of `atomrt bench latency` (runtime/bench/latency.py):
the bytes of the weights and KV cache a step of a model reads, as the workers count them
(`StepBytes`, workers/step_bytes.py: of a MoE model's routed experts, those its batch touches,
counted in the run through the executor's probe; FP8 and MXFP4 weights and their scales, and an FP8
cache, at the bytes they are stored in) -- and the copy bandwidth they are divided by, measured in
the same run."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from atomrt.workers.step_bytes import StepBytes

__all__ = ["StepBytes", "count_touched_experts", "measure_copy_bandwidth", "worker_step_bytes"]


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


def worker_step_bytes(llm: Any) -> Optional[StepBytes]:
    """StepBytes of the engine's model, as its workers counted them at start-up (rank 0's shard,
    workers/step_bytes.py); the same through every executor."""
    return llm.engine.info.step_bytes


def count_touched_experts(llm: Any, mine: set[str], steps: int) -> Optional[tuple[float, ...]]:
    """Per MoE layer, the mean number of distinct routed experts the next `steps` decode steps of
    the batch `mine` touch, run eagerly under the executor's `experts_touched` probe (the routing
    is read in Python: workers/probes.py); None for a model without MoE layers."""
    engine = llm.engine
    with engine.executor.probe("experts_touched") as counts:
        for i in range(steps):
            if not any(o.request_id in mine for o in engine.step()):
                raise RuntimeError(f"expert count: step {i} decoded none of the batch")
    return counts.mean_touched() or None

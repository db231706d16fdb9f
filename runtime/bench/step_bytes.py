"""What a decode step reads, for the floor of `atomrt bench latency` (runtime/bench/latency.py):
the bytes of the weights and KV cache a step of a model reads -- of a MoE model's routed experts,
those its batch touches, counted in the run; FP8 weights and their scales, and an FP8 cache, at the
bytes they are stored in -- and the copy bandwidth they are divided by, measured
in the same run."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from atomrt.workers.layers.expert_tally import RoutedLayer, expert_parameters, routed_layer_bytes
from atomrt.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from atomrt.workers.probes import routed_layers
from atomrt.workers.runner.kv_cache import kv_sizes_by_kind


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
    """What a decode step of a model reads, in bytes: `weights` once (every weight but the routed
    experts and an untied input embedding: attention, norms, dense MLPs, shared experts, routers,
    the LM head), per MoE layer the routed experts the step's rows touch (`routed`: how many a
    layer has and the bytes of one), then per sequence one input embedding row (`row`, when the
    table is not also the LM head) and `kv_per_token` per token of its context (every layer's
    cache row: `kv_by_kind` splits it by layer kind, an MLA layer's row being its latent)."""

    weights: int
    row: int
    kv_per_token: int
    routed: tuple[RoutedLayer, ...] = ()
    kv_by_kind: dict[str, int] = field(default_factory=dict)

    def of(self, bs: int, ctx: int, touched: Optional[Sequence[float]] = None) -> int:
        """Bytes of a step of `bs` sequences of `ctx` tokens whose MoE layers touch `touched`
        experts each (on average); None: every expert."""
        return (
            self.weights + bs * self.row + bs * ctx * self.kv_per_token + self.routed_bytes(touched)
        )

    def routed_bytes(self, touched: Optional[Sequence[float]] = None) -> int:
        if touched is None:
            touched = [layer.num_experts for layer in self.routed]
        if len(touched) != len(self.routed):
            raise ValueError(f"{len(touched)} touched counts for {len(self.routed)} MoE layers")
        return round(sum(n * layer.expert_bytes for n, layer in zip(touched, self.routed)))


def inproc_runner(llm: Any) -> Optional[Any]:
    """The in-process worker's model runner; None through other executors."""
    worker = getattr(llm.engine.executor, "worker", None)
    return None if worker is None else worker.runner


def inproc_step_bytes(llm: Any) -> Optional[StepBytes]:
    """StepBytes read from the in-process worker's model; None through other executors."""
    runner = inproc_runner(llm)
    if runner is None:
        return None
    modules = list(runner.model.modules())
    heads = {m.weight.data_ptr() for m in modules if isinstance(m, ParallelLMHead)}
    lookups = [
        m.weight
        for m in modules
        if type(m) is VocabParallelEmbedding and m.weight.data_ptr() not in heads
    ]  # a tied table is read whole by the LM head
    experts = [p for m in routed_layers(runner.model) for p in expert_parameters(m)]
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    weights -= sum(w.numel() * w.element_size() for w in (*lookups, *experts))
    row = sum(w.shape[1] * w.element_size() for w in lookups)
    cache_dtype = getattr(runner, "kv_cache_dtype", runner.dtype)  # an FP8 cache: its bytes
    kinds = kv_sizes_by_kind(runner.kv_layer_specs(), cache_dtype)
    return StepBytes(
        weights,
        row,
        runner.kv_bytes_per_block() // runner.shape.block_size,
        tuple(routed_layer_bytes(m) for m in routed_layers(runner.model)),
        {k.kind: k.bytes_per_token for k in kinds},
    )


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

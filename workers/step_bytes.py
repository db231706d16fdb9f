"""`StepBytes`: what a decode step of this worker's model reads, counted once at start-up and sent
to the driver in `WorkerInfo.step_bytes`, so that `atomrt bench latency` (runtime/bench/latency.py)
has the floor's bytes through every executor. A rank counts its own shard: with tensor or data
parallelism the driver gets rank 0's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from atomrt.workers.layers.expert_tally import RoutedLayer, expert_parameters, routed_layer_bytes
from atomrt.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from atomrt.workers.probes import routed_layers
from atomrt.workers.runner.kv_cache import kv_sizes_by_kind


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


def runner_step_bytes(runner: Any) -> StepBytes:
    """StepBytes of a model runner's model and KV cache layout, as this rank stores them: its
    parameters, and its routed experts' tensors whether parameters or buffers (MXFP4 experts are
    packed buffers)."""
    model = runner.model
    modules = list(model.modules())
    heads = {m.weight.data_ptr() for m in modules if isinstance(m, ParallelLMHead)}
    lookups = [
        m.weight
        for m in modules
        if type(m) is VocabParallelEmbedding and m.weight.data_ptr() not in heads
    ]  # a tied table is read whole by the LM head
    moe = routed_layers(model)
    params = {p.data_ptr() for p in model.parameters()}
    experts = [t for m in moe for t in expert_parameters(m) if t.data_ptr() in params]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= sum(w.numel() * w.element_size() for w in (*lookups, *experts))
    row = sum(w.shape[1] * w.element_size() for w in lookups)
    cache_dtype = getattr(runner, "kv_cache_dtype", runner.dtype)  # an FP8 cache: its bytes
    kinds = kv_sizes_by_kind(runner.kv_layer_specs(), cache_dtype)
    return StepBytes(
        weights,
        row,
        runner.kv_bytes_per_block() // runner.shape.block_size,
        tuple(routed_layer_bytes(m) for m in moe),
        {k.kind: k.bytes_per_token for k in kinds},
    )

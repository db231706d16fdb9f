"""`ExpertTally`: the routed experts each MoE layer's rows select, step by step.

A decode step of a mixture-of-experts model reads the weights of the experts its rows were routed
to, not all of them: at batch size 1 a layer of 64 experts with top-6 routing reads 6. What `atomrt
bench latency` divides by the copy bandwidth for its floor (workers/step_bytes.py) counts
them from a tally of real steps, asked for with the executor's `experts_touched` probe
(workers/probes.py).

The expert ops (`routed_experts`, workers/layers/moe.py, its FP8 twin, DeepSeek-V4's MXFP4 op
and its float experts' op, workers/layers/v4_moe.py) report each call's routing with
`record`, to the tally a worker opened with `counting` around a probed step. They do
so in Python, which a CUDA-graph replay does not run: probed steps run eagerly, and a step without
a tally pays one global read per MoE layer. A layer is known by its expert weights, so a drafter's
or another model's MoE layers are not counted.

A layer whose experts run inside a traced graph without an opaque op reports nothing: traced,
such a layer would run every expert on every row. So a step's counts (`step_counts`) take a layer
that reported no call as one that read every expert.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, Optional

import numpy as np
import torch


class RoutedLayer(NamedTuple):
    """One MoE layer's routed experts on this rank: how many, and the bytes of one."""

    num_experts: int
    expert_bytes: int  # its w13 rows and w2 columns on this rank


# The names a MoE layer holds its routed experts under, [E, ...] each, the tensor its expert op
# reports (`record`) first: FusedMoE's weights (and FP8 scales), DeepSeek-V4's packed MXFP4 experts
# with their e8m0 exponents, V4's float experts (workers/layers/v4_moe.py).
_EXPERT_TENSORS = (
    ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"),
    ("w13_packed", "w2_packed", "w13_scale", "w2_scale"),
    ("w13", "w2"),
)


def expert_parameters(layer: Any) -> list[torch.Tensor]:
    """A MoE layer's routed experts' tensors as stored, [E, ...] each: the weights and their
    scales (FP8 or MXFP4), parameters or buffers."""
    for names in _EXPERT_TENSORS:
        tensors = [getattr(layer, n, None) for n in names]
        if isinstance(tensors[0], torch.Tensor) and not tensors[0].is_meta:
            return [t for t in tensors if isinstance(t, torch.Tensor)]
    raise TypeError(f"{type(layer).__name__}: no routed expert tensors")


def routed_layer_bytes(layer: Any) -> RoutedLayer:
    """How many experts a layer has and the bytes of one (weights and scales, as stored)."""
    tensors = expert_parameters(layer)
    per_expert = sum(t[0].numel() * t.element_size() for t in tensors)
    return RoutedLayer(tensors[0].shape[0], per_expert)


class ExpertTally:
    """Per MoE layer of `layers` (a model's routed layers in order, workers/probes.py), the
    number of distinct experts the rows of each counted call selected."""

    def __init__(self, layers: Sequence[Any]) -> None:
        self._layer_of = {expert_parameters(m)[0].data_ptr(): i for i, m in enumerate(layers)}
        self.layers = tuple(routed_layer_bytes(m) for m in layers)
        self.distinct: list[list[int]] = [[] for _ in layers]  # per layer, per call

    def record(self, w13: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """One call of a layer's experts over `topk_ids` [rows, top_k] (reads them back: eager
        steps only)."""
        layer = self._layer_of.get(w13.data_ptr())
        if layer is not None:
            self.distinct[layer].append(int(torch.unique(topk_ids).numel()))

    @property
    def num_steps(self) -> int:
        """Calls of the layer counted least (a step calls every layer once)."""
        return min((len(d) for d in self.distinct), default=0)

    def counts(self) -> np.ndarray:
        """int32 [calls, layers]: the distinct experts of each counted call, per layer (the
        calls every layer made)."""
        n = self.num_steps
        return np.asarray([d[:n] for d in self.distinct], np.int32).reshape(len(self.layers), n).T

    def step_counts(self) -> np.ndarray:
        """int32 [calls, layers]: `counts` of one step that ran every layer, a layer that reported
        no call counted as reading every expert on each (its experts were traced whole). The calls
        are those of the layers that reported (one when none did)."""
        reported = [len(d) for d in self.distinct if d]
        n = min(reported, default=1)
        columns = [
            d[:n] if d else [layer.num_experts] * n for d, layer in zip(self.distinct, self.layers)
        ]
        return np.asarray(columns, np.int32).reshape(len(self.layers), n).T

    def mean_touched(self) -> tuple[float, ...]:
        """Per layer, the mean number of distinct experts a counted call touched."""
        if not self.num_steps:
            raise ValueError("ExpertTally: no step was counted (only eager steps report)")
        return tuple(sum(d) / len(d) for d in self.distinct)


_counting: Optional[ExpertTally] = None  # the tally the expert ops report to, if any


@contextmanager
def counting(tally: ExpertTally) -> Iterator[ExpertTally]:
    """The expert ops report every call inside to `tally`."""
    global _counting
    previous, _counting = _counting, tally
    try:
        yield tally
    finally:
        _counting = previous


def record(w13: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Called by the expert ops on every call: report to the open tally (a no-op without one)."""
    if _counting is not None:
        _counting.record(w13, topk_ids)

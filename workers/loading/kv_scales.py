"""A checkpoint's FP8 KV cache scales: one float per attention layer for its keys and one for its
values, the factors that dequantize an e4m3 cache (it holds k / k_scale).

The names FP8 checkpoints give them, under `model.layers.<i>.self_attn.`:
- `k_scale` / `v_scale` (also under `attn.`, as vLLM saves them);
- `k_proj.k_scale` / `v_proj.v_scale` (ModelOpt);
- `k_proj.output_scale` / `v_proj.output_scale` (compressed-tensors' `kv_cache_scheme`);
- `kv_scale`: one scale for both (an older format).

`CheckpointKVScales.take` lifts them out of the weights stream before the model sees them, and
`apply` sets them on the attention layers (`PagedAttentionLayer.k_scale` / `v_scale`; a latent
cache uses `k_scale`). A cache in the model's dtype does not use them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from atomrt.workers.layers.attention import collect_attention_layers
from atomrt.workers.layers.mla import MLAAttention

logger = logging.getLogger(__name__)

_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v)_proj\.)?(k_scale|v_scale|kv_scale|output_scale)$"
)


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer index, "k" | "v" | "kv") for a checkpoint KV scale's name, else None."""
    m = _NAME.search(name)
    if m is None:
        return None
    layer, proj, leaf = int(m.group(1)), m.group(2), m.group(3)
    if leaf == "output_scale":
        return (layer, proj) if proj else None
    which = leaf.split("_")[0]  # k | v | kv
    if proj is not None and proj != which:
        return None  # e.g. k_proj.v_scale: not a KV cache scale
    return layer, which


class CheckpointKVScales:
    """The KV cache scales found in a checkpoint's tensors: layer -> {"k": float, "v": float}."""

    def __init__(self) -> None:
        self.scales: dict[int, dict[str, float]] = {}

    def take(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """`weights` without the KV cache scales, which are recorded here."""
        for name, weight in weights:
            target = kv_scale_target(name)
            if target is None:
                yield name, weight
                continue
            layer, which = target
            value = weight if isinstance(weight, torch.Tensor) else weight[...]
            if value.numel() != 1:
                raise ValueError(
                    f"{name}: a KV cache scale of shape {tuple(value.shape)}; atomrt's FP8 KV "
                    "cache takes one scale per tensor (per layer)"
                )
            scale = float(value.float().reshape(()))
            if not scale > 0 or scale == float("inf"):
                raise ValueError(f"{name}: a KV cache scale must be positive and finite: {scale}")
            for w in ("k", "v") if which == "kv" else (which,):
                self.scales.setdefault(layer, {})[w] = scale

    def apply(self, model: nn.Module, where: str) -> None:
        """Set the scales on the model's attention layers; a layer the checkpoint scales must have
        both (a `kv_scale` counts for both)."""
        if not self.scales:
            return
        layers = collect_attention_layers(model)
        for idx, found in sorted(self.scales.items()):
            layer = layers.get(idx)
            if layer is None:
                raise ValueError(
                    f"{where}: KV cache scales for layer {idx}, which has no attention"
                )
            latent = isinstance(layer, MLAAttention)  # one cache, scaled by k_scale
            if "k" not in found or ("v" not in found and not latent):
                raise ValueError(
                    f"{where}: layer {idx} has a KV cache scale for "
                    f"{'values' if 'v' in found else 'keys'} only"
                )
            layer.k_scale = found["k"]
            layer.v_scale = found.get("v", found["k"])
            layer.kv_scale_source = "checkpoint"
        logger.info("KV cache scales: %d layers' from the checkpoint", len(self.scales))

"""The FP8 KV cache's per-layer scales, settled at start-up (`settle_kv_scales`).

An e4m3 cache holds k / k_scale and v / v_scale (a latent cache kv / k_scale), one float per layer
and tensor; reads multiply back. The scales come from the checkpoint (workers/loading/kv_scales.py)
or, when it has none, are calibrated here: one forward without a cache over `CALIBRATION_TOKENS`
pseudo-random tokens (a fixed seed) records each layer's largest |k| and |v| as written, and
scale = amax * KV_SCALE_MARGIN / 448, so values a little larger than the calibration's still fit
and the small ones keep e4m3's normal range (a scale of 1.0 leaves a model whose keys and values
are O(0.1) with a handful of subnormal steps). The result is a run-time record (`KVScales`), kept
in `KVCacheSizing`; the configuration is not touched.

Calibrated and checkpoint scales apply to `Attention` and `MLAAttention` layers, on CPU (the torch
reference) and on CUDA, where each layer's scales go to the device once as the Triton kernels read
them (`PagedAttentionLayer.kv_scales`, [k_scale, v_scale] float32): the cache-write kernels divide
by them, the decode / prefill attention and MLA decode kernels multiply them back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atomrt.workers.layers.attention import Attention
from atomrt.workers.layers.mla import MLAAttention
from atomrt.workers.runner.kv_cache import FP8_KV_DTYPES

if TYPE_CHECKING:
    from atomrt.workers.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

FP8_E4M3_MAX = 448.0
KV_SCALE_MARGIN = 2.0  # calibrated amax maps to 448 / 2: twice the calibration's largest value fits
CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0
SCALED_KINDS = (Attention, MLAAttention)  # the layer kinds whose caches take the scales


@dataclass(frozen=True)
class KVScales:
    """The FP8 cache's scales as settled: `source` "checkpoint", "calibrated" or "unit" (1.0: a
    cache in the model's dtype, or no layer that takes them), and (layer, k_scale, v_scale) per
    layer."""

    source: str
    layers: tuple[tuple[int, float, float], ...] = ()


class KVAmax:
    """A layer's largest |k| and |v| over the calibration forward."""

    def __init__(self) -> None:
        self.k = 0.0
        self.v = 0.0

    def observe(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.numel():
            self.k = max(self.k, float(k.detach().abs().amax()))
        if v.numel():
            self.v = max(self.v, float(v.detach().abs().amax()))


def scale_for(amax: float) -> float:
    """The per-tensor scale that maps `amax` * KV_SCALE_MARGIN to e4m3's largest value (1.0 for a
    tensor that was all zeros)."""
    return amax * KV_SCALE_MARGIN / FP8_E4M3_MAX if amax > 0 else 1.0


def settle_kv_scales(runner: ModelRunner, forward: Callable[[int], None]) -> KVScales:
    """The scales the FP8 cache runs with (see the module docstring); `forward(n)` runs n rows of
    `input_ids` through the model without a cache."""
    kv = runner.config.cache_config.kv_cache_dtype
    layers = {i: x for i, x in runner.attn_layers.items() if type(x) in SCALED_KINDS}
    if kv not in FP8_KV_DTYPES or not layers:
        return KVScales("unit")
    from_checkpoint = any(x.kv_scale_source == "checkpoint" for x in layers.values())
    if from_checkpoint:
        logger.info("FP8 KV cache: per-layer scales from the checkpoint (%d layers)", len(layers))
        record = _record(layers)
        _to_device(layers, runner.device)
        return KVScales("checkpoint", record)
    _calibrate(runner, layers, forward)
    record = _record(layers)
    _to_device(layers, runner.device)
    logger.info(
        "FP8 KV cache: no scales in the checkpoint; calibrated per layer over %d tokens "
        "(amax x %.1f / 448): k_scale %.3g..%.3g, v_scale %.3g..%.3g",
        CALIBRATION_TOKENS,
        KV_SCALE_MARGIN,
        min(r[1] for r in record),
        max(r[1] for r in record),
        min(r[2] for r in record),
        max(r[2] for r in record),
    )
    return KVScales("calibrated", record)


def _record(layers: dict) -> tuple[tuple[int, float, float], ...]:
    return tuple((i, float(x.k_scale), float(x.v_scale)) for i, x in sorted(layers.items()))


def _to_device(layers: dict, device: torch.device) -> None:
    """Each layer's scales as the CUDA kernels read them (made before any CUDA-graph capture; a
    capture records their addresses)."""
    for layer in layers.values():
        values = [float(layer.k_scale), float(layer.v_scale)]
        layer.kv_scales = torch.tensor(values, dtype=torch.float32, device=device)


def _calibrate(runner: ModelRunner, layers: dict, forward: Callable[[int], None]) -> None:
    n = min(runner.shape.max_num_tokens, CALIBRATION_TOKENS)
    ids = runner.buffers.forward_vars["input_ids"][:n]
    saved = ids.clone()
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids.copy_(torch.randint(0, runner.arch.vocab_size, (n,), generator=generator))
    for layer in layers.values():
        layer.kv_amax = KVAmax()
    try:
        forward(n)
    finally:
        ids.copy_(saved)
        amax = {i: x.kv_amax for i, x in layers.items()}
        for layer in layers.values():
            layer.kv_amax = None
    for i, layer in layers.items():
        layer.k_scale = scale_for(amax[i].k)
        layer.v_scale = scale_for(amax[i].v)
        layer.kv_scale_source = "calibrated"

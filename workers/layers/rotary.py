"""Rotary position embedding: the half-split layout of Hugging Face Llama checkpoints, or the
interleaved pairs (x0, x1), (x2, x3), ... of the DeepSeek family (`interleaved`).

cos/sin are precomputed in float32 for every position up to `max_position` and looked up by the
step's `positions`, so the forward has no data-dependent control flow. Supported `rope_scaling`
types: none/"default", "linear", "llama3" (Llama 3.1+ frequency-band scaling) and "yarn" (YaRN's
blend of interpolated and extrapolated frequencies, its attention factor folded into cos/sin;
`yarn_softmax_scale` gives the factor DeepSeek's attention folds into the softmax scale too).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn


def _base_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exponents)  # [rotary_dim / 2] float32


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3 scaling: long wavelengths are divided by `factor`, short ones kept, and the band in
    between blends the two linearly in (original_context / wavelength)."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original_len / low
    short_wave = wavelen < original_len / high
    blend = (original_len / wavelen - low) / (high - low)
    medium = (1 - blend) * inv_freq / factor + blend * inv_freq
    return torch.where(long_wave, inv_freq / factor, torch.where(short_wave, inv_freq, medium))


def _yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale for a context stretched `factor` times: 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies with fewer than `beta_slow` rotations over the original context are
    interpolated (divided by `factor`), those with more than `beta_fast` kept, a linear ramp between."""
    factor = float(scaling["factor"])
    original_len = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original_len / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    return 1.0 / (factor * pos_freqs) * ramp + 1.0 / pos_freqs * (1 - ramp)


def _rope_type(rope_scaling: Optional[dict[str, Any]]) -> str:
    scaling = rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_attention_factor(rope_scaling: Optional[dict[str, Any]]) -> float:
    """The factor cos and sin are scaled by: YaRN's `attention_factor` (given, or the ratio of the
    magnitude scales of `mscale` and `mscale_all_dim`); 1 otherwise."""
    if _rope_type(rope_scaling) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling["factor"])
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_get_mscale(factor, float(mscale)) / _yarn_get_mscale(
            factor, float(mscale_all_dim)
        )
    return _yarn_get_mscale(factor)


def yarn_softmax_scale(rope_scaling: Optional[dict[str, Any]]) -> float:
    """What DeepSeek's attention multiplies its softmax scale by under a scaled rope: the square of
    YaRN's magnitude scale at `mscale_all_dim` (1 without one)."""
    if _rope_type(rope_scaling) == "default" or not (rope_scaling or {}).get("mscale_all_dim"):
        return 1.0
    mscale = _yarn_get_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
    return mscale * mscale


def compute_inv_freq(
    rotary_dim: int, theta: float, rope_scaling: Optional[dict[str, Any]]
) -> torch.Tensor:
    rope_type = _rope_type(rope_scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, theta, rope_scaling)
    inv_freq = _base_inv_freq(rotary_dim, theta)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(
        f"rope_scaling: rope type {rope_type!r} is not supported (default, linear, llama3, yarn)"
    )


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        rope_scaling: Optional[dict[str, Any]] = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.interleaved = interleaved
        inv_freq = compute_inv_freq(head_dim, theta, rope_scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        factor = rope_attention_factor(rope_scaling)
        self.register_buffer("cos_cache", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * factor, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim] -> rotated.

        Interleaved pairs come out de-interleaved (every pair's first element, then every pair's
        second): q and k alike, so their dot products are those of the interleaved layout."""
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)  # [num_tokens, 1, head_dim / 2]
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin, self.interleaved), _rotate(k, cos, sin, self.interleaved)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

"""Rotary position embedding (the half-split layout of Hugging Face Llama checkpoints).

cos/sin are precomputed in float32 for every position up to `max_position` and looked up by the
step's `positions`, so the forward has no data-dependent control flow. Supported `rope_scaling`
types: none/"default", "linear" and "llama3" (Llama 3.1+ frequency-band scaling).
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


def compute_inv_freq(
    rotary_dim: int, theta: float, rope_scaling: Optional[dict[str, Any]]
) -> torch.Tensor:
    inv_freq = _base_inv_freq(rotary_dim, theta)
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(
        f"rope_scaling: rope type {rope_type!r} is not supported (default, linear, llama3)"
    )


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        rope_scaling: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, theta, rope_scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim] -> rotated."""
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)  # [num_tokens, 1, head_dim / 2]
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

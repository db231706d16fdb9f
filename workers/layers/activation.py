"""The gated MLP activation: silu(gate) * up over the merged gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * d] (gate then up) -> [num_tokens, d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]

"""RMSNorm, computed in float32 and scaled in the input dtype (the Llama convention), and the
residual add that precedes each norm.

A decoder layer's "h = residual + update; y = proj(norm(h))" is one call, `norm.add_project(residual,
update, proj)`: the norm hands the add and itself to the projection that reads it
(`forward_add_norm`, workers/layers/linear.py), which for decode batches runs the add, the norm
and the GEMM as one kernel. A model file then reads as the formulas do.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize over the last dimension ([..., hidden] or [num_tokens, num_heads, head_dim])."""
        return rms_norm(x, self.weight, self.eps)

    def add_project(
        self, residual: torch.Tensor, update: Optional[torch.Tensor], proj: Optional[Any] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, proj(norm(h))) for h = residual + update (update None: the residual alone, as the
        embeddings enter the first layer; proj None: (h, norm(h))). `proj` is a column-parallel
        projection: with an update, it adds, normalizes and projects in one (`forward_add_norm`)."""
        if update is not None and proj is not None:
            return proj.forward_add_norm(residual, update, self)
        h = residual if update is None else residual_add(residual, update)
        return h, self(h) if proj is None else proj(self(h))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: statistics in float32, the normalized x rounded to x's dtype,
    then scaled by `weight`."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def residual_add(residual: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """`residual + update`, rounded once to the residual's dtype, as eager computes it.

    Under torch.compile the sum is spelled through float32: Inductor folds a plain `x + mm(...)`
    whose result feeds a reduction (the next norm) into cuBLAS `addmm`, which costs a copy kernel
    before each such GEMM and keeps the add out of the norm's kernel. Spelled this way, the add
    fuses into the norm's kernel. The result is bitwise the same either way."""
    if torch.compiler.is_compiling():
        return (residual.float() + update.float()).to(residual.dtype)
    return residual + update

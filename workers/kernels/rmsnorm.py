# The residual add and RMSNorm before a projection, as Triton kernels (CUDA, and the interpreter on
# CPU). `add_rmsnorm` is the standalone kernel, for batches the norm-fused skinny GEMM
# (skinny_gemm.rmsnorm_skinny_linear) does not take. Numerics follow the model's eager code
# (layers/norm.py): h = residual + update rounded once to the dtype, the mean of squares and the
# scaling in fp32, rounded to the dtype, then times the norm weight (one more rounding).
# Importing this module needs no GPU.

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_row(hidden, update, norm_w, K, eps):
    """(normed, h) of loaded rows [ROWS, BLOCK_K] (masked columns hold 0), norm_w [1, BLOCK_K]."""
    h = (hidden.to(tl.float32) + update.to(tl.float32)).to(hidden.dtype)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, axis=1) / K + eps)
    normed = (hf * inv[:, None]).to(hidden.dtype)
    return (norm_w.to(tl.float32) * normed.to(tl.float32)).to(hidden.dtype), h


@triton.jit
def add_rmsnorm_kernel(
    hidden_ptr, update_ptr, norm_w_ptr,  # [M, K], [M, K], [K]
    normed_ptr, h_ptr,  # [M, K] outputs
    K, stride_hm, stride_um, stride_nm, stride_om,
    eps,
    BLOCK_K: tl.constexpr,
):
    """One row per program: h = hidden + update, normed = RMSNorm(h) * norm_w."""
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]: one row
    mask = ks < K
    hidden = tl.load(hidden_ptr + row * stride_hm + ks, mask=mask, other=0.0)
    update = tl.load(update_ptr + row * stride_um + ks, mask=mask, other=0.0)
    norm_w = tl.load(norm_w_ptr + ks, mask=mask, other=0.0)
    normed, h = _add_rmsnorm_row(hidden, update, norm_w, K, eps)
    tl.store(normed_ptr + row * stride_nm + ks, normed, mask=mask)
    tl.store(h_ptr + row * stride_om + ks, h, mask=mask)


def add_rmsnorm(
    hidden: torch.Tensor,  # [M, K]
    update: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(hidden + update) * norm_weight, hidden + update), both [M, K] in hidden's dtype."""
    if hidden.dim() != 2 or update.shape != hidden.shape or norm_weight.shape != hidden.shape[1:]:
        raise ValueError(
            f"add_rmsnorm: want hidden and update [M, K] and norm_weight [K], got {tuple(hidden.shape)}, "
            f"{tuple(update.shape)}, {tuple(norm_weight.shape)}"
        )
    if update.dtype != hidden.dtype or norm_weight.dtype != hidden.dtype:
        raise ValueError(f"add_rmsnorm: dtypes differ: {hidden.dtype}, {update.dtype}, {norm_weight.dtype}")
    m, k = hidden.shape
    hidden, update = _unit_last_stride(hidden), _unit_last_stride(update)
    normed = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    h = torch.empty_like(normed)
    if m == 0:
        return normed, h
    block_k = triton.next_power_of_2(k)
    add_rmsnorm_kernel[(m,)](
        hidden, update, norm_weight.contiguous(), normed, h,
        k, hidden.stride(0), update.stride(0), normed.stride(0), h.stride(0),
        eps,
        BLOCK_K=block_k,
        num_warps=4 if block_k <= 2048 else 8,
    )
    return normed, h


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()

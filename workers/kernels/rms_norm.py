# The residual add and RMSNorm of a decoder layer for batches the skinny GEMM does not take (prefill):
# one launch, one program per row, writing both the new residual stream and the normalized row.
# The decode batches' version of the same arithmetic is the skinny GEMM's NORM prologue
# (skinny_gemm.skinny_add_norm_linear); layers/linear.add_norm_linear picks between the two.
# Importing this module needs no GPU.

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomrt.workers.kernels.launch import launch

MAX_HIDDEN = 1 << 15  # a row is held in registers by one program


@triton.jit
def add_rms_norm_kernel(
    x_ptr,
    u_ptr,  # [M, K]: the residual stream and the update added to it
    w_ptr,  # [K]: the norm's weight
    h_ptr,
    out_ptr,  # [M, K]: h = x + update, out = RMSNorm(h)
    K,
    stride_x,
    stride_u,
    stride_h,
    stride_out,
    eps,
    BLOCK_K: tl.constexpr,
):
    """Row program_id(0): h = x + update rounded to x's dtype; out = weight * (h * rsqrt(mean(h^2) +
    eps)) with the statistics in fp32 and each product rounded to x's dtype, as RMSNorm's eager
    forward computes it."""
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    mask = ks < K
    x = tl.load(x_ptr + row * stride_x + ks, mask=mask, other=0.0)
    update = tl.load(u_ptr + row * stride_u + ks, mask=mask, other=0.0)
    weight = tl.load(w_ptr + ks, mask=mask, other=0.0)
    h = (x.to(tl.float32) + update.to(tl.float32)).to(x.dtype)
    tl.store(h_ptr + row * stride_h + ks, h, mask=mask)
    h32 = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h32 * h32, axis=0) / K + eps)
    normed = (h32 * inv_rms).to(x.dtype)
    tl.store(
        out_ptr + row * stride_out + ks,
        (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype),
        mask=mask,
    )


def add_rms_norm(
    x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + update, RMSNorm(x + update)) for x, update [M, K] and weight [K] of one dtype, one device."""
    if x.dim() != 2 or update.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(
            f"add_rms_norm: want x and update [M, K] and weight [K], got x {tuple(x.shape)}, "
            f"update {tuple(update.shape)}, weight {tuple(weight.shape)}"
        )
    if (
        update.dtype != x.dtype
        or weight.dtype != x.dtype
        or update.device != x.device
        or weight.device != x.device
    ):
        raise ValueError(
            f"add_rms_norm: x {x.dtype} on {x.device}, update {update.dtype} on {update.device} and weight "
            f"{weight.dtype} on {weight.device} must share a dtype and a device"
        )
    m, k = x.shape
    if k > MAX_HIDDEN:
        raise ValueError(f"add_rms_norm: rows of {k} elements exceed MAX_HIDDEN={MAX_HIDDEN}")
    x, update, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, update, weight))
    h = torch.empty((m, k), device=x.device, dtype=x.dtype)
    out = torch.empty_like(h)
    if m == 0 or k == 0:
        return h, out
    block_k = triton.next_power_of_2(k)
    launch(
        add_rms_norm_kernel,
        (m,),
        x,
        update,
        weight,
        h,
        out,
        k,
        x.stride(0),
        update.stride(0),
        h.stride(0),
        out.stride(0),
        eps,
        BLOCK_K=block_k,
        num_warps=max(1, min(16, block_k // 256)),
    )
    return h, out

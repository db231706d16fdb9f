# Hot path (worker, every FP8 projection): activation quantization and the w8a8 FP8 GEMM.
# What may live here: the Triton kernels and their launches; launches depend only on shapes,
# never on data: safe to capture in a CUDA graph. Importing this module needs no GPU; on CPU the
# kernels run through Triton's interpreter (tests/test_fp8_kernels.py).
"""FP8 GEMM: y[M, N] = dequant(quant(x)) @ dequant(W)^T, W e4m3 [N, K] with float32 scales [N, G].

Two kernels:

1. `fp8_quant_kernel`: x [M, K] -> e4m3 [M, K] and float32 scales [M, G], one program per row and
   group of `group_k` features (per token and 1x128 group for block-scaled weights) or per row (the
   whole row, for per-channel / per-tensor weights), scale = amax / 448; or every element over a
   static input scale.
2. `w8a8_kernel`: one program per (BLOCK_M rows, BLOCK_N columns), walking K. GROUPED (block
   weights): BLOCK_K is the group, and each step's e4m3 product is scaled by its group's row and
   column scales before it is added; otherwise the scales multiply the accumulator once, in the
   epilogue. Decode-sized batches (M <= SKINNY_M) take the broadcast inner product (e4m3 widened
   to float32, multiplied and summed over K: no padding of M to the MMA's 16 rows), the rest
   tl.dot on e4m3 operands (Hopper's FP8 MMA).

`w8a8_fp8_linear` gives decode rows (M <= SKINNY_M) of per-row-scaled weights to a third kernel,
`w8a8_skinny_kernel` (fp8_skinny.py): one launch that quantizes x in registers as kernel 1 does and
takes the broadcast product, instead of two launches and a round trip of the quantized x through
memory.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atomrt.workers.kernels.gemm.fp8_skinny import (  # add_norm: fp8_ops imports it from here
    FP8_MAX,
    MIN_SCALE,
    w8a8_skinny,
    w8a8_skinny_add_norm,  # noqa: F401
)
from atomrt.workers.kernels.gemm.fp8_skinny_configs import SKINNY_M


@triton.jit
def _quantize_row(x_row, q_row, K, scale, BLOCK: tl.constexpr):
    """A row's K features over `scale`, saturated to e4m3, into q (BLOCK at a time)."""
    offs = tl.arange(0, BLOCK)
    for k in range(0, tl.cdiv(K, BLOCK)):
        o = k * BLOCK + offs
        x = tl.load(x_row + o, mask=o < K, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_row + o, q.to(q_row.dtype.element_ty), mask=o < K)


@triton.jit
def fp8_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    static_ptr,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,  # features per scale; 0: the whole row
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
        _quantize_row(x_row, q_row, K, scale, BLOCK)
        tl.store(s_ptr + row * stride_sm, scale)
    elif GROUP > 0:
        o = g * GROUP + offs
        mask = (offs < GROUP) & (o < K)
        x = tl.load(x_row + o, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, MIN_SCALE)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_row + o, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * stride_sm + g, scale)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK)):
            o = k * BLOCK + offs
            x = tl.load(x_row + o, mask=o < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
        _quantize_row(x_row, q_row, K, scale, BLOCK)
        tl.store(s_ptr + row * stride_sm, scale)


def quantize_fp8_triton(
    x: torch.Tensor, group_k: Optional[int], static_scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, G]): see `fp8_quant_kernel`."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if static_scale is not None or group_k is None:
        s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        grid, group, block = (m, 1), 0, min(triton.next_power_of_2(k), 1024)
    else:
        num = triton.cdiv(k, group_k)
        s = torch.empty((m, num), dtype=torch.float32, device=x.device)
        grid, group, block = (m, num), group_k, triton.next_power_of_2(group_k)
    if m:
        fp8_quant_kernel[grid](
            x,
            q,
            s,
            static_scale if static_scale is not None else s,
            k,
            x.stride(0),
            q.stride(0),
            s.stride(0),
            GROUP=group,
            STATIC=static_scale is not None,
            BLOCK=block,
        )
    return q, s


@triton.jit
def w8a8_kernel(
    a_ptr,
    a_s_ptr,
    b_ptr,
    b_s_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    GROUPED: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c = (a * a_s) @ (b * b_s)^T; a e4m3 [M, K], b e4m3 [N, K] (rows K-contiguous), scales per
    row and group of BLOCK_K (GROUPED) or per row."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if USE_DOT:
            # Hopper's wgmma (BLOCK_M 64) sums a step's e4m3 products in an accumulator narrower
            # than float32; each BLOCK_K step then adds to float32. Promoting every 32 or 64 of K
            # (max_num_imprecise_acc) cut the error from ~3e-4 of the largest output to 6e-5 or
            # 1.5e-4 but slowed M=2048 at 8B's shapes by 50-100% or 10-25% on an H100
            part = tl.dot(a, b)
        else:
            part = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        if GROUPED:
            a_s = tl.load(a_s_ptr + offs_m * stride_asm + k, mask=m_mask, other=0.0)
            b_s = tl.load(b_s_ptr + offs_n * stride_bsn + k, mask=n_mask, other=0.0)
            acc += part * a_s[:, None] * b_s[None, :]
        else:
            acc += part
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not GROUPED:
        a_s = tl.load(a_s_ptr + offs_m * stride_asm, mask=m_mask, other=0.0)
        b_s = tl.load(b_s_ptr + offs_n * stride_bsn, mask=n_mask, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w8a8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_k: Optional[int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a e4m3 [M, K] with scales [M, G]; b e4m3 [N, K] with scales [N, G] -> [M, N] `out_dtype`.
    `group_k` (the scales' group; None: per row) must be a power of two >= 16."""
    m, k = a.shape
    n = b.shape[0]
    assert b.shape[1] == k and b.stride(1) == 1 and a.stride(1) == 1
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    use_dot = m > SKINNY_M
    if use_dot:
        block_m, block_n = (64 if m > 64 else max(16, triton.next_power_of_2(m))), 128
    else:
        block_m, block_n = triton.next_power_of_2(m), 16
    block_k = group_k if group_k is not None else 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    w8a8_kernel[grid](
        a,
        a_scale,
        b,
        b_scale,
        c,
        m,
        n,
        k,
        a.stride(0),
        a_scale.stride(0),
        b.stride(0),
        b_scale.stride(0),
        c.stride(0),
        GROUPED=group_k is not None and a_scale.shape[1] > 1,
        USE_DOT=use_dot,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return c


def w8a8_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: Optional[torch.Tensor],
    group_k: Optional[int],
) -> torch.Tensor:
    """x [M, K] @ e4m3 weight [N, K]^T (scales [N, G]) -> [M, N] in x's dtype: x quantized per
    token and group (`group_k`; None: per token) or over the static `input_scale`."""
    x = x.contiguous()
    if 0 < x.shape[0] <= SKINNY_M and weight_scale.shape[1] == 1:  # per-row scales
        return w8a8_skinny(x, weight, weight_scale, group_k, input_scale)
    q, s = quantize_fp8_triton(x, group_k, input_scale)
    if input_scale is not None and weight_scale.shape[1] > 1:
        s = s.expand(-1, weight_scale.shape[1]).contiguous()  # one scale for every group
    return w8a8_gemm(q, s, weight, weight_scale, group_k, x.dtype)

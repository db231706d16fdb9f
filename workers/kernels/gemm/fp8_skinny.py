# Hot path (worker, every FP8 projection of decode rows): the fused decode GEMM.
# What may live here: its Triton kernel and launches; launches depend only on shapes, never on
# data: safe to capture in a CUDA graph. Importing this module needs no GPU; on CPU the kernel runs
# through Triton's interpreter (tests/test_fp8_kernels.py).
"""The fused FP8 decode GEMM: y[M, N] = quant(x) @ dequant(W)^T for decode rows (M <= SKINNY_M),
W e4m3 [N, K] with float32 scales [N, G], x quantized per token in registers as
`fp8_gemm.fp8_quant_kernel` quantizes it, in one launch (`w8a8_skinny`); optionally after a
residual add and RMSNorm (`w8a8_skinny_add_norm`). Launches per shape: fp8_skinny_configs.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from atomrt.workers.kernels import device_info
from atomrt.workers.kernels.device_info import sm_count, use_pdl
from atomrt.workers.kernels.gemm.fp8_skinny_configs import (
    SKINNY_M,
    SkinnyOptions,
    skinny_defers_sum,
    skinny_launch,
    skinny_options,
)
from atomrt.workers.kernels.gemm.skinny_kernels import _residual_sum

FP8_MAX = tl.constexpr(448.0)  # a kernel reads only constexpr globals (compiled, not interpreted)
MIN_SCALE = tl.constexpr(1e-12)


@triton.jit
def _skinny_x_tile(x_ptrs, u_ptrs, nw_ptrs, mask, k_mask, inv_rms, NORM: tl.constexpr):
    """A K step's tile of the GEMM's input rows: x, or with NORM RMSNorm(x + update) as
    rms_norm computes it (h = x + update and h * inv_rms each rounded to x's dtype, then times the
    norm's weight, rounded again)."""
    if NORM:
        h = _residual_sum(x_ptrs, u_ptrs, mask)
        normed = (h.to(tl.float32) * inv_rms).to(h.dtype)
        norm_w = tl.load(nw_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        return (norm_w * normed.to(tl.float32)).to(h.dtype)
    return tl.load(x_ptrs, mask=mask, other=0.0)


@triton.jit
def w8a8_skinny_kernel(
    x_ptr,
    b_ptr,
    b_s_ptr,
    static_ptr,
    c_ptr,  # [M, N]; SPLIT_K > 1: float32 partials [SPLIT_K, M, N], contiguous
    u_ptr,  # NORM only: update [M, K]; the norm's weight [K]; out: h = x + update [M, K]
    nw_ptr,
    h_ptr,
    M,
    N,
    K,
    K_SPLIT,  # K elements per split, a multiple of BLOCK_K (K itself when SPLIT_K is 1)
    stride_xm,
    stride_bn,
    stride_bsn,
    stride_cm,
    stride_um,
    stride_hm,
    eps,  # NORM only: the RMSNorm's epsilon
    GROUP: tl.constexpr,  # features per scale of x and of b's rows; 0: one scale per row
    STATIC: tl.constexpr,  # x's scale is *static_ptr (GROUP 0 only)
    NORM: tl.constexpr,  # the product reads RMSNorm(x + update) (GROUP 0 only)
    DEFER_SUM: tl.constexpr,  # GROUP 0: sum the products over K once, after the loop
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of GROUP
    NUM_STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,  # the launch variants (GROUP 0 only): see SkinnyOptions
    PERSISTENT: tl.constexpr = False,
    X_BLOCK: tl.constexpr = 0,  # K elements per step of the passes over x (0: BLOCK_K)
    X_ONE_PASS: tl.constexpr = False,  # NORM, X_BLOCK >= K: statistics and amax from one load
    PRELOAD: tl.constexpr = False,
    W_CACHE: tl.constexpr = "",
    W_EVICT: tl.constexpr = "",
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (use_pdl)
):
    """Decode rows: c[:, cols] = quant(x) @ (b * b_s)^T in one launch, x quantized to e4m3 in
    registers exactly as `fp8_quant_kernel` quantizes it (same scales, same rounding), each
    element then carried dequantized (q * scale) into the broadcast product, so that no quantized
    copy of x goes through memory. One program per BLOCK_N columns, every row (per-row scales:
    per tile of BLOCK_N columns and one of SPLIT_K ranges of K, or PERSISTENT over tiles).

    NORM: x is RMSNorm(x + update) with the norm's weight, a decoder layer's residual add and norm
    before its projection: a first pass over the rows takes their statistics (program 0 writes h),
    and every later read of x recomputes the normalized tile (x is a few KB, from L1 / L2).

    USE_PDL: the weights (which no kernel writes during a forward) may load before the wait on
    the kernel before (PRELOAD's first step), nothing else."""
    rows = tl.arange(0, BLOCK_M)
    m_mask = rows < M
    if GROUP > 0:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = cols < N
        b_rows = b_ptr + cols.to(tl.int64) * stride_bn
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        NG: tl.constexpr = BLOCK_K // GROUP
        gs = tl.arange(0, NG)
        kk = gs[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [NG, GROUP]
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k_mask = (k0 + kk < K)[None, :, :]
            w = tl.load(
                b_rows[:, None, None] + k0 + kk[None, :, :],
                mask=n_mask[:, None, None] & k_mask,
                other=0.0,
            )  # [BLOCK_N, NG, GROUP]
            b_s = tl.load(
                b_s_ptr + cols[:, None] * stride_bsn + k0 // GROUP + gs[None, :],
                mask=n_mask[:, None] & (k0 + gs * GROUP < K)[None, :],
                other=0.0,
            )  # [BLOCK_N, NG]
            x = tl.load(
                x_ptr + rows[:, None, None] * stride_xm + k0 + kk[None, :, :],
                mask=m_mask[:, None, None] & k_mask,
                other=0.0,
            ).to(tl.float32)  # [BLOCK_M, NG, GROUP]
            a_s = tl.maximum(tl.max(tl.abs(x), axis=2) / FP8_MAX, MIN_SCALE)[:, :, None]
            xq = tl.clamp(x / a_s, -FP8_MAX, FP8_MAX).to(tl.float8e4nv).to(tl.float32) * a_s
            wd = w.to(tl.float32) * b_s[:, :, None]
            acc += tl.sum(tl.sum(wd[:, None, :, :] * xq[None, :, :, :], axis=3), axis=2)
        c_ptrs = c_ptr + rows[None, :] * stride_cm + cols[:, None]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])
    else:
        tile = tl.program_id(0)
        w_first = 0  # PRELOAD: the tile's first weight step, in flight during the passes over x
        if PRELOAD:
            cols = (tile // SPLIT_K) * BLOCK_N + tl.arange(0, BLOCK_N)
            k_lo = (tile % SPLIT_K) * K_SPLIT
            ks = k_lo + tl.arange(0, BLOCK_K)[None, None, :]
            w_first = tl.load(
                b_ptr + cols.to(tl.int64)[:, None, None] * stride_bn + ks,
                mask=(cols < N)[:, None, None] & (ks < tl.minimum(K, k_lo + K_SPLIT)),
                other=0.0,
                cache_modifier=W_CACHE,
                eviction_policy=W_EVICT,
            )
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        inv_rms, a_s = _row_scales(
            x_ptr, u_ptr, nw_ptr, h_ptr, static_ptr, M, K, stride_xm, stride_um, stride_hm, eps,
            STATIC, NORM, BLOCK_M, X_BLOCK if X_BLOCK > 0 else BLOCK_K, X_ONE_PASS,
        )  # fmt: skip
        if PERSISTENT:
            for t in range(tile, tl.cdiv(N, BLOCK_N) * SPLIT_K, tl.num_programs(0)):
                _row_tile(
                    t, w_first, x_ptr, u_ptr, nw_ptr, b_ptr, b_s_ptr, c_ptr, M, N, K, K_SPLIT,
                    stride_xm, stride_bn, stride_bsn, stride_cm, stride_um, inv_rms, a_s,
                    NORM, DEFER_SUM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, SPLIT_K, False,
                    W_CACHE, W_EVICT,
                )  # fmt: skip
        else:
            _row_tile(
                tile, w_first, x_ptr, u_ptr, nw_ptr, b_ptr, b_s_ptr, c_ptr, M, N, K, K_SPLIT,
                stride_xm, stride_bn, stride_bsn, stride_cm, stride_um, inv_rms, a_s,
                NORM, DEFER_SUM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, SPLIT_K, PRELOAD,
                W_CACHE, W_EVICT,
            )  # fmt: skip


@triton.jit
def _row_scales(
    x_ptr, u_ptr, nw_ptr, h_ptr, static_ptr, M, K, stride_xm, stride_um, stride_hm, eps,
    STATIC: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, X_BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):  # fmt: skip
    """(inv_rms, a_s), each [1, BLOCK_M, 1]: NORM's 1 / rms of x + update per row (program 0
    writes h = x + update on the way) and the rows' e4m3 scales, from passes over x in X_BLOCK
    steps, each step one dependent round trip to L2 (ONE_PASS: NORM over rows within one step,
    both from that step's one load)."""
    m3 = tl.arange(0, BLOCK_M)[None, :, None]
    mm3 = m3 < M
    xs = tl.arange(0, X_BLOCK)[None, None, :]
    x_rows = x_ptr + m3 * stride_xm + xs  # [1, BLOCK_M, X_BLOCK]
    u_rows = u_ptr + m3 * stride_um + xs
    inv_rms = tl.zeros((1, BLOCK_M, 1), dtype=tl.float32)
    if ONE_PASS:
        mask = mm3 & (xs < K)
        h = _residual_sum(x_rows, u_rows, mask)
        if tl.program_id(0) == 0:
            tl.store(h_ptr + m3 * stride_hm + xs, h, mask=mask)
        sum_sq = tl.sum(h.to(tl.float32) * h.to(tl.float32), axis=2)  # [1, BLOCK_M]
        inv_rms = tl.rsqrt(sum_sq / K + eps)[:, :, None]
        normed = (h.to(tl.float32) * inv_rms).to(h.dtype)  # as _skinny_x_tile
        norm_w = tl.load(nw_ptr + xs, mask=xs < K, other=0.0).to(tl.float32)
        x = (norm_w * normed.to(tl.float32)).to(h.dtype)
        a_s = tl.maximum(tl.max(tl.abs(x.to(tl.float32)), axis=2) / FP8_MAX, MIN_SCALE)[:, :, None]
        if STATIC:
            a_s = tl.load(static_ptr).to(tl.float32) + tl.zeros((1, BLOCK_M, 1), dtype=tl.float32)
        return inv_rms, a_s
    if NORM:  # the rows' statistics; program 0 writes h on the way
        h_rows = h_ptr + m3 * stride_hm + xs
        sum_sq = tl.zeros((1, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, X_BLOCK):
            mask = mm3 & (k0 + xs < K)
            h = _residual_sum(x_rows + k0, u_rows + k0, mask)
            if tl.program_id(0) == 0:
                tl.store(h_rows + k0, h, mask=mask)
            sum_sq += tl.sum(h.to(tl.float32) * h.to(tl.float32), axis=2)
        inv_rms = tl.rsqrt(sum_sq / K + eps)[:, :, None]
    if STATIC:
        a_s = tl.load(static_ptr).to(tl.float32) + tl.zeros((1, BLOCK_M, 1), dtype=tl.float32)
    else:  # the row's amax first: x is a few KB, read again by the K loop from L1 / L2
        amax = tl.zeros((1, BLOCK_M, X_BLOCK), dtype=tl.float32)
        for k0 in range(0, K, X_BLOCK):
            k_mask = k0 + xs < K
            x = _skinny_x_tile(
                x_rows + k0, u_rows + k0, nw_ptr + xs + k0, mm3 & k_mask, k_mask, inv_rms, NORM
            )
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        a_s = tl.maximum(tl.max(amax, axis=2) / FP8_MAX, MIN_SCALE)[:, :, None]
    return inv_rms, a_s


@triton.jit
def _row_product(w, x_ptrs, u_ptrs, nw_ptrs, mm3, k_mask, inv_rms, a_s, NORM: tl.constexpr):
    """A K step's products [BLOCK_N, BLOCK_M, BLOCK_K]: the weight tile w [BLOCK_N, 1, BLOCK_K]
    times the rows' tile [1, BLOCK_M, BLOCK_K] quantized to e4m3 over a_s."""
    x = _skinny_x_tile(x_ptrs, u_ptrs, nw_ptrs, mm3 & k_mask, k_mask, inv_rms, NORM)
    xq = tl.clamp(x.to(tl.float32) / a_s, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    return w.to(tl.float32) * xq.to(tl.float32)


@triton.jit
def _row_tile(
    tile, w_first, x_ptr, u_ptr, nw_ptr, b_ptr, b_s_ptr, c_ptr, M, N, K, K_SPLIT,
    stride_xm, stride_bn, stride_bsn, stride_cm, stride_um, inv_rms, a_s,
    NORM: tl.constexpr, DEFER_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr,
    PRELOAD: tl.constexpr, W_CACHE: tl.constexpr, W_EVICT: tl.constexpr,
):  # fmt: skip
    """One tile of per-row-scaled weights: columns tile // SPLIT_K's BLOCK_N, over K range
    tile % SPLIT_K's, into c (SPLIT_K 1) or its float32 partials (w_first: that range's first
    weight step, with PRELOAD)."""
    if SPLIT_K == 1:
        col_block, split, k_lo, k_hi = tile, 0, 0, K
    else:
        col_block, split = tile // SPLIT_K, tile % SPLIT_K
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    n_mask = cols < N
    m_mask = rows < M
    # 3-D tiles, x [1, BLOCK_M, BLOCK_K] and W [BLOCK_N, 1, BLOCK_K], so that the product keeps
    # the loads' vector layout: 2-D loads expanded to 3-D convert the W tile's layout through
    # shared memory at every step (as the bf16 skinny kernel notes)
    ks = tl.arange(0, BLOCK_K)[None, None, :]
    m3 = rows[None, :, None]
    mm3 = m_mask[None, :, None]
    x_rows = x_ptr + m3 * stride_xm + ks  # [1, BLOCK_M, BLOCK_K]
    u_rows = u_ptr + m3 * stride_um + ks
    nw = nw_ptr + ks
    w_rows = b_ptr + cols.to(tl.int64)[:, None, None] * stride_bn + ks  # [BLOCK_N, 1, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # DEFER_SUM: each thread keeps its products' running sums and the cross-thread sum over K
    # runs once; otherwise every K step sums its products across threads (shuffles and adds
    # per weight that leave a decode GEMV issue-bound, not memory-bound)
    partial = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    k_start = k_lo
    if PRELOAD:
        prod = _row_product(
            w_first, x_rows + k_lo, u_rows + k_lo, nw + k_lo, mm3, k_lo + ks < k_hi, inv_rms, a_s,
            NORM,
        )  # fmt: skip
        if DEFER_SUM:
            partial += prod
        else:
            acc += tl.sum(prod, axis=2)
        k_start = k_lo + BLOCK_K
    for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = k0 + ks < k_hi
        w = tl.load(
            w_rows + k0,
            mask=n_mask[:, None, None] & k_mask,
            other=0.0,
            cache_modifier=W_CACHE,
            eviction_policy=W_EVICT,
        )
        prod = _row_product(
            w, x_rows + k0, u_rows + k0, nw + k0, mm3, k_mask, inv_rms, a_s, NORM
        )  # [BLOCK_N, BLOCK_M, BLOCK_K]
        if DEFER_SUM:
            partial += prod
        else:
            acc += tl.sum(prod, axis=2)
    if DEFER_SUM:
        acc = tl.sum(partial, axis=2)
    b_s = tl.load(b_s_ptr + cols * stride_bsn, mask=n_mask, other=0.0)
    acc = acc * b_s[:, None] * tl.reshape(a_s, (1, BLOCK_M))
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        c_ptrs = c_ptr + rows[None, :] * stride_cm + cols[:, None]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:  # this split's float32 partial
        tl.store(c_ptr + split * M * N + rows[None, :] * N + cols[:, None], acc, mask=mask)


@triton.jit
def _split_k_sum_kernel(
    p_ptr, c_ptr, M, N, stride_cm,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """c [M, N] = the sum of the float32 partials [SPLIT_K, M, N], split 0 first: the same order
    every run, so the same result."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * M * N + offs, mask=mask, other=0.0)
    tl.store(c_ptr + (offs // N) * stride_cm + offs % N, acc.to(c_ptr.dtype.element_ty), mask=mask)


def w8a8_skinny(
    x: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_k: Optional[int],
    static_scale: Optional[torch.Tensor] = None,
    launch: Optional[tuple[int, int, int, int]] = None,
    defer_sum: Optional[bool] = None,
    options: Optional[SkinnyOptions] = None,
) -> torch.Tensor:
    """x [M, K] (M <= SKINNY_M, float) @ e4m3 b [N, K]^T with scales [N, G] -> [M, N] in x's
    dtype: `w8a8_fp8_linear`'s result for decode rows, x quantized inside the GEMM's launch.
    `launch` (block_k, products, warps, stages) overrides skinny_launch's for the shape,
    `defer_sum` skinny_defers_sum's, `options` skinny_options's (per-row scales only)."""
    m, k = x.shape
    assert b.shape[1] == k and b.stride(1) == 1 and x.stride(1) == 1 and m <= SKINNY_M
    c = torch.empty((m, b.shape[0]), dtype=x.dtype, device=x.device)
    if m:
        grouped = static_scale is None and group_k is not None and b_scale.shape[1] > 1
        group = group_k if grouped else 0
        _launch_skinny(
            x, b, b_scale, group, static_scale, c, launch, defer_sum=defer_sum, options=options
        )
    return c


def w8a8_skinny_add_norm(
    residual: torch.Tensor,
    update: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    static_scale: Optional[torch.Tensor] = None,
    launch: Optional[tuple[int, int, int, int]] = None,
    options: Optional[SkinnyOptions] = None,
    defer_sum: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = residual + update, y = w8a8_skinny(RMSNorm(h) * norm_weight, b) for per-row
    scales [N, 1] (static or per token), in one launch: a decoder layer's residual add, norm and
    FP8 projection, the norm computed as rms_norm computes it (workers/layers/norm.py)."""
    m, k = residual.shape
    if (
        update.shape != residual.shape
        or update.dtype != residual.dtype
        or norm_weight.shape != (k,)
        or norm_weight.dtype != residual.dtype
        or b_scale.shape[1] != 1
        or b.shape[1] != k
        or b.stride(1) != 1
        or not 0 < m <= SKINNY_M
    ):
        raise ValueError(
            f"w8a8_skinny_add_norm: want residual and update [M, K] (0 < M <= {SKINNY_M}) and "
            f"norm_weight [K] of one dtype, a weight [N, K] with per-row scales [N, 1]; got residual "
            f"{tuple(residual.shape)} {residual.dtype}, update {tuple(update.shape)} "
            f"{update.dtype}, norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype}, "
            f"weight {tuple(b.shape)}, scales {tuple(b_scale.shape)}"
        )
    residual, update, norm_weight = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (residual, update, norm_weight)
    )
    h = torch.empty_like(residual)
    c = torch.empty((m, b.shape[0]), dtype=residual.dtype, device=residual.device)
    norm = (update, norm_weight, h, eps)
    _launch_skinny(residual, b, b_scale, 0, static_scale, c, launch, norm, defer_sum, options)
    return h, c


SPLIT_K_SUM_BLOCK = 1024  # outputs per program of the split-K sum


class SkinnyPlan(NamedTuple):
    """A w8a8_skinny_kernel launch: its grid, K elements per split and constexprs (num_warps
    with them); split_k > 1 adds the sum's launch."""

    grid: int
    split_k: int
    k_split: int
    constexprs: dict[str, Any]


def plan_skinny(
    m: int,
    n: int,
    k: int,
    group: int,
    num_sms: int,
    launch: Optional[tuple[int, int, int, int]] = None,
    defer_sum: Optional[bool] = None,
    options: Optional[SkinnyOptions] = None,
    static: bool = False,
    norm: bool = False,
    pdl: bool = False,
) -> SkinnyPlan:
    """w8a8_skinny_kernel's launch for M rows of a weight [n, k]: `launch`, `defer_sum` and
    `options` override the shape's (skinny_launch, skinny_defers_sum, skinny_options)."""
    block_k, products, warps, stages = launch or skinny_launch(n, k)
    if options is None:
        options = skinny_options(n, k) if group == 0 else SkinnyOptions()
    elif group and options != SkinnyOptions():
        raise ValueError(
            f"w8a8_skinny: launch variants take per-row weight scales; got {options} with "
            f"{group}-feature groups"
        )
    block_m = triton.next_power_of_2(m)
    block_k = max(group, min(block_k, triton.next_power_of_2(k)))
    block_n = max(4, products // (block_m * block_k))
    split_k = min(options.split_k, triton.cdiv(k, block_k))  # no split without a K step
    k_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    tiles = triton.cdiv(n, block_n) * split_k
    grid = min(tiles, options.persistent * num_sms) if options.persistent else tiles
    x_block = min(options.x_block, triton.next_power_of_2(k)) if options.x_block else block_k
    constexprs = dict(
        GROUP=group,
        STATIC=static,
        NORM=norm,
        DEFER_SUM=skinny_defers_sum(n, k) if defer_sum is None else defer_sum,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NUM_STAGES=stages,
        SPLIT_K=split_k,
        PERSISTENT=bool(options.persistent),
        X_BLOCK=x_block,
        X_ONE_PASS=norm and bool(options.x_block) and x_block >= k,
        PRELOAD=options.preload,
        W_CACHE=options.weight_cache,
        W_EVICT=options.weight_evict,
        USE_PDL=pdl,
        num_warps=warps,
    )
    return SkinnyPlan(grid, split_k, k_split, constexprs)


def _launch_skinny(
    x: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group: int,
    static_scale: Optional[torch.Tensor],
    c: torch.Tensor,
    launch: Optional[tuple[int, int, int, int]],
    norm: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = None,
    defer_sum: Optional[bool] = None,
    options: Optional[SkinnyOptions] = None,
) -> None:
    """w8a8_skinny_kernel over x's M rows into c (with split K, into float32 partials and then
    the sum's kernel); `norm` (update, norm weight, h out, eps) adds the residual add and RMSNorm
    prologue."""
    (m, k), n = x.shape, b.shape[0]
    pdl = use_pdl(x.device)
    plan = plan_skinny(
        m, n, k, group, sm_count(x.device), launch, defer_sum, options,
        static=static_scale is not None, norm=norm is not None, pdl=pdl,
    )  # fmt: skip
    out = c
    if plan.split_k > 1:
        out = torch.empty((plan.split_k, m, n), dtype=torch.float32, device=c.device)
    update, norm_weight, h, eps = norm if norm is not None else (x, x, x, 0.0)
    w8a8_skinny_kernel[(plan.grid,)](
        x, b, b_scale, static_scale if static_scale is not None else b_scale, out,
        update, norm_weight, h,
        m, n, k, plan.k_split,
        x.stride(0), b.stride(0), b_scale.stride(0), c.stride(0), update.stride(0), h.stride(0),
        eps,
        **plan.constexprs,
        launch_pdl=pdl and device_info.PDL_ATTRIBUTE,
    )  # fmt: skip
    if plan.split_k > 1:
        _split_k_sum_kernel[(triton.cdiv(m * n, SPLIT_K_SUM_BLOCK),)](
            out, c, m, n, c.stride(0), SPLIT_K=plan.split_k, BLOCK=SPLIT_K_SUM_BLOCK,
            USE_PDL=pdl, launch_pdl=pdl and device_info.PDL_ATTRIBUTE,
        )  # fmt: skip

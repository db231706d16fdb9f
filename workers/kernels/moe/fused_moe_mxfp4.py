# Hot path (worker, twice per MXFP4 MoE layer): the MXFP4 experts' GEMMs over a routing.
# What may live here: the Triton kernel and its launch; launches depend only on shapes (and the
# device-side routing metadata), never on a value read back to the host: CUDA graphs record them.
"""The fused mixture-of-experts GEMMs with MXFP4 experts and 16-bit activations (w4a16, as Hopper
runs DeepSeek-V4's routed experts): `fused_moe.py`'s two launches over the expert-sorted pairs of
`moe_align_block_size`, each weight tile dequantized in registers before its product.

`w13` [E, 2I, H / 2] and `w2` [E, H, I / 2] hold packed e2m1 pairs (uint8, the even input feature
in the low nibble), `w13_scale` [E, 2I, H / 32] and `w2_scale` [E, H, I / 32] one e8m0 exponent
byte per 32 input features (workers/layers/quantization/mxfp4.py). A K tile of BLOCK_K features is
BLOCK_K / 2 bytes per output column: the low nibbles meet the activations' even features and the
high nibbles the odd ones, so each tile is two products. With `limit` the gate/up epilogue is
DeepSeek-V4's clamped SwiGLU, silu(min(gate, limit)) * clamp(up, -limit, limit). Importing this
module needs no GPU; on CPU it runs through Triton's interpreter (tests/test_mxfp4_kernels.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atomrt.workers.kernels.moe.align import moe_align_block_size
from atomrt.workers.kernels.moe.fused_moe import pair_tile, store_pair_block

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64  # input features per step: 32 bytes per column, two 32-feature scale groups
SCALE_GROUP = 32
KERNEL_SCALE_GROUP = tl.constexpr(SCALE_GROUP)  # a compiled kernel reads only constexpr globals


@triton.jit
def _e2m1(code):
    """The values of e2m1 codes (int32, 0-15): bit 3 the sign, bits 2-1 the exponent, bit 0 the
    mantissa; exponent 0 is subnormal (0 or 0.5)."""
    magnitude = code & 7
    exponent = magnitude >> 1
    mantissa = (magnitude & 1).to(tl.float32)
    normal = (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32))
    value = tl.where(exponent == 0, 0.5 * mantissa, normal)
    return tl.where(code >= 8, -value, value)


@triton.jit
def _mxfp4_tile(b_ptrs, s_ptrs, mask, dtype):
    """A packed K tile [BLOCK_K / 2, BLOCK_N] and its exponents -> (even, odd) features' weights
    in `dtype`."""
    packed = tl.load(b_ptrs, mask=mask, other=0).to(tl.int32)
    exponent = tl.load(s_ptrs, mask=mask, other=127).to(tl.float32)
    factor = tl.exp2(exponent - 127.0)
    return (_e2m1(packed & 15) * factor).to(dtype), (_e2m1(packed >> 4) * factor).to(dtype)


@triton.jit
def fused_moe_mxfp4_kernel(
    a_ptr,
    b_ptr,
    b_s_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    limit,
    stride_am,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_cm,
    A_ROWS_PER_PAIR: tl.constexpr,
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """c[pair, n] for the program's pairs and columns (see fused_moe.fused_moe_kernel); `b` packed
    e2m1 [E, rows, K / 2] uint8, `b_s` e8m0 exponents [E, rows, K / 32] uint8."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        return
    pair, pair_mask, expert, a_row, offs_n, n_mask = pair_tile(
        pid_m, pid_n, sorted_pair_ids_ptr, expert_ids_ptr, num_pairs, N, A_ROWS_PER_PAIR,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip
    offs_h = tl.arange(0, BLOCK_K // 2)  # the tile's bytes: features 2h, 2h + 1
    a_base = a_ptr + a_row[:, None] * stride_am
    b_base = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    s_base = b_s_ptr + expert * stride_bse + offs_n[None, :] * stride_bsn
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        even = k * BLOCK_K + 2 * offs_h  # [BLOCK_K / 2]
        k_mask = even < K
        a_mask = pair_mask[:, None] & k_mask[None, :]
        a_even = tl.load(a_base + even[None, :], mask=a_mask, other=0.0)
        a_odd = tl.load(a_base + even[None, :] + 1, mask=a_mask, other=0.0)
        b_ptrs = b_base + (even // 2)[:, None]
        s_ptrs = s_base + (even // KERNEL_SCALE_GROUP)[:, None]
        b_mask = k_mask[:, None] & n_mask[None, :]
        w_even, w_odd = _mxfp4_tile(b_ptrs, s_ptrs, b_mask, dtype)
        acc = tl.dot(a_even, w_even, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(a_odd, w_odd, acc, input_precision=DOT_PRECISION)
        if GATED:
            up_even, up_odd = _mxfp4_tile(
                b_ptrs + N * stride_bn, s_ptrs + N * stride_bsn, b_mask, dtype
            )
            acc_up = tl.dot(a_even, up_even, acc_up, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a_odd, up_odd, acc_up, input_precision=DOT_PRECISION)
    if CLAMP:  # DeepSeek-V4's SwiGLU: gate <= limit, -limit <= up <= limit
        acc = tl.minimum(acc, limit)
        acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
    store_pair_block(
        acc, acc_up, pair, pair_mask, offs_n, n_mask, topk_weights_ptr, c_ptr, stride_cm, 1,
        GATED, MUL_ROUTED_WEIGHT,
    )  # fmt: skip


def _launch(
    a: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    align: object,
    num_pairs: int,
    a_rows_per_pair: int,
    gated: bool,
    limit: Optional[float],
) -> None:
    n = b.shape[1] // 2 if gated else b.shape[1]
    k = 2 * b.shape[2]
    grid = (align.expert_ids.shape[0], triton.cdiv(n, BLOCK_N))
    fused_moe_mxfp4_kernel[grid](
        a,
        b,
        b_s,
        c,
        topk_weights,
        align.sorted_pair_ids,
        align.expert_ids,
        align.num_padded_pairs,
        n,
        k,
        num_pairs,
        float(limit) if limit is not None else 0.0,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        b_s.stride(0),
        b_s.stride(1),
        c.stride(0),
        A_ROWS_PER_PAIR=a_rows_per_pair,
        GATED=gated,
        MUL_ROUTED_WEIGHT=not gated,
        CLAMP=gated and limit is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        # float32 activations are asked for exactness (tests, references): no tf32 rounding
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4,
    )


def fused_experts_mxfp4(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: Optional[float] = None,
) -> torch.Tensor:
    """x [num_tokens, H] -> [num_tokens, H] in x's dtype (see the module docstring); `limit`:
    the clamped SwiGLU's bound (None: plain silu(gate) * up)."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    shapes = (w13.shape, w13_scale.shape, w2.shape, w2_scale.shape)
    want = (
        (num_experts, two_i, hidden // 2),
        (num_experts, two_i, hidden // SCALE_GROUP),
        (num_experts, hidden, inter // 2),
        (num_experts, hidden, inter // SCALE_GROUP),
    )
    if hidden % SCALE_GROUP or inter % SCALE_GROUP or tuple(map(tuple, shapes)) != want:
        raise ValueError(
            f"fused_experts_mxfp4: w13 {tuple(w13.shape)} / {tuple(w13_scale.shape)} and w2 "
            f"{tuple(w2.shape)} / {tuple(w2_scale.shape)} are not MXFP4 experts for x "
            f"{tuple(x.shape)} (want {want}: sizes multiples of {SCALE_GROUP})"
        )
    num_pairs = num_tokens * top_k
    align = moe_align_block_size(topk_ids, BLOCK_M, num_experts)
    weights = topk_weights.reshape(-1)
    x = x.contiguous()
    activated = x.new_empty(num_pairs, inter)
    _launch(x, w13, w13_scale, activated, weights, align, num_pairs, top_k, True, limit)
    per_pair = x.new_empty(num_pairs, hidden)
    _launch(activated, w2, w2_scale, per_pair, weights, align, num_pairs, 1, False, None)
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)

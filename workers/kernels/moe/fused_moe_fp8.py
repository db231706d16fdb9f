# Hot path (worker, twice per FP8 MoE layer): the FP8 experts' GEMMs over a routing.
# What may live here: the Triton kernel and its launch; launches depend only on shapes (and the
# device-side routing metadata), never on a value read back to the host: CUDA graphs record them.
"""The fused mixture-of-experts GEMMs with FP8 (e4m3) experts: `fused_moe.py`'s two launches over
the expert-sorted pairs of `moe_align_block_size`, with e4m3 operands and float32 scales.

    out[t] = sum_j w[t, j] * dequant(W2[e_j]) @ q(silu(g) * u),  (g | u) = dequant(W13[e_j]) @ q(x[t])

`w13` e4m3 [E, 2I, H] with scales [E, 2I, G_H], `w2` e4m3 [E, H, I] with scales [E, H, G_I], one
per output row and group of `group_k` input features (None: per row). q() quantizes per token and
group (`fp8_gemm.quantize_fp8_triton`): x before the gate/up GEMM, the activated rows before the
down GEMM. With groups, BLOCK_K is the group and each step's product is scaled by its group's scales;
per row, the scales multiply the accumulator in the epilogue. Importing this module needs no GPU; on
CPU it runs through Triton's interpreter (tests/test_fp8_kernels.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from atomrt.workers.kernels.gemm.fp8_gemm import quantize_fp8_triton
from atomrt.workers.kernels.moe.align import MoEAlignment, moe_align_block_size
from atomrt.workers.kernels.moe.fused_moe import moe_dims, pair_tile, store_pair_block

BLOCK_M = 16


@dataclass(frozen=True)
class FP8MoELaunch:
    """One launch of fused_moe_fp8_kernel past its BLOCK_M pairs a program."""

    block_n: int = 64  # output columns a program
    block_k: int = 128  # reduction step over per-row scales (block-scaled weights: their group)
    num_warps: int = 4
    num_stages: int = 3  # Triton's default software pipelining depth

    def __post_init__(self) -> None:
        for knob, least in (("block_n", 16), ("block_k", 16), ("num_warps", 1)):
            value = getattr(self, knob)
            if value < least or value & (value - 1):
                raise ValueError(
                    f"FP8MoELaunch.{knob} must be a power of two >= {least}, got {value}"
                )
        if self.num_stages < 1:
            raise ValueError(f"FP8MoELaunch.num_stages must be >= 1, got {self.num_stages}")


DEFAULT_LAUNCH = FP8MoELaunch()
# ("gate_up" | "down", N, K) -> the launch a GPU sweep found faster than DEFAULT_LAUNCH at decode
# rows (benchmarks/bench_moe_fp8.py --sweep); other shapes take the default. One H100, 1 token,
# per-row scales: V2-Lite's gate_up 15.14 against 16.93 us, down 9.38 against 10.42
FP8_MOE_LAUNCHES: dict[tuple[str, int, int], FP8MoELaunch] = {
    ("gate_up", 1408, 2048): FP8MoELaunch(block_n=32, block_k=256, num_warps=4, num_stages=3),
    ("down", 2048, 1408): FP8MoELaunch(block_n=32, block_k=128, num_warps=4, num_stages=5),
}


def fp8_moe_launch(gemm: str, n: int, k: int) -> FP8MoELaunch:
    """The launch of `gemm`'s fused FP8 experts GEMM with output width n and reduction width k."""
    return FP8_MOE_LAUNCHES.get((gemm, n, k), DEFAULT_LAUNCH)


@triton.jit
def fused_moe_fp8_kernel(
    a_ptr,
    a_s_ptr,
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
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_cm,
    A_ROWS_PER_PAIR: tl.constexpr,
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[pair, n] for the program's pairs and columns (see fused_moe.fused_moe_kernel); operands
    e4m3, `a_s` [rows, G] and `b_s` [E, rows, G] float32."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        return
    pair, pair_mask, expert, a_row, offs_n, n_mask = pair_tile(
        pid_m, pid_n, sorted_pair_ids_ptr, expert_ids_ptr, num_pairs, N, A_ROWS_PER_PAIR,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    a_s_ptrs = a_s_ptr + a_row * stride_asm
    b_s_ptrs = b_s_ptr + expert * stride_bse + offs_n * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        part = tl.dot(a, b)
        if GATED:
            b_up = tl.load(
                b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0
            )
            part_up = tl.dot(a, b_up)
        if GROUPED:
            a_s = tl.load(a_s_ptrs + k, mask=pair_mask, other=0.0)
            b_s = tl.load(b_s_ptrs + k, mask=n_mask, other=0.0)
            acc += part * a_s[:, None] * b_s[None, :]
            if GATED:
                b_s_up = tl.load(b_s_ptrs + N * stride_bsn + k, mask=n_mask, other=0.0)
                acc_up += part_up * a_s[:, None] * b_s_up[None, :]
        else:
            acc += part
            if GATED:
                acc_up += part_up
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not GROUPED:
        a_s = tl.load(a_s_ptrs, mask=pair_mask, other=0.0)
        b_s = tl.load(b_s_ptrs, mask=n_mask, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
        if GATED:
            b_s_up = tl.load(b_s_ptrs + N * stride_bsn, mask=n_mask, other=0.0)
            acc_up = acc_up * a_s[:, None] * b_s_up[None, :]
    store_pair_block(
        acc, acc_up, pair, pair_mask, offs_n, n_mask, topk_weights_ptr, c_ptr, stride_cm, 1,
        GATED, MUL_ROUTED_WEIGHT,
    )  # fmt: skip


def _launch(
    a: torch.Tensor,
    a_s: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    align: MoEAlignment,
    num_pairs: int,
    a_rows_per_pair: int,
    gated: bool,
    group_k: Optional[int],
    launch: Optional[FP8MoELaunch] = None,
) -> None:
    """One of the two GEMMs at `launch` (default: fp8_moe_launch's for its shape)."""
    n = b.shape[1] // 2 if gated else b.shape[1]
    k = b.shape[2]
    launch = launch or fp8_moe_launch("gate_up" if gated else "down", n, k)
    grouped = group_k is not None and b_s.shape[2] > 1
    grid = (align.expert_ids.shape[0], triton.cdiv(n, launch.block_n))
    fused_moe_fp8_kernel[grid](
        a,
        a_s,
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
        a.stride(0),
        a_s.stride(0),
        b.stride(0),
        b.stride(1),
        b_s.stride(0),
        b_s.stride(1),
        c.stride(0),
        A_ROWS_PER_PAIR=a_rows_per_pair,
        GATED=gated,
        MUL_ROUTED_WEIGHT=not gated,
        GROUPED=grouped,
        BLOCK_M=BLOCK_M,
        BLOCK_N=launch.block_n,
        BLOCK_K=group_k if group_k is not None else launch.block_k,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )


def fused_experts_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    group_k: Optional[int],
    quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]] = quantize_fp8_triton,
    sum_pairs: bool = True,
) -> torch.Tensor:
    """x [num_tokens, H] -> [num_tokens, H] in x's dtype (see the module docstring); with
    `sum_pairs=False` the weighted per-pair outputs [num_tokens, top_k, H], for the caller to sum.
    `quantize(rows, group_k)` makes the e4m3 activations (the CPU tests give the torch reference:
    Triton's interpreter rounds some values to the wrong binade when it casts to e4m3)."""
    num_tokens, hidden, num_experts, inter, top_k = moe_dims(x, w13, w2, topk_ids)
    num_pairs = num_tokens * top_k
    align = moe_align_block_size(topk_ids, BLOCK_M, num_experts)
    weights = topk_weights.reshape(-1)
    qx, sx = quantize(x.contiguous(), group_k)
    activated = x.new_empty(num_pairs, inter)
    _launch(qx, sx, w13, w13_scale, activated, weights, align, num_pairs, top_k, True, group_k)
    qh, sh = quantize(activated, group_k)
    per_pair = x.new_empty(num_pairs, hidden)
    _launch(qh, sh, w2, w2_scale, per_pair, weights, align, num_pairs, 1, False, group_k)
    pairs = per_pair.view(num_tokens, top_k, hidden)
    return pairs.sum(dim=1) if sum_pairs else pairs

# Hot path (worker, twice per MoE layer): the experts' GEMMs over a routing.
# What may live here: the Triton kernel and its launch; launches depend only on shapes (and the
# device-side routing metadata), never on a value read back to the host: CUDA graphs record them.
"""The fused mixture-of-experts GEMMs: for a routing of `num_tokens` tokens to `top_k` experts each,

    out[t] = sum_j topk_weights[t, j] * W2[e_j] @ (silu(W1[e_j] @ x[t]) * (W3[e_j] @ x[t]))

with `w13` [E, 2 * I, H] (each expert's gate rows W1 then its up rows W3) and `w2` [E, H, I].

Two launches of one kernel over the expert-sorted layout of `moe_align_block_size`
(workers/kernels/moe/align.py), one program per (block of `block_m` (token, slot) pairs of one
expert, block of output columns):
1. gate_up: each program loads its pairs' token rows of `x` and the expert's gate and up columns,
   accumulates both products and writes silu(gate) * up: the activation is the GEMM's epilogue, so
   the [pairs, 2I] projection never reaches memory.
2. down: the activated rows times the expert's down projection, scaled by the pair's routing weight,
   written per pair; the top_k pairs of a token are summed after it (by the caller, with
   `sum_pairs=False`).

Pairs are the padded layout's rows: a padding row (`num_pairs`) is masked off, and a block past the
layout's used length (a device value) returns at once, so the grid is sized by the host bound.
The launch configs come from workers/kernels/moe/moe_configs.py. Importing this module needs no GPU;
on CPU it runs through Triton's interpreter (tests/test_fused_moe.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atomrt.workers.kernels.moe.align import MoEAlignment, moe_align_block_size
from atomrt.workers.kernels.moe.moe_configs import MoEConfig, pick_config


@triton.jit
def load_pair_block(pid_m, sorted_pair_ids_ptr, expert_ids_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """Row block `pid_m` of the expert-sorted layout: its pairs (int64), which of them are real (a
    padding row is not) and its expert."""
    offs_pair = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_pair).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    return pair, pair < num_pairs, expert


@triton.jit
def pair_tile(
    pid_m,
    pid_n,
    sorted_pair_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    N,
    A_ROWS_PER_PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """`load_pair_block`, with each pair's row of `a` (pair // A_ROWS_PER_PAIR) and the tile's
    output columns (int64) and their mask: the quantized kernels' prologue."""
    pair, pair_mask, expert = load_pair_block(
        pid_m, sorted_pair_ids_ptr, expert_ids_ptr, num_pairs, BLOCK_M
    )
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    return pair, pair_mask, expert, pair // A_ROWS_PER_PAIR, offs_n, offs_n < N


@triton.jit
def store_pair_block(
    acc,
    acc_up,
    pair,
    pair_mask,
    offs_n,
    n_mask,
    topk_weights_ptr,
    c_ptr,
    stride_cm,
    stride_cn,
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
):
    """The block's epilogue: GATED, silu(acc) * acc_up; MUL_ROUTED_WEIGHT, each pair's row times
    its routing weight; then the real pairs' rows into `c` at their pair's row."""
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair, mask=pair_mask, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


@triton.jit
def fused_moe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    num_blocks_m,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    A_ROWS_PER_PAIR: tl.constexpr,
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """c[pair, n] for the program's pairs and columns. The pair's row of `a` is
    `pair // A_ROWS_PER_PAIR` (top_k for the token rows of x, 1 for the per-pair rows of the
    activation). GATED: b holds 2N rows per expert (gate rows [0, N), up rows [N, 2N)) and the
    result is silu(a @ gate^T) * (a @ up^T). MUL_ROUTED_WEIGHT scales each pair's row by its
    routing weight."""
    pid = tl.program_id(0)
    num_blocks_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row blocks walk one column block before moving on (weights stay in L2)
    per_group = GROUP_M * num_blocks_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        return
    pair, pair_mask, expert = load_pair_block(
        pid_m, sorted_pair_ids_ptr, expert_ids_ptr, num_pairs, BLOCK_M
    )

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // A_ROWS_PER_PAIR)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            b_up = tl.load(
                b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0
            )
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    store_pair_block(
        acc, acc_up, pair, pair_mask, offs_n, n_mask, topk_weights_ptr, c_ptr, stride_cm,
        stride_cn, GATED, MUL_ROUTED_WEIGHT,
    )  # fmt: skip


def launch_expert_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    align: MoEAlignment,
    num_pairs: int,
    a_rows_per_pair: int,
    gated: bool,
    config: MoEConfig,
) -> None:
    """One of the fused MoE's two GEMMs over the aligned (token, expert) pairs: `a` [rows, k] x the
    experts' `b` [E, n (x2 when `gated`), k] into `c`, at `config`'s tiles."""
    n = b.shape[1] // 2 if gated else b.shape[1]
    k = b.shape[2]
    num_blocks_m = align.expert_ids.shape[0]
    grid = (num_blocks_m * triton.cdiv(n, config.block_n),)
    fused_moe_kernel[grid](
        a,
        b,
        c,
        topk_weights,
        align.sorted_pair_ids,
        align.expert_ids,
        align.num_padded_pairs,
        n,
        k,
        num_pairs,
        num_blocks_m,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        A_ROWS_PER_PAIR=a_rows_per_pair,
        GATED=gated,
        MUL_ROUTED_WEIGHT=not gated,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        # float32 weights are asked for exactness (tests, references): no tf32 rounding
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def moe_dims(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """(num_tokens, hidden, num_experts, intermediate, top_k) of x [num_tokens, H], w13 [E, 2I, H],
    w2 [E, H, I] and topk_ids [num_tokens, top_k], which must fit each other."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    assert w13.shape[2] == hidden and tuple(w2.shape) == (num_experts, hidden, inter), (
        f"fused_experts: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}"
    )
    return num_tokens, hidden, num_experts, inter, topk_ids.shape[1]


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_config: Optional[MoEConfig] = None,
    down_config: Optional[MoEConfig] = None,
    sum_pairs: bool = True,
) -> torch.Tensor:
    """x [num_tokens, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [num_tokens, top_k] (float),
    topk_ids [num_tokens, top_k] (int) -> [num_tokens, H] in x's dtype; with `sum_pairs=False`
    the weighted per-pair outputs [num_tokens, top_k, H] instead, left for the caller to sum
    (traced, the sum of top_k rows fuses into whatever follows).

    Configs default to the table's (moe_configs.pick_config); both GEMMs share one alignment, so
    they must have the same block_m."""
    num_tokens, hidden, num_experts, inter, top_k = moe_dims(x, w13, w2, topk_ids)
    gate_up_config = gate_up_config or pick_config(
        "gate_up", num_tokens, num_experts, top_k, inter, hidden
    )
    down_config = down_config or pick_config("down", num_tokens, num_experts, top_k, hidden, inter)
    if down_config.block_m != gate_up_config.block_m:
        down_config = MoEConfig(
            gate_up_config.block_m,
            down_config.block_n,
            down_config.block_k,
            down_config.group_m,
            down_config.num_warps,
            down_config.num_stages,
        )
    num_pairs = num_tokens * top_k
    align = moe_align_block_size(topk_ids, gate_up_config.block_m, num_experts)
    weights = topk_weights.reshape(-1)
    activated = x.new_empty(num_pairs, inter)  # [pairs, I]: silu(gate) * up per pair
    launch_expert_gemm(x, w13, activated, weights, align, num_pairs, top_k, True, gate_up_config)
    per_pair = x.new_empty(num_pairs, hidden)  # [pairs, H]: weighted expert outputs
    launch_expert_gemm(activated, w2, per_pair, weights, align, num_pairs, 1, False, down_config)
    pairs = per_pair.view(num_tokens, top_k, hidden)
    return pairs.sum(dim=1) if sum_pairs else pairs

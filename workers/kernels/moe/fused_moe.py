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
With `ROUTE_IN_KERNEL_MAX_CELLS` > 0 a routing small enough (a decode step's) has no layout
launch: each program derives its block's expert and pairs from `topk_ids` itself, the layout's
arithmetic (`in_kernel_routing`), so the two GEMMs are the layer's only launches after routing.
The launch configs come from workers/kernels/moe/moe_configs.py. Importing this module needs no GPU;
on CPU it runs through Triton's interpreter (tests/test_fused_moe.py).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import triton
import triton.language as tl

from atomrt.workers.kernels.moe.align import MoEAlignment, max_padded_pairs, moe_align_block_size
from atomrt.workers.kernels.moe.moe_configs import MoEConfig, pick_config

# routings of at most this many (experts x pairs) cells, both padded to powers of two, are laid
# out by each GEMM program from topk_ids (in_kernel_routing) rather than by the alignment's launch;
# 0: never. DeepSeek-V2-Lite, level 3, FULL+async on one H100 (330cecb, one warm machine): bs 1
# 3.078 ms against 3.159 with the launch; bs 32 (16384 cells) takes the launch, 12.021 both
ROUTE_IN_KERNEL_MAX_CELLS = 4096


class InKernelRouting(NamedTuple):
    """A routing the GEMM programs lay out themselves: its ids and the host bound of row blocks."""

    topk_ids: torch.Tensor  # [num_tokens, top_k], contiguous
    num_blocks_m: int
    num_experts: int


def in_kernel_routing(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> Union[MoEAlignment, InKernelRouting]:
    """The layout the GEMMs read: `InKernelRouting` where the routing fits
    ROUTE_IN_KERNEL_MAX_CELLS, else `moe_align_block_size`'s."""
    num_pairs = topk_ids.numel()
    cells = triton.next_power_of_2(max(num_pairs, 1)) * triton.next_power_of_2(num_experts)
    if 0 < num_pairs and cells <= ROUTE_IN_KERNEL_MAX_CELLS:
        blocks = max_padded_pairs(num_pairs, num_experts, block_m) // block_m
        return InKernelRouting(topk_ids.contiguous(), blocks, num_experts)
    return moe_align_block_size(topk_ids, block_m, num_experts)


@triton.jit
def load_pair_block(pid_m, sorted_pair_ids_ptr, expert_ids_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """Row block `pid_m` of the expert-sorted layout: its pairs (int64), which of them are real (a
    padding row is not) and its expert."""
    offs_pair = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_pair).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    return pair, pair < num_pairs, expert


@triton.jit
def routed_pair_block(
    pid_m, topk_ids_ptr, num_pairs, num_experts, BLOCK_M: tl.constexpr, PAIRS_P: tl.constexpr,
    EXPERTS_P: tl.constexpr,
):  # fmt: skip
    """`load_pair_block`'s answer from the routing itself, with the layout's used length: the
    experts' runs of pairs, each padded to BLOCK_M, in expert order (workers/kernels/moe/align.py),
    pairs of one expert in their order; row block `pid_m` is the run of the expert whose padded
    run holds its first row."""
    pairs = tl.arange(0, PAIRS_P)
    ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    experts = tl.arange(0, EXPERTS_P)
    counts = tl.sum((ids[None, :] == experts[:, None]).to(tl.int32), axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    row0 = pid_m * BLOCK_M
    ended = (padded_end <= row0) & (experts < num_experts)
    expert = tl.minimum(tl.sum(ended.to(tl.int32), 0), num_experts - 1)
    start = tl.sum(tl.where(experts == expert, padded_end - padded, 0), 0)
    mine = ids == expert
    rank = tl.cumsum(mine.to(tl.int32), 0) - 1  # each pair's place among its expert's
    want = row0 - start + tl.arange(0, BLOCK_M)  # the place each row of the block holds
    hit = mine[None, :] & (rank[None, :] == want[:, None])  # [BLOCK_M, PAIRS_P]
    real = tl.sum(hit.to(tl.int32), axis=1) > 0
    pair = tl.where(real, tl.sum(tl.where(hit, pairs[None, :], 0), axis=1), num_pairs)
    return pair.to(tl.int64), real, expert.to(tl.int64), tl.sum(padded, 0)


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
    num_experts,  # ROUTE_IN_KERNEL only
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
    ROUTE_IN_KERNEL: tl.constexpr,  # sorted_pair_ids_ptr is topk_ids (InKernelRouting)
    PAIRS_P: tl.constexpr,
    EXPERTS_P: tl.constexpr,
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

    if ROUTE_IN_KERNEL:
        pair, pair_mask, expert, num_padded = routed_pair_block(
            pid_m, sorted_pair_ids_ptr, num_pairs, num_experts, BLOCK_M, PAIRS_P, EXPERTS_P
        )
        if pid_m * BLOCK_M >= num_padded:
            return
    else:
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
    align: Union[MoEAlignment, InKernelRouting],
    num_pairs: int,
    a_rows_per_pair: int,
    gated: bool,
    config: MoEConfig,
) -> None:
    """One of the fused MoE's two GEMMs over the aligned (token, expert) pairs: `a` [rows, k] x the
    experts' `b` [E, n (x2 when `gated`), k] into `c`, at `config`'s tiles (`align`: the layout's
    tensors, or the routing its programs lay out themselves)."""
    n = b.shape[1] // 2 if gated else b.shape[1]
    k = b.shape[2]
    in_kernel = isinstance(align, InKernelRouting)
    if in_kernel:
        num_blocks_m, num_experts = align.num_blocks_m, align.num_experts
        layout = (align.topk_ids,) * 3
    else:
        num_blocks_m, num_experts = align.expert_ids.shape[0], b.shape[0]
        layout = (align.sorted_pair_ids, align.expert_ids, align.num_padded_pairs)
    grid = (num_blocks_m * triton.cdiv(n, config.block_n),)
    fused_moe_kernel[grid](
        a,
        b,
        c,
        topk_weights,
        *layout,
        n,
        k,
        num_pairs,
        num_blocks_m,
        num_experts,
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
        ROUTE_IN_KERNEL=in_kernel,
        PAIRS_P=triton.next_power_of_2(num_pairs) if in_kernel else 1,
        EXPERTS_P=triton.next_power_of_2(num_experts) if in_kernel else 1,
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
    align = in_kernel_routing(topk_ids, gate_up_config.block_m, num_experts)
    weights = topk_weights.reshape(-1)
    activated = x.new_empty(num_pairs, inter)  # [pairs, I]: silu(gate) * up per pair
    launch_expert_gemm(x, w13, activated, weights, align, num_pairs, top_k, True, gate_up_config)
    per_pair = x.new_empty(num_pairs, hidden)  # [pairs, H]: weighted expert outputs
    launch_expert_gemm(activated, w2, per_pair, weights, align, num_pairs, 1, False, down_config)
    pairs = per_pair.view(num_tokens, top_k, hidden)
    return pairs.sum(dim=1) if sum_pairs else pairs

# Hot path (worker, once per MoE layer): the routing metadata of the fused expert GEMMs.
# What may live here: device-side index arithmetic with no host synchronisation, every tensor sized
# by a bound the host computes from shapes alone, so a CUDA graph can record it.
"""`moe_align_block_size`: the (token, slot) pairs of a routing grouped by expert, each expert's
group padded to a multiple of the GEMM's block of rows.

A routing is `topk_ids` [num_tokens, top_k]: pair `p = token * top_k + slot` goes to expert
`topk_ids.flatten()[p]`. The fused kernel runs one program per block of `block_m` pairs of one
expert, so the pairs are laid out expert by expert, each expert's run padded up to a multiple of
`block_m` with the sentinel `num_pairs` (a row the kernel masks off). An expert with no pair takes
no block. The layout's length depends on the routing; its bound does not:
`num_pairs + min(num_experts, num_pairs) * (block_m - 1)`, rounded up to `block_m` (`max_padded_pairs`).

On CUDA a routing of few pairs (a decode step's) is laid out by one Triton program in one launch
(`moe_align_one_program`); a dozen torch kernels (scatter, scans, a sort, a search) would each cost
more than the whole layout. Larger routings, and every routing off CUDA, take the torch path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# one program holds a (experts x pairs) one-hot of the routing: at most this many int32
ONE_PROGRAM_MAX_CELLS = 16384


class MoEAlignment(NamedTuple):
    sorted_pair_ids: torch.Tensor  # int32 [max_padded]: pair ids by expert, `num_pairs` = padding
    expert_ids: torch.Tensor  # int32 [max_padded // block_m]: each block's expert
    num_padded_pairs: torch.Tensor  # int32 [1]: the used length of sorted_pair_ids (device)


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The host-side bound on the padded layout's length (a multiple of `block_m`)."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> MoEAlignment:
    """Group a routing's pairs by expert, padded per expert to `block_m` (see the module docstring).

    Pairs of one expert keep their order (a stable sort), so the layout is deterministic."""
    if topk_ids.is_cuda and fits_one_program(topk_ids.numel(), num_experts):
        return moe_align_one_program(topk_ids, block_m, num_experts)
    return moe_align_torch(topk_ids, block_m, num_experts)


def fits_one_program(num_pairs: int, num_experts: int) -> bool:
    """Whether `moe_align_one_program` takes a routing of this size."""
    cells = triton.next_power_of_2(max(num_pairs, 1)) * triton.next_power_of_2(num_experts)
    return 0 < num_pairs and cells <= ONE_PROGRAM_MAX_CELLS


@triton.jit
def moe_align_kernel(
    topk_ids_ptr,  # [num_pairs] (the flattened routing), any integer type
    sorted_pair_ids_ptr,  # [size] int32
    expert_ids_ptr,  # [num_blocks] int32
    num_padded_ptr,  # [1] int32
    num_pairs,
    num_experts,
    size,  # the host bound: max_padded_pairs
    BLOCK_M: tl.constexpr,
    PAIRS_P: tl.constexpr,
    EXPERTS_P: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The whole layout in one program: a one-hot [experts, pairs] of the routing gives each
    expert's count (its row sum), each pair's rank among its expert's pairs (a running sum along
    the row: the order stays stable) and so its slot; the padded runs' ends give each block's
    expert (how many runs end at or before the block's first row)."""
    pairs = tl.arange(0, PAIRS_P)
    pair_valid = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=pair_valid, other=-1).to(tl.int32)
    experts = tl.arange(0, EXPERTS_P)
    onehot = (ids[None, :] == experts[:, None]).to(tl.int32)  # [EXPERTS_P, PAIRS_P]
    counts = tl.sum(onehot, axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    rank = tl.cumsum(onehot, axis=1) - 1
    dest = tl.sum(onehot * ((padded_end - padded)[:, None] + rank), axis=0)  # [PAIRS_P]
    for start in range(0, size, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(
            sorted_pair_ids_ptr + offs, tl.zeros([CHUNK], tl.int32) + num_pairs, mask=offs < size
        )
    tl.debug_barrier()  # the padding is written before the pairs land over it
    tl.store(sorted_pair_ids_ptr + dest, pairs, mask=pair_valid)
    num_blocks = size // BLOCK_M
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        ended = (padded_end[None, :] <= blocks[:, None] * BLOCK_M) & (experts < num_experts)[
            None, :
        ]
        expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), num_experts - 1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < num_blocks)
    tl.store(num_padded_ptr, tl.sum(padded, 0))


def moe_align_one_program(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> MoEAlignment:
    """moe_align_block_size's layout from one Triton launch (a routing `fits_one_program`)."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.shape[0]
    if not fits_one_program(num_pairs, num_experts):
        raise ValueError(
            f"moe_align_one_program: {num_pairs} pairs over {num_experts} experts exceed one "
            f"program ({ONE_PROGRAM_MAX_CELLS} one-hot cells)"
        )
    size = max_padded_pairs(num_pairs, num_experts, block_m)
    device = flat.device
    sorted_pair_ids = torch.empty(size, dtype=torch.int32, device=device)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    pairs_p = triton.next_power_of_2(num_pairs)
    moe_align_kernel[(1,)](
        flat.contiguous(),
        sorted_pair_ids,
        expert_ids,
        num_padded,
        num_pairs,
        num_experts,
        size,
        BLOCK_M=block_m,
        PAIRS_P=pairs_p,
        EXPERTS_P=triton.next_power_of_2(num_experts),
        CHUNK=128,
        num_warps=4 if pairs_p * num_experts <= 4096 else 8,
    )
    return MoEAlignment(sorted_pair_ids, expert_ids, num_padded)


def moe_align_torch(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> MoEAlignment:
    """moe_align_block_size's layout from torch operations (any size, any device)."""
    flat = topk_ids.reshape(-1).to(torch.int64)  # [num_pairs]
    num_pairs = flat.shape[0]
    device = flat.device
    size = max_padded_pairs(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]; bincount would sync on its size
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [E]
    order = torch.sort(flat, stable=True).indices  # pair ids, expert by expert
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # [E]: where each expert starts in `order`
    rank_in_expert = torch.arange(num_pairs, device=device) - first_of_expert[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank_in_expert
    sorted_pair_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, size, block_m, device=device)
    # The expert whose padded run holds each block's first row; blocks past the end clamp to the
    # last expert (the kernel skips them: they start at or past num_padded_pairs).
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32)
    return MoEAlignment(sorted_pair_ids, expert_ids, num_padded)

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
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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

"""The mixture-of-experts layer: a router, top-k selection, and experts sharded over the ranks.

`FusedMoE(x)` for x [num_tokens, hidden] (this rank's rows, the same on every TP rank of its DP
rank):

1. DP > 1: gather every DP rank's rows (`dp_all_gather`; every rank runs the step's
   `running_tokens` rows, so the gather is rectangular): [dp_size * num_tokens, hidden].
2. Route: router logits (a replicated [num_experts, hidden] projection), softmax in float32, the
   top k experts per token, renormalized to sum to one when the model says so (`norm_topk_prob`;
   Mixtral always).
3. Experts: every expert's intermediate dimension is split over the ranks that hold the gathered
   rows, the TP group (DP = 1) or the whole DP x TP world (DP > 1); each rank computes its slice's
   weighted output of every (token, expert) pair (the opaque op `routed_expert_pairs`: the Triton
   kernel on CUDA, a torch loop over the experts elsewhere), then sums each token's top k pairs
   in traced code, where the compiler fuses that sum into the kernels after it.
4. Reduce: DP > 1 `dp_reduce_scatter` sums over DP ranks and hands each its own rows back; then
   `tp_all_reduce` sums over the TP group.

Weights: `w13_weight` [E, 2 * I_shard, hidden] (each expert's gate rows then its up rows) and
`w2_weight` [E, hidden, I_shard]; loaders read one expert (checkpoint `experts.<e>.gate_proj` /
`up_proj` / `down_proj`, or Mixtral's w1 / w3 / w2) or all experts at once (transformers' fused
`experts.gate_up_proj` [E, 2I, hidden] / `experts.down_proj` [E, hidden, I]), only this rank's slice.
"""

# No `from __future__ import annotations` here: the op's schema is inferred from real annotations.

from collections.abc import Generator
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from atomrt.compile.custom_register import direct_register_custom_op
from atomrt.distributed.communication_op import (
    DPInfo,
    TPInfo,
    dp_all_gather,
    dp_reduce_scatter,
    tp_all_reduce,
)
from atomrt.runtime.forward_context import get_forward_context
from atomrt.workers.kernels.moe.fused_moe import fused_experts
from atomrt.workers.layers import expert_tally
from atomrt.workers.layers.activation import silu_and_mul
from atomrt.workers.layers.linear import linear
from atomrt.workers.layers.quantization.fp8 import routed_pairs
from atomrt.workers.layers.quantization.fp8_ops import expert_pairs_fake, fp8_routed_experts
from atomrt.workers.layers.weight_utils import Sliceable, copy_checked, read_narrow

# shard ids of the expert weight loaders: one expert's projection, or every expert's at once
EXPERT_SHARDS = ("gate", "up", "down")
FUSED_SHARDS = ("gate_up_all", "down_all")


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, E] logits -> (weights [n, top_k] float32, ids [n, top_k] int64): softmax in float32,
    the top k, divided by their sum when `renormalize`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    sum_pairs: bool = True,
) -> torch.Tensor:
    """The torch path (CPU): one GEMM pair per expert over the tokens routed to it, each pair's
    weighted row written in place: [n, hidden] summed over the top_k pairs, or the pairs
    [n, top_k, hidden] with `sum_pairs=False` (as `fused_experts`)."""
    num_tokens, top_k = topk_ids.shape
    per_pair = x.new_zeros(num_tokens * top_k, x.shape[1])  # [pairs, hidden]
    weights = topk_weights.reshape(-1)
    for expert, pairs, tokens in routed_pairs(topk_ids, w13.shape[0]):
        h = silu_and_mul(F.linear(x[tokens], w13[expert]))  # [count, I]
        per_pair[pairs] = F.linear(h, w2[expert]) * weights[pairs, None].to(x.dtype)
    out = per_pair.view(num_tokens, top_k, x.shape[1])
    return out.sum(dim=1) if sum_pairs else out


def _routed_expert_pairs_impl(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """x [n, hidden] routed by (topk_weights, topk_ids) [n, top_k] -> this rank's partial expert
    output of every pair, weighted, [n, top_k, hidden]: the Triton kernel on CUDA, the torch loop
    elsewhere."""
    expert_tally.record(w13, topk_ids)  # a probe's count of the experts touched (eager steps)
    if x.is_cuda:
        return fused_experts(x, w13, w2, topk_weights, topk_ids, sum_pairs=False)
    return fused_experts_ref(x, w13, w2, topk_weights, topk_ids, sum_pairs=False)


# Opaque to Dynamo: the CPU loop has data-dependent shapes, and the kernel picks its launch per call.
# It returns the pairs, not their sum: traced, the sum of top_k rows is a small reduction Inductor
# folds into the pointwise and norm kernels after it, where inside the op it would be a launch.
direct_register_custom_op(
    "routed_expert_pairs", _routed_expert_pairs_impl, fake_impl=expert_pairs_fake
)


def routed_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """x [n, hidden] routed by (topk_weights, topk_ids) [n, top_k] -> this rank's partial expert
    output [n, hidden]: the opaque op's pairs, summed in traced code."""
    args = (x, topk_weights, topk_ids, w13, w2)
    if torch.compiler.is_compiling():
        pairs = torch.ops.atomrt.routed_expert_pairs(*args)
    else:
        pairs = _routed_expert_pairs_impl(*args)
    return pairs.sum(dim=1)


class Router(nn.Module):
    """The replicated routing projection: hidden -> one logit per expert."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def expert_shards(tp: TPInfo, dp: DPInfo) -> tuple[int, int]:
    """(this rank's shard, number of shards) of every expert's intermediate dimension: the TP group
    with DP = 1, the whole DP x TP world (rank = dp_rank * tp_size + tp_rank) with DP > 1."""
    return dp.dp_rank * tp.tp_size + tp.tp_rank, dp.dp_size * tp.tp_size


class FusedMoE(nn.Module):
    """Router + top-k + sharded experts (see the module docstring).

    `reduce_output=False` leaves the TP all-reduce to the caller (who adds a shared expert's
    partial sum first and reduces once)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        tp: TPInfo = TPInfo(),
        dp: DPInfo = DPInfo(),
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok: {top_k} must be in 1..num_experts={num_experts}"
            )
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp, self.dp, self.reduce_output = tp, dp, reduce_output
        self.shard, num_shards = expert_shards(tp, dp)
        if intermediate_size % num_shards:
            raise ValueError(
                f"moe_intermediate_size: {intermediate_size} is not divisible by data_parallel_size "
                f"x tensor_parallel_size = {num_shards} (every expert is split over those ranks)"
            )
        self.intermediate_size = intermediate_size  # whole, as in the checkpoint
        self.shard_size = inter = intermediate_size // num_shards
        self.gate = Router(hidden_size, num_experts)
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, inter), requires_grad=False
        )
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self.quant_method: Optional[object] = None  # FP8 experts (layers/quantization/fp8.py)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Sliceable, shard_id: object
    ) -> None:
        """shard_id: ("gate" | "up" | "down", expert) for one expert's [I, hidden] / [hidden, I]
        projection, or ("gate_up_all" | "down_all", None) for every expert's at once."""
        kind, expert = shard_id
        size, start = self.shard_size, self.shard * self.shard_size
        whole = self.intermediate_size
        if kind == "gate":
            src = read_narrow(loaded_weight, 0, start, size)
            copy_checked(param.data[expert, :size], src, f"expert {expert} gate_proj")
        elif kind == "up":
            src = read_narrow(loaded_weight, 0, start, size)
            copy_checked(param.data[expert, size:], src, f"expert {expert} up_proj")
        elif kind == "down":
            src = read_narrow(loaded_weight, 1, start, size)
            copy_checked(param.data[expert], src, f"expert {expert} down_proj")
        elif kind == "gate_up_all":  # [E, 2I, hidden]: gate rows [0, I), up rows [I, 2I)
            copy_checked(param.data[:, :size], read_narrow(loaded_weight, 1, start, size), "gate")
            up = read_narrow(loaded_weight, 1, whole + start, size)
            copy_checked(param.data[:, size:], up, "experts.gate_up_proj (up rows)")
        elif kind == "down_all":  # [E, hidden, I]
            copy_checked(
                param.data, read_narrow(loaded_weight, 2, start, size), "experts.down_proj"
            )
        else:
            raise ValueError(f"FusedMoE: unknown expert shard {shard_id!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden] (TP-reduced unless `reduce_output=False`)."""
        if self.dp.dp_size > 1:
            _check_dp_rows(x, self.dp)
            x = dp_all_gather(x, self.dp)  # [dp_size * num_tokens, hidden]
        y = self._experts(x)
        if self.dp.dp_size > 1:
            y = dp_reduce_scatter(y, self.dp)  # [num_tokens, hidden]
        return tp_all_reduce(y, self.tp) if self.reduce_output else y

    def forward_ubatch(self, x: torch.Tensor) -> Generator[None, None, torch.Tensor]:
        """`forward` as one microbatch of two-batch overlap (workers/runner/ubatch.py): a generator
        that pauses before and after each exchange with the other DP ranks, so the other microbatch
        computes while this one's rows travel. Returns what `forward` returns."""
        if self.dp.dp_size > 1:
            _check_dp_rows(x, self.dp)
            yield
            x = dp_all_gather(x, self.dp)  # [dp_size * num_tokens, hidden]
            yield
        y = self._experts(x)
        if self.dp.dp_size > 1:
            yield
            y = dp_reduce_scatter(y, self.dp)  # [num_tokens, hidden]
            yield
        return tp_all_reduce(y, self.tp) if self.reduce_output else y

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        return self.routed(x, weights, ids)

    def routed(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The experts for a computed routing (FP8 ones through their own op)."""
        if self.quant_method is not None:
            return fp8_routed_experts(x, topk_weights, topk_ids, self)
        return routed_experts(x, topk_weights, topk_ids, self.w13_weight, self.w2_weight)


def _check_dp_rows(x: torch.Tensor, dp: DPInfo) -> None:
    """Every DP rank must bring the step's padded row count, or the gather would not line up (and
    could wait forever on a peer): say so instead. Skipped while tracing (the shape is symbolic)."""
    if torch.compiler.is_compiling():
        return
    md = get_forward_context().dp_metadata
    expected: Optional[int] = md.max_tokens_across_dp if md is not None else None
    if expected is not None and x.shape[0] != expected:
        raise RuntimeError(
            f"dp rank {dp.dp_rank}: MoE layer got {x.shape[0]} rows, but every DP rank runs "
            f"{expected} this step (DPMetadata.max_tokens_across_dp)"
        )

"""DeepSeekMoE's routing: `GroupedTopkMoE` is `FusedMoE` (workers/layers/moe.py: the DP gather,
the experts sharded over the ranks, the reduce) with DeepSeek's router in front of the experts.

Routing, in float32 (`GroupedRouting.select`), for router logits [n, E] (a float32 projection):

1. scores: softmax over the experts (`scoring_func: softmax`) or a sigmoid each (`sigmoid`);
2. choice scores: the scores, plus `e_score_correction_bias` under `noaux_tc` (the bias steers
   which experts are picked, never how much they weigh);
3. groups (`group_limited_greedy` and `noaux_tc` with n_group > 1): the experts fall into
   `n_group` equal groups, each scored by its best choice score (`group_limited_greedy`) or the sum
   of its two best (`noaux_tc`); only the `topk_group` best groups stay eligible;
4. the top k eligible experts by choice score; their weights are their scores, divided by their sum
   when `norm_topk_prob`, times `routed_scaling_factor`.

`greedy` is steps 1 and 4 alone. On CUDA the whole routing is one launch
(workers/kernels/moe/routing.py, `grouped_topk`); elsewhere it is the torch code below.

`n_shared` > 0: the model folded its shared experts into the routed ones as experts E, E + 1, ...
(workers/models/deepseek.py, `FUSE_SHARED_EXPERTS`); every row then picks them too, after its top
k, at weight 1 (the shared experts' output is added unscaled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from atomrt.distributed.communication_op import DPInfo, TPInfo
from atomrt.workers.kernels.moe.router_gemv import router_logits
from atomrt.workers.kernels.moe.routing import (
    GROUP_SCORE_MAX,
    GROUP_SCORE_NONE,
    GROUP_SCORE_TOP2,
    grouped_topk,
)
from atomrt.workers.layers.moe import FusedMoE

# the router's float32 projection of a decode step's few tokens by one Triton launch
# (workers/kernels/moe/router_gemv.py) rather than F.linear (cuBLAS's split-K GEMV: two launches,
# after widening x); benchmarks/bench_router.py times both on the GPU. On one H100 (3483589): 2.44
# against 6.83 us at V2-Lite's router and 1 token, 4.34 against 10.95 at 8; V3's 5.22 against 9.34
# and 12.56 against 23.86; past ROUTER_GEMV_MAX_TOKENS F.linear. V2-Lite's bs=1 step: 26 launches
# of 54.7 us in all against cuBLAS's 52 of 97 us
ROUTER_KERNEL = True


@dataclass(frozen=True)
class GroupedRouting:
    """How DeepSeekMoE picks and weighs a token's experts (the model's config fields)."""

    num_experts: int
    top_k: int
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    scoring_func: str = "softmax"  # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = False  # norm_topk_prob
    routed_scaling_factor: float = 1.0
    n_shared: int = 0  # shared experts folded in as experts num_experts.. (module docstring)

    def select(
        self, router_logits: torch.Tensor, correction_bias: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, E] float32 logits -> (weights [n, top_k + n_shared] float32, ids [n, top_k +
        n_shared] int64)."""
        if router_logits.is_cuda:
            return self._select_fused(router_logits, correction_bias)
        weights, ids = self._select_torch(router_logits, correction_bias)
        if not self.n_shared:
            return weights, ids
        n = ids.shape[0]
        shared = torch.arange(self.num_experts, self.num_experts + self.n_shared).to(ids)
        return (
            torch.cat([weights, weights.new_ones(n, self.n_shared)], dim=1),
            torch.cat([ids, shared.expand(n, -1)], dim=1),
        )

    def _select_torch(
        self, router_logits: torch.Tensor, correction_bias: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scoring_func == "softmax":
            scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        else:
            scores = router_logits.float().sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias
        if self.topk_method != "greedy" and self.n_group > 1:
            choice = self._mask_groups(choice)
        ids = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def _select_fused(
        self, router_logits: torch.Tensor, correction_bias: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """select's routing in one Triton launch (the `grouped_topk` op while traced)."""
        if self.topk_method == "greedy" or self.n_group <= 1:
            group_score = GROUP_SCORE_NONE
        elif self.topk_method == "noaux_tc":
            group_score = GROUP_SCORE_TOP2
        else:
            group_score = GROUP_SCORE_MAX
        args = (
            router_logits, correction_bias, self.top_k, self.scoring_func != "softmax",
            self.n_group, self.topk_group, group_score, self.renormalize,
            float(self.routed_scaling_factor), self.n_shared,
        )  # fmt: skip
        if torch.compiler.is_compiling():
            return torch.ops.atomrt.grouped_topk(*args)
        return grouped_topk(*args)

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Choice scores [n, E] with every expert outside the token's `topk_group` best groups at
        -inf."""
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, self.n_group, num_experts // self.n_group)
        if self.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [n, n_group]
        else:
            group_scores = grouped.max(dim=-1).values
        kept = torch.topk(group_scores, self.topk_group, dim=-1).indices  # [n, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        return choice.masked_fill(~expert_mask, float("-inf"))


class GroupedRouter(nn.Module):
    """The replicated float32 router of DeepSeekMoE (and, under `noaux_tc`, its correction bias)."""

    def __init__(self, routing: GroupedRouting, hidden_size: int) -> None:
        super().__init__()
        self.routing = routing
        e = routing.num_experts
        self.weight = nn.Parameter(
            torch.empty(e, hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias: Optional[nn.Parameter] = None
        if routing.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(e, dtype=torch.float32), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (weights [n, top_k] float32, ids [n, top_k])."""
        if not ROUTER_KERNEL:
            logits = F.linear(x.float(), self.weight)  # [n, E] float32
        elif torch.compiler.is_compiling():
            logits = torch.ops.atomrt.router_logits(x, self.weight)
        else:
            logits = router_logits(x, self.weight)
        return self.routing.select(logits, self.e_score_correction_bias)


class GroupedTopkMoE(FusedMoE):
    """`FusedMoE` routed by DeepSeekMoE's router: the routing is traced with the model (plain
    tensor arithmetic), the experts are `routed_experts` (an opaque op's per-pair rows, summed in
    traced code)."""

    def __init__(
        self,
        routing: GroupedRouting,
        hidden_size: int,
        intermediate_size: int,
        tp: TPInfo = TPInfo(),
        dp: DPInfo = DPInfo(),
        reduce_output: bool = True,
    ) -> None:
        super().__init__(
            routing.num_experts,
            routing.top_k,
            hidden_size,
            intermediate_size,
            routing.renormalize,
            tp,
            dp,
            reduce_output=reduce_output,
        )
        self.gate = GroupedRouter(routing, hidden_size)

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.routed(x, weights, ids)

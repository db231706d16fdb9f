# Hot path (worker, once per DeepSeek-V4 MoE layer on CUDA): the float routed experts' GEMMs.
# What may live here: launches planned from shapes and the device-side routing alone (CUDA graphs
# record them), never a value read back to the host.
"""DeepSeek-V4's routed experts in 16-bit (or float32) weights over a routing, with the fused-MoE
kernel of workers/kernels/moe/fused_moe.py:

    out[t] = sum_j w[t, j] * W2[e_j] @ swiglu_limit(W13[e_j] @ x[t])

swiglu_limit(gate | up) = silu(min(gate, limit)) * clamp(up, -limit, limit), V4's clamped SwiGLU,
which the kernel's fused epilogue (silu(gate) * up) does not clamp: the first launch writes the
pairs' gate and up pre-activations [pairs, 2I] (the ungated GEMM, each pair's weight 1), torch
clamps and multiplies them in place (the gate's half of the rows [pairs, I], a strided view), the
second launch is the kernel's down GEMM weighted by the routing.
Each pair reads only its expert's weights: a decode step of 6 of 256 experts reads 6 experts, not
every expert on every row.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from atomrt.workers.kernels.moe.align import moe_align_block_size
from atomrt.workers.kernels.moe.fused_moe import launch_expert_gemm, moe_dims
from atomrt.workers.kernels.moe.moe_configs import pick_config


def v4_fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x [n, H], w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I], topk_weights / topk_ids
    [n, top_k] -> the weighted pairs [n, top_k, H] in x's dtype (the caller sums them)."""
    num_tokens, hidden, num_experts, inter, top_k = moe_dims(x, w13, w2, topk_ids)
    # the first GEMM is the ungated kernel over 2I columns: the down GEMM's kind of launch
    up_config = pick_config("down", num_tokens, num_experts, top_k, 2 * inter, hidden)
    down_config = pick_config("down", num_tokens, num_experts, top_k, hidden, inter)
    if down_config.block_m != up_config.block_m:  # both launches share one alignment
        down_config = dataclasses.replace(down_config, block_m=up_config.block_m)
    num_pairs = num_tokens * top_k
    align = moe_align_block_size(topk_ids, up_config.block_m, num_experts)
    ones = torch.ones(num_pairs, dtype=torch.float32, device=x.device)
    gate_up = x.new_empty(num_pairs, 2 * inter)  # [pairs, 2I]
    launch_expert_gemm(x, w13, gate_up, ones, align, num_pairs, top_k, False, up_config)
    # in place: a prefill's pairs (8192 rows x 6 at Flash's shape) would take 200 MB a temporary
    gate, up = gate_up.chunk(2, dim=-1)
    activated = F.silu(gate.clamp_(max=limit), inplace=True).mul_(up.clamp_(-limit, limit))
    per_pair = x.new_empty(num_pairs, hidden)  # [pairs, H]: weighted expert outputs
    weights = topk_weights.reshape(-1).float()
    launch_expert_gemm(activated, w2, per_pair, weights, align, num_pairs, 1, False, down_config)
    return per_pair.view(num_tokens, top_k, hidden)

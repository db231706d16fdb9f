"""The FP8 layers' custom ops, opaque to Dynamo (each picks its kernel per call, by device):
`torch.ops.atomrt.fp8_linear` and `torch.ops.atomrt.fp8_routed_experts`. `group_k` 0 stands for
the whole row (per-channel weights, per-token activations)."""

# No `from __future__ import annotations` here: the ops' schemas are inferred from real annotations.

from typing import Optional

import torch

from atomrt.compile.custom_register import direct_register_custom_op
from atomrt.workers.kernels.gemm.fp8_gemm import w8a8_fp8_linear
from atomrt.workers.kernels.moe.fused_moe_fp8 import fused_experts_fp8
from atomrt.workers.layers import expert_tally
from atomrt.workers.layers.quantization.fp8 import fp8_experts_ref, fp8_linear_ref


def _fp8_linear_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: Optional[torch.Tensor],
    group_k: int,
) -> torch.Tensor:
    """x [M, K] @ FP8 weight [N, K]^T -> [M, N] in x's dtype."""
    group = group_k or None
    if x.is_cuda:
        return w8a8_fp8_linear(x, weight, weight_scale, input_scale, group)
    return fp8_linear_ref(x, weight, weight_scale, input_scale, group)


def _fp8_linear_fake(
    x: torch.Tensor, weight: torch.Tensor, *scales_and_group: object
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _fp8_routed_experts_impl(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    group_k: int,
) -> torch.Tensor:
    """x [n, hidden] routed by (topk_weights, topk_ids) -> this rank's partial expert output."""
    expert_tally.record(w13, topk_ids)
    group = group_k or None
    if x.is_cuda:
        return fused_experts_fp8(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, group)
    return fp8_experts_ref(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, group)


def _fp8_routed_experts_fake(x: torch.Tensor, *routing_and_experts: object) -> torch.Tensor:
    return torch.empty_like(x)


direct_register_custom_op("fp8_linear", _fp8_linear_impl, fake_impl=_fp8_linear_fake)
direct_register_custom_op(
    "fp8_routed_experts", _fp8_routed_experts_impl, fake_impl=_fp8_routed_experts_fake
)


def fp8_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: Optional[torch.Tensor],
    group_k: Optional[int],
) -> torch.Tensor:
    """`fp8_linear` over any leading dims; one opaque op when traced."""
    rows = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        y = torch.ops.atomrt.fp8_linear(rows, weight, weight_scale, input_scale, group_k or 0)
    else:
        y = _fp8_linear_impl(rows, weight, weight_scale, input_scale, group_k or 0)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_routed_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    moe: torch.nn.Module,
) -> torch.Tensor:
    """A FusedMoE's FP8 experts for a computed routing."""
    args = (
        x,
        topk_weights,
        topk_ids,
        moe.w13_weight,
        moe.w2_weight,
        moe.w13_weight_scale,
        moe.w2_weight_scale,
        moe.fp8_group_k or 0,
    )
    if torch.compiler.is_compiling():
        return torch.ops.atomrt.fp8_routed_experts(*args)
    return _fp8_routed_experts_impl(*args)

"""The FP8 layers' custom ops, opaque to Dynamo (each picks its kernel per call, by device):
`torch.ops.atomrt.fp8_linear`, `torch.ops.atomrt.fp8_add_norm_linear` (a residual add and RMSNorm,
then the projection: ATOMRT_FP8_NORM_PROLOGUE) and `torch.ops.atomrt.fp8_routed_expert_pairs`
(each (token, expert) pair's weighted output; the caller sums a token's pairs).
`group_k` 0 stands for the whole row (per-channel weights, per-token activations)."""

# No `from __future__ import annotations` here: the ops' schemas are inferred from real annotations.

from typing import Optional

import torch

from atomrt.compile.custom_register import direct_register_custom_op
from atomrt.workers.kernels.gemm.fp8_gemm import w8a8_fp8_linear, w8a8_skinny_add_norm
from atomrt.workers.kernels.gemm.fp8_skinny_configs import SKINNY_M
from atomrt.workers.kernels.moe.fused_moe_fp8 import fused_experts_fp8
from atomrt.workers.kernels.rms_norm import add_rms_norm
from atomrt.workers.layers import expert_tally
from atomrt.workers.layers.norm import residual_add, rms_norm
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


def _fp8_add_norm_linear_impl(
    residual: torch.Tensor,
    update: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: Optional[torch.Tensor],
    group_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual, update [M, K] -> (h = residual + update, RMSNorm(h) @ FP8 weight [N, K]^T):
    decode rows of per-row scales in one launch on CUDA, else the add and norm first."""
    same_dtype = norm_weight.dtype == residual.dtype and update.dtype == residual.dtype
    if residual.is_cuda and same_dtype:
        if weight_scale.shape[1] == 1 and 0 < residual.shape[0] <= SKINNY_M:
            return w8a8_skinny_add_norm(
                residual, update, norm_weight, eps, weight, weight_scale, input_scale
            )
        h, normed = add_rms_norm(residual, update, norm_weight, eps)
    else:
        h = residual_add(residual, update)
        normed = rms_norm(h, norm_weight, eps)
    return h, _fp8_linear_impl(normed, weight, weight_scale, input_scale, group_k)


def _fp8_add_norm_linear_fake(
    residual: torch.Tensor,
    update: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    *scales_and_group: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(residual), residual.new_empty((residual.shape[0], weight.shape[0]))


def _fp8_routed_expert_pairs_impl(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    group_k: int,
) -> torch.Tensor:
    """x [n, hidden] routed by (topk_weights, topk_ids) [n, top_k] -> this rank's partial expert
    output of every pair, weighted, [n, top_k, hidden]."""
    expert_tally.record(w13, topk_ids)
    group = group_k or None
    args = (x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, group)
    if x.is_cuda:
        return fused_experts_fp8(*args, sum_pairs=False)
    return fp8_experts_ref(*args, sum_pairs=False)


def expert_pairs_fake(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *experts: object
) -> torch.Tensor:
    """The expert-pair ops' output (this one's and workers/layers/moe.py's): [n, top_k, hidden]."""
    return x.new_empty((x.shape[0], topk_ids.shape[1], x.shape[1]))


direct_register_custom_op("fp8_linear", _fp8_linear_impl, fake_impl=_fp8_linear_fake)
direct_register_custom_op(
    "fp8_add_norm_linear", _fp8_add_norm_linear_impl, fake_impl=_fp8_add_norm_linear_fake
)
# The pairs, not their sum: traced, the sum of top_k rows fuses into the kernels after it.
direct_register_custom_op(
    "fp8_routed_expert_pairs",
    _fp8_routed_expert_pairs_impl,
    fake_impl=expert_pairs_fake,
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


def fp8_add_norm_linear_op(
    residual: torch.Tensor,
    update: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: Optional[torch.Tensor],
    group_k: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_add_norm_linear` over any leading dims; one opaque op when traced."""
    k = residual.shape[-1]
    args = (
        residual.reshape(-1, k), update.reshape(-1, k), norm_weight, eps, weight, weight_scale,
        input_scale, group_k or 0,
    )  # fmt: skip
    if torch.compiler.is_compiling():
        h, y = torch.ops.atomrt.fp8_add_norm_linear(*args)
    else:
        h, y = _fp8_add_norm_linear_impl(*args)
    return h.reshape(residual.shape), y.reshape(*residual.shape[:-1], weight.shape[0])


def fp8_routed_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    moe: torch.nn.Module,
) -> torch.Tensor:
    """A FusedMoE's FP8 experts for a computed routing: [n, hidden], the opaque op's pairs summed
    in traced code."""
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
        pairs = torch.ops.atomrt.fp8_routed_expert_pairs(*args)
    else:
        pairs = _fp8_routed_expert_pairs_impl(*args)
    return pairs.sum(dim=1)

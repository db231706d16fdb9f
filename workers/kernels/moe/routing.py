# Hot path (worker, once per MoE layer on CUDA): DeepSeekMoE's routing of a step's tokens in one
# launch, from the router logits to the top-k weights and ids.
# No `from __future__ import annotations` here: the op's schema is inferred from real annotations.
"""`grouped_topk`: DeepSeekMoE's routing (workers/layers/deepseek_moe.py, `GroupedRouting.select`)
in one Triton launch of one program per token: the scores (softmax or sigmoid), the choice scores
(plus the correction bias), the group limit (each group scored by its best choice score or the sum
of its two best, the `topk_group` best groups kept), the top k by choice score, their scores as
weights, renormalized and scaled.

The torch path of the same routing is a dozen kernels at a decode step (a softmax, aten's top-k and
its sorts, a gather, the sums and scales), each costing more than the whole routing of a few
tokens. A program holds its token's experts as a [groups, experts per group] tile (one group when
the routing has none) and takes the top k by k rounds of a max: each round's pick is the lowest
index among the equal best, and the picks come out in descending choice score, as torch.topk's.

`torch.ops.atomrt.grouped_topk` wraps it for traced models: opaque to Dynamo, its fake gives the
output shapes.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from atomrt.compile.custom_register import direct_register_custom_op

GROUP_SCORE_NONE, GROUP_SCORE_MAX, GROUP_SCORE_TOP2 = 0, 1, 2
_BIG_INDEX = tl.constexpr(1 << 30)


@triton.jit
def grouped_topk_kernel(
    logits_ptr,  # [n, E] float32 (any float dtype: read as float32)
    bias_ptr,  # HAS_BIAS only: [E] float32, the correction bias
    weights_ptr,  # [n, TOP_K] float32
    ids_ptr,  # [n, TOP_K] int64
    num_experts,
    stride_l,
    scale,  # routed_scaling_factor
    N_GROUP: tl.constexpr,  # the routing's groups (1: no group limit)
    GROUP_P: tl.constexpr,  # N_GROUP padded to a power of two
    PER_GROUP_P: tl.constexpr,  # E / N_GROUP padded to a power of two
    TOPK_GROUP: tl.constexpr,
    GROUP_SCORE: tl.constexpr,  # 0: no group limit; 1: a group's best; 2: the sum of its two best
    TOP_K: tl.constexpr,
    TOP_K_P: tl.constexpr,
    SIGMOID: tl.constexpr,  # scores: a sigmoid each (else a softmax over the experts)
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    N_SHARED: tl.constexpr,  # shared experts appended to each row: ids E.., weight 1
    N_SHARED_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    per_group = num_experts // N_GROUP
    g = tl.arange(0, GROUP_P)[:, None]
    j = tl.arange(0, PER_GROUP_P)[None, :]
    valid = (g < N_GROUP) & (j < per_group)  # [GROUP_P, PER_GROUP_P]
    expert = tl.where(valid, g * per_group + j, _BIG_INDEX)
    x = tl.load(logits_ptr + token * stride_l + expert, mask=valid, other=0.0).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        x = tl.where(valid, x, float("-inf"))
        e = tl.exp(x - tl.max(tl.max(x, 1), 0))
        scores = e / tl.sum(tl.sum(e, 1), 0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    # A NaN choice ranks above every number, as in torch.topk: every pick is then an expert of
    # the row, whatever its logits (a NaN never equals the max, so it would pick none)
    choice = tl.where(valid, tl.where(choice != choice, float("inf"), choice), float("-inf"))

    if GROUP_SCORE != 0:
        best = tl.max(choice, 1)  # [GROUP_P]
        if GROUP_SCORE == 2:
            # the sum of a group's two best: its best, and the best of the rest (a tie counts twice)
            first = tl.min(tl.where(choice == best[:, None], j, PER_GROUP_P), 1)
            second = tl.max(tl.where(j == first[:, None], float("-inf"), choice), 1)
            group_score = best + second
        else:
            group_score = best
        gs = tl.arange(0, GROUP_P)
        group_score = tl.where(gs < N_GROUP, group_score, float("-inf"))
        kept = gs < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            open_group = (gs < N_GROUP) & ~kept
            avail = tl.where(open_group, group_score, float("-inf"))
            top = tl.max(avail, 0)
            pick = tl.min(tl.where(open_group & (avail == top), gs, GROUP_P), 0)
            kept = kept | (gs == pick)
        choice = tl.where(kept[:, None], choice, float("-inf"))

    ks = tl.arange(0, TOP_K_P)
    out_w = tl.zeros([TOP_K_P], dtype=tl.float32)
    out_id = tl.zeros([TOP_K_P], dtype=tl.int64)
    taken = expert < 0  # all False
    for i in tl.static_range(TOP_K):
        open_expert = valid & ~taken
        avail = tl.where(open_expert, choice, float("-inf"))
        top = tl.max(tl.max(avail, 1), 0)
        pick = tl.min(tl.min(tl.where(open_expert & (avail == top), expert, _BIG_INDEX), 1), 0)
        hit = expert == pick
        taken = taken | hit
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0)
        out_w = tl.where(ks == i, w, out_w)
        out_id = tl.where(ks == i, pick.to(tl.int64), out_id)
    if RENORMALIZE:
        out_w = out_w / (tl.sum(tl.where(ks < TOP_K, out_w, 0.0), 0) + 1e-20)
    mask = ks < TOP_K
    row = token * (TOP_K + N_SHARED)
    tl.store(weights_ptr + row + ks, out_w * scale, mask=mask)
    tl.store(ids_ptr + row + ks, out_id, mask=mask)
    if N_SHARED > 0:
        js = tl.arange(0, N_SHARED_P)
        tl.store(weights_ptr + row + TOP_K + js, tl.full([N_SHARED_P], 1.0, tl.float32),
                 mask=js < N_SHARED)  # fmt: skip
        tl.store(ids_ptr + row + TOP_K + js, (num_experts + js).to(tl.int64), mask=js < N_SHARED)


def grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: Optional[torch.Tensor],
    top_k: int,
    sigmoid: bool,
    n_group: int,
    topk_group: int,
    group_score: int,
    renormalize: bool,
    routed_scaling_factor: float,
    n_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, E] logits -> (weights [n, top_k + n_shared] float32, ids [n, top_k + n_shared] int64),
    as GroupedRouting.select computes them (`group_score`: GROUP_SCORE_NONE for no group limit,
    GROUP_SCORE_MAX or GROUP_SCORE_TOP2), in one launch; `n_shared` shared experts folded into
    the routed ones (workers/models/deepseek.py) follow each row's top k as ids E, E + 1, ..., of
    weight 1."""
    num_tokens, num_experts = router_logits.shape
    groups = n_group if group_score != GROUP_SCORE_NONE else 1
    if num_experts % groups or not 0 < top_k <= num_experts:
        raise ValueError(
            f"grouped_topk: {num_experts} experts do not split into n_group {groups} groups, or "
            f"top_k {top_k} is not in 1..{num_experts}"
        )
    if group_score != GROUP_SCORE_NONE and not 0 < topk_group <= groups:
        raise ValueError(f"grouped_topk: topk_group {topk_group} is not in 1..{groups}")
    width = top_k + n_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    bias = correction_bias.contiguous() if correction_bias is not None else logits
    grouped_topk_kernel[(num_tokens,)](
        logits, bias, weights, ids, num_experts, logits.stride(0), float(routed_scaling_factor),
        N_GROUP=groups,
        GROUP_P=triton.next_power_of_2(groups),
        PER_GROUP_P=triton.next_power_of_2(num_experts // groups),
        TOPK_GROUP=topk_group if group_score != GROUP_SCORE_NONE else 1,
        GROUP_SCORE=group_score,
        TOP_K=top_k,
        TOP_K_P=triton.next_power_of_2(top_k),
        SIGMOID=sigmoid,
        HAS_BIAS=correction_bias is not None,
        RENORMALIZE=renormalize,
        N_SHARED=n_shared,
        N_SHARED_P=triton.next_power_of_2(max(n_shared, 1)),
        num_warps=1 if num_experts <= 64 else 2,
    )  # fmt: skip
    return weights, ids


def _grouped_topk_fake(
    router_logits: torch.Tensor, correction_bias: Optional[torch.Tensor], top_k: int,
    sigmoid: bool, n_group: int, topk_group: int, group_score: int, renormalize: bool,
    routed_scaling_factor: float, n_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    n, width = router_logits.shape[0], top_k + n_shared
    return (
        router_logits.new_empty((n, width), dtype=torch.float32),
        router_logits.new_empty((n, width), dtype=torch.int64),
    )


# Opaque to Dynamo: Inductor would otherwise call aten's top-k (several kernels) around its own.
direct_register_custom_op("grouped_topk", grouped_topk, fake_impl=_grouped_topk_fake)

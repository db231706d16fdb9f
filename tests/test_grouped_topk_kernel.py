"""DeepSeekMoE's routing in one Triton launch (`grouped_topk`, what GroupedRouting.select runs on
CUDA) against transformers' routers on the same logits (DeepSeek-V2's greedy and group-limited
softmax routing, DeepSeek-V3's noaux_tc with a correction bias), and against the torch path of
GroupedRouting.select in float64 at the real models' shapes (V2-Lite's 64 experts, V2's 160 in 8
groups, V3's 256 in 8 groups); traced as the `grouped_topk` op, its fake's shapes; NaN logits
still pick experts of the row.

On CPU the kernel runs through Triton's interpreter; on a CUDA machine the same tests run on the
GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE

from atomrt.workers.kernels.moe.routing import (
    GROUP_SCORE_NONE,
    GROUP_SCORE_TOP2,
    grouped_topk,
)
from atomrt.workers.layers.deepseek_moe import GroupedRouting

TOKENS = 37  # not a power of two

# name: (routing, uses a correction bias)
REAL_SHAPES = {
    "V2-Lite": (GroupedRouting(64, 6, "greedy", "softmax", 1, 1, False, 1.0), False),
    "V2": (GroupedRouting(160, 6, "group_limited_greedy", "softmax", 8, 3, False, 16.0), False),
    "V3": (GroupedRouting(256, 8, "noaux_tc", "sigmoid", 8, 4, True, 2.5), True),
}


def _logits(num_experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(TOKENS, num_experts, generator=gen)).to(DEVICE)


def _reference(routing: GroupedRouting, logits: torch.Tensor, bias):
    """The routing from the formula (workers/layers/deepseek_moe.py's docstring), in float64."""
    x = logits.double().cpu()
    scores = x.softmax(-1) if routing.scoring_func == "softmax" else x.sigmoid()
    choice = scores if bias is None else scores + bias.double().cpu()
    if routing.topk_method != "greedy" and routing.n_group > 1:
        grouped = choice.view(x.shape[0], routing.n_group, -1)
        if routing.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(-1)
        kept = group_scores.topk(routing.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(x)
    ids = choice.topk(routing.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * routing.routed_scaling_factor, ids


@pytest.mark.parametrize("shape", sorted(REAL_SHAPES))
def test_fused_routing_equals_a_float64_reference(shape: str) -> None:
    """The same experts in the same order (descending choice score, as torch.topk gives them),
    the same weights to float32 rounding."""
    routing, with_bias = REAL_SHAPES[shape]
    logits = _logits(routing.num_experts, seed=1)
    bias = None
    if with_bias:
        gen = torch.Generator().manual_seed(2)
        bias = (0.3 * torch.randn(routing.num_experts, generator=gen)).to(DEVICE)
    weights, ids = routing._select_fused(logits, bias)
    ref_weights, ref_ids = _reference(routing, logits, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu().double(), ref_weights, rtol=2e-6, atol=1e-7)


def _hf_routers():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    common = dict(hidden_size=32, n_routed_experts=16, n_group=4, topk_group=2)
    v2 = {
        method: (
            DeepseekV2TopkRouter(
                transformers.DeepseekV2Config(
                    **common, num_experts_per_tok=3, topk_method=method, routed_scaling_factor=1.5
                )
            ),
            GroupedRouting(16, 3, method, "softmax", 4, 2, False, 1.5),
        )
        for method in ("greedy", "group_limited_greedy")
    }
    v3 = (
        DeepseekV3TopkRouter(
            transformers.DeepseekV3Config(
                **common, num_experts_per_tok=4, norm_topk_prob=True, routed_scaling_factor=2.5
            )
        ),
        GroupedRouting(16, 4, "noaux_tc", "sigmoid", 4, 2, True, 2.5),
    )
    return {"v2-greedy": v2["greedy"], "v2-group-limited": v2["group_limited_greedy"], "v3": v3}


@pytest.mark.parametrize("router", ["v2-greedy", "v2-group-limited", "v3"])
def test_fused_routing_equals_transformers(router: str) -> None:
    hf_router, routing = _hf_routers()[router]
    torch.manual_seed(0)
    bias = None
    with torch.no_grad():
        hf_router.weight.normal_()
        if router == "v3":  # large enough to change which experts win, and which groups
            bias = torch.linspace(-0.5, 0.5, 16)[torch.randperm(16)]
            hf_router.e_score_correction_bias.copy_(bias)
    x = torch.randn(TOKENS, 32)
    _, hf_weights, hf_ids = hf_router(x)
    logits = torch.nn.functional.linear(x, hf_router.weight).to(DEVICE)
    weights, ids = routing._select_fused(logits, None if bias is None else bias.to(DEVICE))
    weights, ids = weights.cpu(), ids.cpu()
    # the same experts, each with the same weight (transformers leaves them unsorted)
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(
        weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=0, atol=1e-6
    )


def test_equal_scores_pick_the_lowest_indices_first() -> None:
    """Ties go to the lowest expert index, and a group limit keeps the lowest groups on a tie."""
    logits = torch.zeros(2, 16, device=DEVICE)
    _, ids = grouped_topk(logits, None, 3, False, 1, 1, GROUP_SCORE_NONE, False, 1.0)
    assert ids.tolist() == [[0, 1, 2]] * 2
    _, ids = grouped_topk(logits, None, 5, True, 4, 2, GROUP_SCORE_TOP2, True, 1.0)
    assert ids.tolist() == [[0, 1, 2, 3, 4]] * 2  # groups 0 and 1 kept: experts 0-7


def test_traced_op_gives_the_eager_routing() -> None:
    """GroupedRouting traced by Dynamo calls the opaque op; its fake gives the right shapes and
    dtypes, and the compiled routing is the eager one's."""
    routing, _ = REAL_SHAPES["V2"]
    logits = _logits(routing.num_experts, seed=4)
    compiled = torch.compile(routing._select_fused, backend="aot_eager", fullgraph=True)
    weights, ids = compiled(logits, None)
    ref_weights, ref_ids = routing._select_fused(logits, None)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(weights, ref_weights)


def test_unsplittable_experts_name_n_group() -> None:
    with pytest.raises(ValueError, match="n_group 3"):
        grouped_topk(torch.zeros(1, 16), None, 2, False, 3, 1, GROUP_SCORE_TOP2, False, 1.0)
    with pytest.raises(ValueError, match="top_k 17"):
        grouped_topk(torch.zeros(1, 16), None, 17, False, 1, 1, GROUP_SCORE_NONE, False, 1.0)


@pytest.mark.parametrize("shape,n_shared", [("V2-Lite", 2), ("V3", 1), ("V2", 3)])
def test_folded_shared_experts_follow_each_top_k(shape: str, n_shared: int) -> None:
    """With shared experts folded into the routed ones (`n_shared`), each row's top k as without
    them, then ids E, E + 1, ... at weight 1, from the kernel as from the torch path (the traced
    op's fake of the same width)."""
    import dataclasses

    routing, with_bias = REAL_SHAPES[shape]
    folded = dataclasses.replace(routing, n_shared=n_shared)
    logits = _logits(routing.num_experts, seed=5)
    bias = torch.linspace(-0.2, 0.2, routing.num_experts).to(DEVICE) if with_bias else None
    weights, ids = routing._select_fused(logits, bias)
    shared = torch.arange(routing.num_experts, routing.num_experts + n_shared).expand(TOKENS, -1)
    cpu_bias = None if bias is None else bias.cpu()
    for got_w, got_ids in (
        folded._select_fused(logits, bias),
        folded.select(logits.cpu(), cpu_bias),
    ):
        assert got_ids.shape == (TOKENS, routing.top_k + n_shared)
        assert torch.equal(got_ids.cpu(), torch.cat([ids.cpu(), shared], dim=1))
        assert torch.equal(got_w.cpu()[:, routing.top_k :], torch.ones(TOKENS, n_shared))
        torch.testing.assert_close(got_w.cpu()[:, : routing.top_k], weights.cpu())
    traced = torch.compile(folded._select_fused, backend="aot_eager", fullgraph=True)
    assert torch.equal(traced(logits, bias)[1], folded._select_fused(logits, bias)[1])


@pytest.mark.parametrize("shape", sorted(REAL_SHAPES))
def test_nan_logits_still_pick_experts_of_the_row(shape: str) -> None:
    """Rows with NaN logits (a whole row; two experts of a row) pick k distinct experts of the
    row, a NaN choice first as torch.topk ranks it, and leave the other rows' routing as it was:
    an id past the experts would index out of bounds in the layout that follows."""
    routing, with_bias = REAL_SHAPES[shape]
    e = routing.num_experts
    logits = _logits(e, seed=11)
    bias = torch.linspace(-0.2, 0.2, e).to(DEVICE) if with_bias else None
    clean_w, clean_ids = routing._select_fused(logits, bias)
    poisoned = logits.clone()
    poisoned[3] = float("nan")
    poisoned[8, [5, e - 2]] = float("nan")
    weights, ids = routing._select_fused(poisoned, bias)
    ids = ids.cpu()
    assert bool(((ids >= 0) & (ids < e)).all())
    assert all(len(set(row)) == routing.top_k for row in ids.tolist())
    if routing.scoring_func == "sigmoid":  # a softmax spreads the NaN over the whole row
        assert {5, e - 2} <= set(ids[8].tolist())
    rest = [r for r in range(TOKENS) if r not in (3, 8)]
    assert torch.equal(ids[rest], clean_ids.cpu()[rest])
    torch.testing.assert_close(weights.cpu()[rest], clean_w.cpu()[rest])

"""DeepSeekMoE routing against transformers' routers on the same weights (float32, CPU):
DeepSeek-V2's greedy and group-limited greedy softmax routing, DeepSeek-V3's noaux_tc (sigmoid
scores, a correction bias that picks but does not weigh, groups scored by their two best experts),
and the routed experts of a GroupedTopkMoE against transformers' experts module."""

from __future__ import annotations

import pytest
import torch

from atomrt.workers.layers.deepseek_moe import GroupedRouting, GroupedTopkMoE

transformers = pytest.importorskip("transformers")

HIDDEN, EXPERTS, TOKENS = 32, 16, 64


def _v2_router(method: str):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(
        hidden_size=HIDDEN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=3,
        topk_method=method,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    )
    return DeepseekV2TopkRouter(cfg), GroupedRouting(
        EXPERTS, 3, method, "softmax", 4, 2, False, 1.5
    )


def _v3_router():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=HIDDEN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    return DeepseekV3TopkRouter(cfg), GroupedRouting(
        EXPERTS, 4, "noaux_tc", "sigmoid", 4, 2, True, 2.5
    )


def _check_same_routing(hf_router, routing: GroupedRouting, bias=None) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        hf_router.weight.normal_()
        if bias is not None:
            hf_router.e_score_correction_bias.copy_(bias)
    x = torch.randn(TOKENS, HIDDEN)
    _, hf_weights, hf_ids = hf_router(x)
    logits = torch.nn.functional.linear(x, hf_router.weight)
    weights, ids = routing.select(logits, bias)
    # the same experts, each with the same weight (transformers leaves them unsorted)
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(
        weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing_equals_transformers(method: str) -> None:
    _check_same_routing(*_v2_router(method))


def test_noaux_tc_routing_with_a_correction_bias_equals_transformers() -> None:
    hf_router, routing = _v3_router()
    # large enough to change which experts win, and which groups
    bias = torch.linspace(-0.5, 0.5, EXPERTS)[torch.randperm(EXPERTS)]
    _check_same_routing(hf_router, routing, bias)
    with torch.no_grad():
        hf_router.weight.normal_()
    x = torch.randn(TOKENS, HIDDEN)
    logits = torch.nn.functional.linear(x, hf_router.weight)
    _, with_bias = routing.select(logits, bias)
    _, without = routing.select(logits, None)
    assert not torch.equal(with_bias.sort().values, without.sort().values)


def test_group_limits_keep_every_pick_inside_the_best_groups() -> None:
    """A float64 check from the formula: with topk_group groups kept, no token routes outside
    them, and the kept groups are those of the largest best-two sums."""
    routing = GroupedRouting(EXPERTS, 4, "noaux_tc", "sigmoid", 4, 2, True, 1.0)
    logits = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(3))
    _, ids = routing.select(logits)
    scores = logits.double().sigmoid().view(TOKENS, 4, 4)
    best_groups = scores.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    assert ((ids // 4).unsqueeze(-1) == best_groups.unsqueeze(1)).any(-1).all()


def test_grouped_topk_moe_equals_transformers_experts() -> None:
    """The routed experts' sum (`routed_experts`: the pairs op, summed) on transformers' experts."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(
        hidden_size=HIDDEN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=24,
        n_shared_experts=1,
    )
    torch.manual_seed(1)
    hf = DeepseekV3MoE(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
        hf.gate.e_score_correction_bias.uniform_(-0.2, 0.2)
    _, routing = _v3_router()
    ours = GroupedTopkMoE(routing, HIDDEN, 24)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
    ours.weight_loader(ours.w13_weight, hf.experts.gate_up_proj.detach(), ("gate_up_all", None))
    ours.weight_loader(ours.w2_weight, hf.experts.down_proj.detach(), ("down_all", None))
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        _, weights, ids = hf.gate(x)
        expected = hf.experts(x, ids, weights)
        got = ours(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def _routed_expert_pairs_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and getattr(n.target, "overloadpacket", n.target) is torch.ops.atomrt.routed_expert_pairs
    ]


def test_compiled_deepseek_moe_block_sums_the_pairs_outside_the_op() -> None:
    """A DeepSeekMoE block (routed and shared experts) compiled by Inductor equals transformers';
    the graph it compiles holds the expert op's per-pair rows [n, top_k, hidden] and their sum as
    traced code, which Inductor may fuse with the shared expert's add."""
    from deepseek_harness import v3_moe_block
    from torch._inductor.compile_fx import compile_fx

    top_k = 4
    block, hf = v3_moe_block(HIDDEN, EXPERTS, top_k)

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        got = torch.compile(block, backend=backend, fullgraph=True, dynamic=False)(x)
        expected = hf(x)
        eager = block(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-5)
    (gm,) = graphs
    (op,) = _routed_expert_pairs_calls(gm)
    assert tuple(op.meta["example_value"].shape) == (TOKENS, top_k, HIDDEN)
    (user,) = op.users
    assert (user.op, user.target, user.kwargs) == ("call_method", "sum", {"dim": 1})

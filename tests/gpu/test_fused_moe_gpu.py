"""The fused-MoE kernel on CUDA at real shapes (bf16): against float64, recorded in a CUDA graph,
every swept launch config, and the float32 path of the layer (exact dots). Its decode speed
against the weight-read floor is benchmarks/sweep_moe.py's figure, not a test.

Run on the GPU machine:  tests/gpu/run_gpu_tier.sh tests/gpu/test_fused_moe_gpu.py
The CPU tier (tests/test_fused_moe.py) checks the same kernel through Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from atomrt.workers.kernels.moe.fused_moe import fused_experts
from atomrt.workers.kernels.moe.moe_configs import CONFIGS, heuristic_config, pick_config
from atomrt.workers.layers.moe import fused_experts_ref, select_experts

pytestmark = pytest.mark.gpu

# (name, experts, top_k, hidden, intermediate per rank)
SHAPES = [
    ("Qwen3-30B-A3B", 128, 8, 2048, 768),
    ("Qwen3-30B-A3B /2", 128, 8, 2048, 384),
    ("OLMoE-1B-7B /2", 64, 8, 2048, 512),
    ("Mixtral-like", 8, 2, 1024, 1400),  # an intermediate width that no block divides
]


def _weights(e: int, h: int, i: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) * i**-0.5).to(dtype)
    return w13, w2


def _routing(m: int, e: int, k: int, h: int, dtype=torch.bfloat16, seed: int = 1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, h, device="cuda", generator=g).to(dtype)
    logits = torch.randn(m, e, device="cuda", generator=g)
    weights, ids = select_experts(logits, k, renormalize=True)
    return x, weights, ids


def _float64(x, w13, w2, weights, ids) -> torch.Tensor:
    return fused_experts_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("name,e,k,h,i", SHAPES, ids=[s[0] for s in SHAPES])
def test_matches_float64(name: str, e: int, k: int, h: int, i: int, m: int) -> None:
    w13, w2 = _weights(e, h, i)
    x, weights, ids = _routing(m, e, k, h)
    expected = _float64(x, w13, w2, weights, ids)
    for config in {
        pick_config("gate_up", m, e, k, i, h),
        heuristic_config("gate_up", m, e, k, i, h),
    }:
        got = fused_experts(x, w13, w2, weights, ids, config, None)
        # bf16 inputs, the activation rounded to bf16 between the GEMMs, fp32 accumulation
        torch.testing.assert_close(got.double(), expected, rtol=3e-2, atol=3e-2, msg=f"{config}")


def test_every_table_config_matches_float64() -> None:
    if not CONFIGS:
        pytest.skip("the launch-config table is empty: benchmarks/sweep_moe.py fills it")
    for (gemm, e, n, kdim), table in sorted(CONFIGS.items()):
        h, i = (kdim, n) if gemm == "gate_up" else (n, kdim)
        w13, w2 = _weights(e, h, i)
        for bucket, config in sorted(table.items()):
            x, weights, ids = _routing(bucket, e, 8 if e >= 64 else 2, h)
            args = (config, None) if gemm == "gate_up" else (None, config)
            got = fused_experts(x, w13, w2, weights, ids, *args)
            expected = _float64(x, w13, w2, weights, ids)
            torch.testing.assert_close(got.double(), expected, rtol=3e-2, atol=3e-2)


def test_recorded_in_a_cuda_graph_follows_the_routing() -> None:
    """No host synchronisation: a graph recorded for one routing replays another correctly
    (different expert loads, experts without tokens) from the same static buffers."""
    e, k, h, i, m = 64, 8, 1024, 256, 32
    w13, w2 = _weights(e, h, i)
    x, weights, ids = _routing(m, e, k, h)
    fused_experts(x, w13, w2, weights, ids)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fused_experts(x, w13, w2, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (2, 3):
        x2, w2_, ids2 = _routing(m, e, k, h, seed=seed)
        if seed == 3:  # every token on experts 0..7: 56 experts get nothing
            ids2 = torch.arange(k, device="cuda").expand(m, k).contiguous()
        x.copy_(x2), weights.copy_(w2_), ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, fused_experts(x, w13, w2, weights, ids), rtol=0, atol=0)


def test_moe_layer_custom_op_on_cuda_matches_reference() -> None:
    """The layer's op takes the Triton path on CUDA: its per-pair rows agree with the torch
    reference path's."""
    from atomrt.workers.layers.moe import _routed_expert_pairs_impl

    e, k, h, i, m = 16, 4, 512, 192, 40
    w13, w2 = _weights(e, h, i, torch.float32)
    x, _, _ = _routing(m, e, k, h, torch.float32)
    weights, ids = select_experts(torch.randn(m, e, device="cuda"), k, True)
    got = _routed_expert_pairs_impl(x, weights, ids, w13, w2)
    expected = fused_experts_ref(x, w13, w2, weights, ids, sum_pairs=False)
    assert got.shape == (m, k, h)
    # float32 takes exact (ieee) dots: only the accumulation order differs
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,e,k", [(1, 64, 6), (32, 64, 6), (16, 128, 8), (2, 256, 8)])
def test_one_launch_alignment_equals_the_torch_one(m: int, e: int, k: int) -> None:
    """The one-program layout on CUDA, recorded in a graph and replayed on a new routing, is the
    torch path's."""
    from atomrt.workers.kernels.moe.align import moe_align_one_program, moe_align_torch

    ids = torch.zeros(m, k, dtype=torch.int64, device="cuda")
    moe_align_one_program(ids, 16, e)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = moe_align_one_program(ids, 16, e)
    for seed in range(3):
        ids.copy_(_routing(m, e, k, 64, seed=seed)[2])
        graph.replay()
        for got, want in zip(recorded, moe_align_torch(ids, 16, e)):
            assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("m", [3, 64])  # the one-launch layout, then the torch one (scatters)
def test_nan_router_logits_route_within_the_experts(m: int) -> None:
    """DeepSeek-V2-Lite's routing (64 experts, top 6) of rows whose router logits are NaN, as an
    uncomputed buffer can hold them (compile_ahead skips launches at start-up), then the fused
    experts: every id names an expert, and the layout's scatters raise no device-side assert."""
    from atomrt.workers.layers.deepseek_moe import GroupedRouting

    routing = GroupedRouting(64, 6, "greedy", "softmax", 1, 1, False, 1.0)
    w13, w2 = _weights(64, 2048, 1408)
    x, _, _ = _routing(m, 64, 6, 2048)
    logits = torch.randn(m, 64, device="cuda")
    logits[m // 2 :] = float("nan")
    weights, ids = routing.select(logits)
    assert bool(((ids >= 0) & (ids < 64)).all())
    fused_experts(x, w13, w2, weights, ids)
    torch.cuda.synchronize()

"""DeepSeekMoE's float32 router projection in one Triton launch (`router_gemv`, what GroupedRouter
runs for a decode step's few tokens: deepseek_moe.ROUTER_KERNEL, on by default) against a float64
reference, at small shapes with a partial last K step and at V2-Lite's and V3's router shapes;
with the option on, a DeepSeek-V3 MoE block routes as with it off and as transformers' does, eager
and compiled by Inductor (the kernel traced as the opaque `router_logits` op).

On CPU the kernel runs through Triton's interpreter; on a CUDA machine the same tests run on the
GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE

from atomrt.workers.kernels.moe import router_gemv as rg
from atomrt.workers.layers import deepseek_moe


def _inputs(n: int, experts: int, hidden: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    w = 0.05 * torch.randn(experts, hidden, generator=gen)
    return x.to(DEVICE), w.to(DEVICE)


def _check_against_float64(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Each logit within float32 summation error of the float64 product: a few float32 roundings
    of sum |x_k w_k| (a bound that holds near zero too, where a relative tolerance cannot)."""
    xd, wd = x.double().cpu(), w.double().cpu()
    ref = xd @ wd.T
    bound = 4e-6 * (xd.abs() @ wd.abs().T) + 1e-30
    assert got.dtype == torch.float32 and got.shape == ref.shape
    err = (got.double().cpu() - ref).abs()
    assert (err <= bound).all(), f"worst error / bound {(err / bound).max().item():.3g}"


@pytest.mark.parametrize("n", [1, 5, 16])
@pytest.mark.parametrize("experts", [8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_a_float64_reference(n: int, experts: int, dtype: torch.dtype) -> None:
    """K = 300, a multiple of no step: the default launch (one masked step), 128-wide steps over
    two experts a program (the last step partial; the products summed over K once, after the
    loop), 64-wide steps over four experts a program with 3 experts fewer (the last program
    partly past E)."""
    x, w = _inputs(n, experts, 300, dtype, seed=n * 100 + experts)
    _check_against_float64(rg.router_gemv(x, w), x, w)
    config = rg.RouterConfig(block_e=2, block_k=128, num_warps=2, sum_last=True)
    _check_against_float64(rg.router_gemv(x, w, config), x, w)
    odd = rg.RouterConfig(block_e=4, block_k=64)
    _check_against_float64(rg.router_gemv(x, w[:-3], odd), x, w[:-3])


@pytest.mark.parametrize(
    ("n", "experts", "hidden"), [(1, 64, 2048), (16, 64, 2048), (1, 256, 7168)]
)
def test_model_shapes_equal_a_float64_reference(n: int, experts: int, hidden: int) -> None:
    """V2-Lite's router (64 experts, hidden 2048: even K steps) and V3's (256, 7168: 4096-wide
    steps, the last partial), bfloat16 activations, at their default launches."""
    x, w = _inputs(n, experts, hidden, torch.bfloat16, seed=7 + n + experts)
    _check_against_float64(rg.router_gemv(x, w), x, w)


def test_strided_activations_and_large_batches() -> None:
    """A view of x with a row stride past K reads the right rows; past ROUTER_GEMV_MAX_TOKENS
    router_logits is F.linear's own result."""
    x, w = _inputs(6, 8, 96, torch.bfloat16, seed=3)
    wide = torch.zeros(6, 160, dtype=x.dtype, device=DEVICE)
    wide[:, 32:128] = x
    _check_against_float64(rg.router_gemv(wide[:, 32:128], w), x, w)
    big, w = _inputs(rg.ROUTER_GEMV_MAX_TOKENS + 1, 8, 96, torch.bfloat16, seed=4)
    assert torch.equal(rg.router_logits(big, w), torch.nn.functional.linear(big.float(), w))


def test_bad_shapes_and_dtypes_are_named() -> None:
    x, w = _inputs(2, 8, 64, torch.bfloat16, seed=5)
    with pytest.raises(ValueError, match="must be float32"):
        rg.router_gemv(x, w.bfloat16())
    with pytest.raises(ValueError, match=r"\[n, K\] and \[E, K\]"):
        rg.router_gemv(x, w[:, :32])
    assert rg.router_gemv(x[:0], w).shape == (0, 8)


HIDDEN, EXPERTS, TOP_K = 48, 16, 4


def _v3_block():
    """A DeepSeek-V3 MoE block (routed + shared experts) with transformers' weights, and
    transformers' module."""
    pytest.importorskip("transformers")
    from deepseek_harness import v3_moe_block

    return v3_moe_block(HIDDEN, EXPERTS, TOP_K)


def _same_routing(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]):
    """The same experts in the same order, with the same weights to float32 rounding."""
    assert torch.equal(a[1], b[1])
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-7)


def test_router_option_routes_a_deepseek_block_as_transformers(monkeypatch) -> None:
    """ROUTER_KERNEL on: the router of a V3 MoE block at 5 tokens picks the experts and weights it
    picks with the option off, eager and compiled by Inductor (where the traced graph calls the
    `router_logits` op, and F.linear's GEMM is gone); the block's output is transformers'."""
    from torch._inductor.compile_fx import compile_fx

    block, hf = _v3_block()
    block.to(DEVICE)
    hf.to(DEVICE)
    gate = block.experts.gate
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    with torch.no_grad():
        monkeypatch.setattr(deepseek_moe, "ROUTER_KERNEL", False)
        off = gate(x)
        _, hf_weights, hf_ids = hf.gate(x)
        monkeypatch.setattr(deepseek_moe, "ROUTER_KERNEL", True)
        on = gate(x)
        _same_routing(on, off)
        # transformers leaves its picks unsorted
        order, hf_order = on[1].argsort(-1), hf_ids.argsort(-1)
        assert torch.equal(on[1].gather(1, order), hf_ids.gather(1, hf_order))
        torch.testing.assert_close(
            on[0].gather(1, order), hf_weights.gather(1, hf_order), rtol=0, atol=1e-6
        )

        graphs: list[torch.fx.GraphModule] = []

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
            graphs.append(gm)
            return compile_fx(gm, example_inputs)

        torch._dynamo.reset()
        _same_routing(torch.compile(gate, backend=backend, fullgraph=True)(x), off)
        (gm,) = graphs
        targets = {getattr(n.target, "overloadpacket", n.target) for n in gm.graph.nodes}
        assert torch.ops.atomrt.router_logits in targets
        assert torch.nn.functional.linear not in targets
        torch._dynamo.reset()
        got = torch.compile(block, backend="inductor", fullgraph=True, dynamic=False)(x)
        torch.testing.assert_close(got, hf(x), rtol=0, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.skipif(
    DEVICE == "cuda",
    reason="a CPU engine's router runs the kernel only under Triton's interpreter, off on CUDA hosts",
)
def test_engine_with_the_router_kernel_gives_transformers_tokens(monkeypatch, tmp_path) -> None:
    """ROUTER_KERNEL on, a tiny DeepSeek-V3 (noaux_tc over 4 groups) through the engine at level 3
    (traced, split at the MLA op): every step's router runs the kernel (steps of at most 16
    tokens), and the greedy tokens are transformers' `generate`'s."""
    from deepseek_harness import build_deepseek_folder
    from model_harness import engine_greedy, hf_greedy

    from atomrt.runtime.config import CompilationConfig

    launches = []
    kernel = rg.router_gemv

    def counted(*args, **kwargs):
        launches.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(rg, "router_gemv", counted)
    monkeypatch.setattr(deepseek_moe, "ROUTER_KERNEL", True)
    folder = build_deepseek_folder(tmp_path / "v3", "v3")
    prompts = [[5, 9, 14, 2, 77, 31, 8, 150, 66, 4, 12, 90, 7, 3], [8, 6], [60, 61, 62, 63, 64]]
    expected = hf_greedy(folder, prompts, 6)
    cc = CompilationConfig(level=3, cache_dir=str(tmp_path / "cache"), use_inductor=False)
    got, _ = engine_greedy(
        folder,
        prompts,
        6,
        device="cpu",
        enforce_eager=False,
        compilation_config=cc,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    assert got == expected
    assert launches and max(launches) <= rg.ROUTER_GEMV_MAX_TOKENS

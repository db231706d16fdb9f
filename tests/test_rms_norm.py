"""The residual add + RMSNorm kernel (workers/kernels/rms_norm.py), on CUDA when present, else
through Triton's interpreter, and the layers' add_norm_linear op: on CPU it is eager's add, RMSNorm
and F.linear, bit for bit (traced too), and only weights the skinny GEMM can take go through the
fused op.

The interpreter rounds fp32 -> bf16 by truncation, so the kernels are checked in fp32 and fp16 here;
bf16 runs in tests/gpu/test_skinny_gemm_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE
from test_skinny_gemm import traced_ops

from atomrt.workers.kernels.rms_norm import add_rms_norm
from atomrt.workers.layers import linear as linear_mod
from atomrt.workers.layers.norm import rms_norm

TOLERANCES = {
    torch.float32: {"rtol": 1e-6, "atol": 1e-6},
    torch.float16: {"rtol": 2**-10, "atol": 2**-10},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,k", [(1, 576), (5, 100), (3, 2048), (2, 7)])
def test_add_rms_norm_kernel(m: int, k: int, dtype: torch.dtype) -> None:
    """h = x + update exactly as eager; the normalized rows against RMSNorm computed in float64 from h
    (one rounding of the normalized row, one of its product with the weight)."""
    gen = torch.Generator().manual_seed(m * k)
    x, update = (torch.randn(m, k, generator=gen).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
    h, out = add_rms_norm(x, update, weight, 1e-5)
    assert torch.equal(h, x + update)
    h64 = h.double().cpu()
    want = weight.double().cpu() * (h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(out.double().cpu(), want, **TOLERANCES[dtype])


def test_add_rms_norm_strided_rows_and_bad_arguments() -> None:
    base = torch.randn(4, 64, device=DEVICE)
    ones = torch.ones(32, device=DEVICE)
    x, update = base[:, :32], base[:, 32:]  # rows with a stride of 64
    h, out = add_rms_norm(x, update, ones, 1e-6)
    assert torch.equal(h, x + update)
    torch.testing.assert_close(out, rms_norm(x + update, ones, 1e-6))
    with pytest.raises(ValueError, match="want x and update"):
        add_rms_norm(x, update[:, :16], ones, 1e-6)
    with pytest.raises(ValueError, match="share a dtype"):
        add_rms_norm(x, update.half(), ones, 1e-6)


def eager_add_norm_linear(residual, update, norm_weight, eps, weight, bias):
    h = residual + update
    return h, torch.nn.functional.linear(rms_norm(h, norm_weight, eps), weight, bias)


def test_layer_add_norm_linear_is_eager_on_cpu() -> None:
    """Off CUDA the op is eager's arithmetic exactly, called and traced (3-D input, with a bias):
    CPU tensors, as the CPU path is what is tested."""
    gen = torch.Generator().manual_seed(0)
    residual, update = torch.randn(2, 3, 24, generator=gen), torch.randn(2, 3, 24, generator=gen)
    norm_weight, weight, bias = (
        torch.rand(24, generator=gen) + 0.5,
        torch.randn(10, 24, generator=gen),
        torch.randn(10),
    )
    args = (norm_weight, 1e-6, weight, bias)
    want_h, want_y = eager_add_norm_linear(residual, update, *args)
    for fn in (
        linear_mod.add_norm_linear,
        torch.compile(linear_mod.add_norm_linear, backend="aot_eager", fullgraph=True),
    ):
        h, y = fn(residual, update, *args)
        assert torch.equal(h, want_h) and torch.equal(y, want_y)
        assert y.shape == (2, 3, 10)


def test_large_weight_leaves_the_add_and_norm_to_inductor() -> None:
    """Where the layer's policy lets the skinny GEMM take the weight (at bs=1 at least) the traced
    graph holds the one fused op; where it takes it at no batch size, the add and the norm are traced
    as plain ops beside the linear op, where Inductor fuses them into one kernel."""
    from atomrt.workers.kernels.gemm.skinny_gemm import SkinnyPolicy
    from atomrt.workers.layers.linear import ColumnParallelLinear
    from atomrt.workers.layers.norm import RMSNorm

    policy = SkinnyPolicy(
        max_weight_elems=1 << 8, m1_max_weight_elems=1 << 12
    )  # small weights tell the rule

    def ops_traced(n: int, k: int) -> set[str]:
        layer = ColumnParallelLinear(k, n, skinny=policy)
        layer.weight.data.normal_()
        norm = RMSNorm(k, 1e-6)
        residual, update = torch.randn(2, k), torch.randn(2, k)
        got, seen = traced_ops(lambda r, u: layer.forward_add_norm(r, u, norm), residual, update)
        for g, w in zip(
            got, eager_add_norm_linear(residual, update, norm.weight, 1e-6, layer.weight, None)
        ):
            torch.testing.assert_close(g, w)
        return seen

    small = ops_traced(8, 16)
    assert any("add_norm_linear" in op for op in small)
    single_row_only = ops_traced(8, 256)  # only a one-row batch takes it: still the fused op
    assert any("add_norm_linear" in op for op in single_row_only)
    big = ops_traced(4, 1 << 10)
    assert not any("add_norm_linear" in op for op in big)
    assert any("atomrt.linear" in op for op in big) and any("rsqrt" in op for op in big)

"""The CPU GEMM on a reordered weight: F.linear's results, batch-invariant rows, a fresh copy
after the weight changes."""

import pytest
import torch
import torch.nn.functional as F

from atomrt.workers.layers import cpu_gemm
from atomrt.workers.layers.cpu_gemm import CPUPackedWeight, packed_linear, reset_packed_weights
from atomrt.workers.layers.linear import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.skipif(not cpu_gemm._HAS_ONEDNN, reason="torch has no oneDNN")


def test_packed_linear_is_f_linear_and_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(40, 64, generator=gen)
    packed = CPUPackedWeight(min_weight_elems=0).get(weight, x)
    assert packed is not None
    for rows in (1, 3, 16, 40):
        y = packed_linear(x[:rows], packed, bias)
        torch.testing.assert_close(y, F.linear(x[:rows], weight, bias), rtol=1e-5, atol=1e-5)
        assert torch.equal(y[0], packed_linear(x[:1], packed, bias)[0])
    assert packed_linear(x.view(4, 10, 64), packed, None).shape == (4, 10, 96)


def test_only_eager_float32_cpu_forwards_of_large_weights_take_it() -> None:
    assert CPUPackedWeight().get(torch.randn(8, 4), torch.randn(2, 4)) is None  # small: F.linear
    assert CPUPackedWeight().get(torch.randn(1024, 256), torch.randn(2, 256)) is not None
    cache, weight = CPUPackedWeight(min_weight_elems=0), torch.randn(8, 4)
    assert cache.get(weight, torch.randn(2, 4, dtype=torch.bfloat16)) is None
    assert cache.get(weight.to(torch.bfloat16), torch.randn(2, 4)) is None
    assert cache.get(weight, torch.randn(2, 4)) is not None


def test_a_changed_weight_is_packed_again() -> None:
    layer = ColumnParallelLinear(16, 8, bias=True)
    layer.cpu_packed = CPUPackedWeight(min_weight_elems=0)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(3, 16)
    torch.testing.assert_close(
        layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
    )
    with torch.no_grad():
        layer.weight.mul_(2)  # bumps the version
    torch.testing.assert_close(
        layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
    )
    layer.weight.data.copy_(torch.randn(8, 16))  # as loading writes: no version bump
    reset_packed_weights(layer)
    torch.testing.assert_close(
        layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
    )


def test_gated_row_parallel_layer() -> None:
    layer = RowParallelLinear(16, 8)
    layer.cpu_packed = CPUPackedWeight(min_weight_elems=0)
    layer.weight.data.normal_()
    x = torch.randn(5, 32)
    want = F.linear(F.silu(x[:, :16]) * x[:, 16:], layer.weight)
    torch.testing.assert_close(layer(x, gated_input=True), want, rtol=1e-5, atol=1e-5)

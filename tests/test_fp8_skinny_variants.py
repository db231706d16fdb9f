"""The fused FP8 decode GEMM's launch variants (`SkinnyOptions`: split K, persistent programs,
wide passes over x, a preloaded first weight step, load hints) against the float64 product of the
quantization kernel's own e4m3 values, through the interpreter on CPU: a variant changes how the
work is cut, never the result."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from kernel_device import DEVICE

from atomrt.workers.kernels.gemm.fp8_gemm import quantize_fp8_triton
from atomrt.workers.kernels.gemm.fp8_skinny import w8a8_skinny, w8a8_skinny_add_norm
from atomrt.workers.kernels.gemm.fp8_skinny_configs import SkinnyOptions, skinny_options
from atomrt.workers.layers.norm import rms_norm
from atomrt.workers.layers.quantization.fp8 import (
    dequantize_fp8,
    quantize_fp8,
    quantize_weight_per_row,
)

N, K = 200, 1000  # a partial last column block and K step
LAUNCH = (256, 4096, 4, 2)  # 4 K steps of 256; 16 columns per program at M=1
VARIANTS = {
    "split2": SkinnyOptions(split_k=2),
    "split3": SkinnyOptions(split_k=3),  # splits of 512: the third has no K left
    "split8": SkinnyOptions(split_k=8),  # more splits than K steps
    "persistent": SkinnyOptions(persistent=1),  # a few programs, many tiles each
    "persistent-split": SkinnyOptions(persistent=2, split_k=2),
    "x_block-wide": SkinnyOptions(x_block=4096),  # the whole row in one step
    "x_block-narrow": SkinnyOptions(x_block=64),
    "preload": SkinnyOptions(preload=True),
    "preload-split": SkinnyOptions(preload=True, split_k=4, x_block=1024),
    "cg": SkinnyOptions(weight_cache=".cg"),
    "evict-first": SkinnyOptions(weight_evict="evict_first", weight_cache=".cg"),
}


def _weight(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.1
    q, s = quantize_weight_per_row(w)
    return q.to(DEVICE), s.to(DEVICE)


def _reference(x: torch.Tensor, qw, sw, static: Optional[torch.Tensor]) -> torch.Tensor:
    qx, sx = quantize_fp8_triton(x, None, static)
    return (
        dequantize_fp8(qx.cpu(), sx.cpu(), None, torch.float64)
        @ dequantize_fp8(qw.cpu(), sw.cpu(), None, torch.float64).T
    )


def _assert_matches(y: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(y.cpu().double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_float64(variant: str) -> None:
    """Rows 1 (decode at batch 1) or 3, every other variant."""
    m = 1 + 2 * (list(VARIANTS).index(variant) % 2)
    qw, sw = _weight(seed=1)
    x = (torch.randn(m, K, generator=torch.Generator().manual_seed(m)) * 3).to(DEVICE)
    y = w8a8_skinny(x, qw, sw, None, launch=LAUNCH, options=VARIANTS[variant])
    _assert_matches(y, _reference(x, qw, sw, None))


@pytest.mark.parametrize("variant", ["split3", "persistent-split", "preload-split"])
def test_variant_with_a_static_scale_and_per_step_sums(variant: str) -> None:
    """A static input scale and the products summed at every K step (defer_sum off)."""
    qw, sw = _weight(seed=2)
    x = (torch.randn(2, K, generator=torch.Generator().manual_seed(5)) * 3).to(DEVICE)
    static = torch.tensor(0.02, device=DEVICE)
    for defer_sum in (False, True):
        y = w8a8_skinny(x, qw, sw, None, static, LAUNCH, defer_sum, VARIANTS[variant])
        _assert_matches(y, _reference(x, qw, sw, static))


@pytest.mark.parametrize(
    "variant,defer_sum",
    [("split3", False), ("persistent", True), ("preload-split", True), ("x_block-narrow", False)],
)
def test_variant_under_the_add_norm_prologue(variant: str, defer_sum: bool) -> None:
    """w8a8_skinny_add_norm under a variant, the sum over K deferred or not: h = residual +
    update, written once, and the float64 product of RMSNorm(h)'s e4m3 values."""
    qw, sw = _weight(seed=3)
    gen = torch.Generator().manual_seed(4)
    residual, update = ((torch.randn(3, K, generator=gen) * 2).to(DEVICE) for _ in range(2))
    norm_weight = (1 + 0.3 * torch.randn(K, generator=gen)).to(DEVICE)
    h, y = w8a8_skinny_add_norm(
        residual, update, norm_weight, 1e-6, qw, sw, None, LAUNCH, VARIANTS[variant], defer_sum
    )
    assert torch.equal(h, residual + update)
    _assert_matches(y, _reference(rms_norm(residual + update, norm_weight, 1e-6), qw, sw, None))


def test_one_pass_over_x_with_a_static_scale() -> None:
    """x_block past K under the add+norm prologue: the statistics and the amax (here unused: a
    static input scale) from one load of the row, then split K over the weights."""
    qw, sw = _weight(seed=6)
    gen = torch.Generator().manual_seed(7)
    residual, update = ((torch.randn(2, K, generator=gen) * 2).to(DEVICE) for _ in range(2))
    norm_weight = (1 + 0.3 * torch.randn(K, generator=gen)).to(DEVICE)
    static = torch.tensor(0.05, device=DEVICE)
    options = SkinnyOptions(x_block=4096, split_k=2, preload=True)
    h, y = w8a8_skinny_add_norm(
        residual, update, norm_weight, 1e-6, qw, sw, static, LAUNCH, options
    )
    assert torch.equal(h, residual + update)
    ref = _reference(rms_norm(residual + update, norm_weight, 1e-6), qw, sw, static)
    _assert_matches(y, ref)


def test_split_k_gives_the_same_result_every_run() -> None:
    """The partials are summed in a fixed order: no run-to-run difference (greedy tokens stay)."""
    qw, sw = _weight(seed=5)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    runs = [w8a8_skinny(x, qw, sw, None, launch=LAUNCH, options=VARIANTS["split3"]) for _ in "ab"]
    assert torch.equal(runs[0], runs[1])


def test_variants_name_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="split_k"):
        SkinnyOptions(split_k=0)
    with pytest.raises(ValueError, match="x_block"):
        SkinnyOptions(x_block=100)
    with pytest.raises(ValueError, match="persistent=0"):
        SkinnyOptions(preload=True, persistent=1)
    with pytest.raises(ValueError, match="weight_cache"):
        SkinnyOptions(weight_cache=".ca2")
    with pytest.raises(ValueError, match="weight_cache"):  # a store's modifier: tl.load refuses it
        SkinnyOptions(weight_cache=".cs")
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(7))
    qw, sw = (t.to(DEVICE) for t in quantize_fp8(w, 128))  # 1x128 groups
    x = torch.randn(1, 256, device=DEVICE)
    with pytest.raises(ValueError, match="per-row weight scales"):
        w8a8_skinny(x, qw, sw, 128, options=SkinnyOptions(split_k=2))
    assert skinny_options(123, 456) == SkinnyOptions()  # a shape without a table entry


def _chain(x: torch.Tensor, weights: list, options: SkinnyOptions) -> torch.Tensor:
    """x through every weight in turn, each launch reading the one before's output directly."""
    for qw, sw in weights:
        x = w8a8_skinny(x, qw, sw, None, launch=LAUNCH, options=options)
    return x


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs sm90+",
)
@pytest.mark.parametrize("variant", ["plain", "preload-split"])
def test_pdl_chain_in_a_graph_matches_serialized(monkeypatch, variant: str) -> None:
    """ATOMRT_PDL=1: 40 dependent launches (weights preloaded before the wait, split-K sums)
    captured with PDL and replayed over new inputs give bitwise the chain launched one kernel
    after another (device_info.PDL_ATTRIBUTE off): nothing reads its input before the wait."""
    import dataclasses

    from atomrt.runtime import envs
    from atomrt.workers.kernels import device_info

    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, pdl=True))
    options = VARIANTS.get(variant, SkinnyOptions())
    gen = torch.Generator().manual_seed(8)
    weights = []
    for n, k in [(1024, 512), (512, 1024)] * 20:
        q, s = quantize_weight_per_row(torch.randn(n, k, generator=gen) * k**-0.5)
        weights.append((q.cuda(), s.cuda()))
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    _chain(x, weights, options)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _chain(x, weights, options)
    for seed in range(3):
        x.copy_(torch.randn(1, 512, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        monkeypatch.setattr(device_info, "PDL_ATTRIBUTE", False)
        ref = _chain(x, weights, options)
        monkeypatch.setattr(device_info, "PDL_ATTRIBUTE", True)
        torch.cuda.synchronize()
        assert torch.equal(y, ref), f"replay {seed}: {(y != ref).sum().item()} elements differ"

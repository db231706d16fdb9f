"""The FP8 Triton kernels (through the interpreter on CPU, natively on a GPU) against float64
references that apply the same quantization: quantize, dequantize, multiply."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from kernel_device import DEVICE

from atomrt.workers.kernels.gemm import fp8_skinny_configs as cfg
from atomrt.workers.kernels.gemm.fp8_gemm import (
    quantize_fp8_triton,
    w8a8_fp8_linear,
    w8a8_gemm,
    w8a8_skinny,
    w8a8_skinny_add_norm,
)
from atomrt.workers.kernels.moe.fused_moe_fp8 import fused_experts_fp8
from atomrt.workers.layers.moe import select_experts
from atomrt.workers.layers.norm import rms_norm
from atomrt.workers.layers.quantization.fp8 import (
    dequantize_fp8,
    fp8_experts_ref,
    quantize_fp8,
    quantize_weight_per_row,
)


def _deq64(q: torch.Tensor, s: torch.Tensor, group: Optional[int]) -> torch.Tensor:
    return dequantize_fp8(q.cpu(), s.cpu(), group, torch.float64)


def _weight(n: int, k: int, group: Optional[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    q, s = quantize_fp8(w, group) if group else quantize_weight_per_row(w)
    return q.to(DEVICE), s.to(DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [128, None])
@pytest.mark.parametrize("static", [False, True])
def test_quant_kernel_matches_the_reference(group: Optional[int], static: bool) -> None:
    """Same scales; the same e4m3 values but for an element now and then one step apart (the
    kernel's float32 division may round x / scale the other way at a tie). GPU only: Triton's
    interpreter casts values just below a power of two to the binade below (124.3 -> 64)."""
    if static and group:
        pytest.skip("static input scales go with per-row weights")
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(0)) * 3
    scale = torch.tensor(0.02) if static else None
    q, s = quantize_fp8_triton(x.to(DEVICE), group, scale.to(DEVICE) if static else None)
    rq, rs = quantize_fp8(x, group, scale)
    torch.testing.assert_close(s.cpu(), rs, rtol=1e-6, atol=0)
    differ = (q.cpu().float() != rq.float()).float().mean().item()
    assert differ < 1e-2
    torch.testing.assert_close(q.cpu().float(), rq.float(), rtol=0.13, atol=2e-3)


@pytest.mark.parametrize("m", [1, 3, 8, 9, 40, 80])
@pytest.mark.parametrize("group", [128, None])
def test_w8a8_gemm_matches_float64(m: int, group: Optional[int]) -> None:
    """The GEMM on given e4m3 operands and scales: the skinny (m <= 8) and the MMA paths, K with a
    partial last group, N with a partial last block."""
    n, k = 200, 300
    qw, sw = _weight(n, k, group, seed=1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)) * 2
    qx, sx = quantize_fp8(x, group)
    y = w8a8_gemm(qx.to(DEVICE), sx.to(DEVICE), qw, sw, group, torch.float32)
    ref = _deq64(qx, sx, group) @ _deq64(qw, sw, group).T
    # compiled for Hopper, rows past 32 take wgmma, whose accumulator is narrower than float32
    # within a K step (2.4e-4 to 3.3e-4 of the largest output at these shapes on an H100)
    tol = 1e-3 if DEVICE == "cuda" and m > 32 else 1e-5
    torch.testing.assert_close(y.cpu().double(), ref, rtol=tol, atol=tol * ref.abs().max())


@pytest.mark.parametrize("group", [128, None])
def test_w8a8_linear_quantizes_and_multiplies(group: Optional[int]) -> None:
    """x quantized by the kernel, then the GEMM: the float64 product of those operands."""
    n, k = 96, 256
    qw, sw = _weight(n, k, group, seed=3)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    y = w8a8_fp8_linear(x, qw, sw, None, group)
    qx, sx = quantize_fp8_triton(x, group)
    ref = _deq64(qx, sx, group) @ _deq64(qw, sw, group).T
    torch.testing.assert_close(y.cpu().double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())


@pytest.mark.parametrize("group", [128, None])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_fused_moe_fp8_matches_float64(group: Optional[int], num_tokens: int) -> None:
    """The FP8 experts against the float64 dequantizing reference (the same routing): the
    activated rows are quantized from float32 in the kernel and from float64 in the reference, so
    an element now and then lands one e4m3 step apart: close, not equal."""
    gen = torch.Generator().manual_seed(5)
    e, hidden, inter, top_k = 6, 256, 160, 2
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(e, hidden, inter, generator=gen) * 0.1
    q13, s13 = quantize_fp8(w13, group) if group else quantize_weight_per_row(w13)
    q2, s2 = quantize_fp8(w2, group) if group else quantize_weight_per_row(w2)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, e, generator=gen), top_k, True)
    # on CPU the activations are quantized by the torch reference (see test_quant_kernel_...)
    quantize = {} if DEVICE == "cuda" else {"quantize": quantize_fp8}
    y = fused_experts_fp8(
        x.to(DEVICE),
        *(t.to(DEVICE) for t in (q13, q2, s13, s2, weights, ids)),
        group,
        **quantize,
    )
    ref = fp8_experts_ref(x.double(), q13, q2, s13, s2, weights.double(), ids, group)
    err = (y.cpu().double() - ref).abs()
    assert err.max() < 2e-2 * ref.abs().max()
    assert err.mean() < 1e-3 * ref.abs().max()


@pytest.mark.parametrize("launch", list(cfg.SKINNY_SHAPE_LAUNCHES.values()) + [(256, 4096, 2, 1)])
def test_fused_decode_rows_under_every_shape_launch(launch: tuple[int, int, int, int]) -> None:
    """Each launch of the per-shape table (and a narrower one) gives the float64 product of the
    quantization kernel's e4m3 values: a launch changes the tiles, never the result."""
    n, k, m = 200, 1000, 2
    qw, sw = _weight(n, k, None, seed=7)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(9)) * 3).to(DEVICE)
    y = w8a8_skinny(x, qw, sw, None, launch=launch)
    qx, sx = quantize_fp8_triton(x, None)
    ref = _deq64(qx, sx, None) @ _deq64(qw, sw, None).T
    torch.testing.assert_close(y.cpu().double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())


ADD_NORM_DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
@pytest.mark.parametrize("dtype", ADD_NORM_DTYPES)
def test_fused_add_norm_decode_rows(dtype: torch.dtype, static: bool) -> None:
    """w8a8_skinny_add_norm: h = residual + update, and the float64 product of RMSNorm(h)'s
    e4m3 values (as rms_norm, then the quantization kernel, compute them) with the weight's, in
    one launch; K with a partial last step, N with a partial last block. bfloat16 on CUDA only:
    Triton's interpreter rounds float32 -> bfloat16 toward zero (-1.6328 comes out -1.6250)."""
    n, k, m = 200, 1000, 3
    qw, sw = _weight(n, k, None, seed=8)
    gen = torch.Generator().manual_seed(10)
    residual = (torch.randn(m, k, generator=gen) * 2).to(dtype).to(DEVICE)
    update = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    norm_weight = (1 + 0.3 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    static_scale = torch.tensor(0.02, device=DEVICE) if static else None
    h, y = w8a8_skinny_add_norm(
        residual, update, norm_weight, 1e-6, qw, sw, static_scale, launch=(256, 4096, 4, 2)
    )
    want_h = residual + update
    assert torch.equal(h, want_h)
    qx, sx = quantize_fp8_triton(rms_norm(want_h, norm_weight, 1e-6), None, static_scale)
    ref = _deq64(qx, sx, None) @ _deq64(qw, sw, None).T
    # float32 rows: exact but for the sums' order; bfloat16: y's own rounding, and now and then
    # an element one e4m3 step off where the GPU's rsqrt rounds the normalized row differently
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.cpu().double(), ref, rtol=tol, atol=tol * ref.abs().max())
    assert y.dtype == dtype


def test_fused_add_norm_names_what_does_not_fit() -> None:
    qw, sw = _weight(16, 32, None, seed=1)
    x = torch.zeros(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="norm_weight \\[K\\]"):
        w8a8_skinny_add_norm(x, x, torch.ones(31, device=DEVICE), 1e-6, qw, sw)
    with pytest.raises(ValueError, match="0 < M <= 8"):
        big = torch.zeros(9, 32, device=DEVICE)
        w8a8_skinny_add_norm(big, big, torch.ones(32, device=DEVICE), 1e-6, qw, sw)


@pytest.mark.parametrize("defer_sum", [True, False])
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_fused_decode_rows_sum_over_k_once_or_per_step(static: bool, defer_sum: bool) -> None:
    """The products' sum over K taken once after the K loop (defer_sum) or at every step: the same
    float64 product of the quantization kernel's e4m3 values, rows 1 and 8, a partial last K step
    and N block."""
    n, k = 200, 1000
    qw, sw = _weight(n, k, None, seed=11)
    static_scale = torch.tensor(0.02, device=DEVICE) if static else None
    for m in (1, 8):
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).to(DEVICE)
        y = w8a8_skinny(x, qw, sw, None, static_scale, (256, 4096, 4, 2), defer_sum=defer_sum)
        qx, sx = quantize_fp8_triton(x, None, static_scale)
        ref = _deq64(qx, sx, None) @ _deq64(qw, sw, None).T
        torch.testing.assert_close(y.cpu().double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())


def test_skinny_launch_takes_the_table_then_the_default() -> None:
    assert cfg.skinny_launch(28672, 4096) == cfg.SKINNY_SHAPE_LAUNCHES[(28672, 4096)]
    default = (cfg.SKINNY_BLOCK_K, cfg.SKINNY_PRODUCTS, cfg.SKINNY_WARPS)
    assert cfg.skinny_launch(4096, 4096) == (*default, cfg.SKINNY_STAGES)  # not swept
    # the products' sum over K deferred where it timed faster, per shape
    assert cfg.skinny_defers_sum(4096, 14336) and cfg.skinny_defers_sum(4096, 4096)
    assert not cfg.skinny_defers_sum(6144, 4096) or cfg.SKINNY_DEFER_SUM


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("case", ["block", "row", "static", "one-group"])
def test_fused_decode_rows_quantize_like_the_quant_kernel(m: int, case: str) -> None:
    """Decode rows (m <= SKINNY_M) quantized inside the GEMM's launch (`w8a8_skinny`): the
    float64 product of the quantization kernel's own e4m3 values and scales. K with a partial last
    group, N with a partial last block; "one-group": K within one 128-feature group."""
    n, k = (96, 100) if case == "one-group" else (200, 1000)
    group = None if case in ("row", "static") else 128
    qw, sw = _weight(n, k, group, seed=6)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).to(DEVICE)
    static = torch.tensor(0.02, device=DEVICE) if case == "static" else None
    y = w8a8_skinny(x, qw, sw, group, static)
    if sw.shape[1] == 1:  # per-row scales: w8a8_fp8_linear takes the fused kernel
        torch.testing.assert_close(w8a8_fp8_linear(x, qw, sw, static, group), y, rtol=0, atol=0)
    qx, sx = quantize_fp8_triton(x, None if sw.shape[1] == 1 else group, static)
    ref = _deq64(qx, sx, None if sw.shape[1] == 1 else group) @ _deq64(qw, sw, group).T
    torch.testing.assert_close(y.cpu().double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())

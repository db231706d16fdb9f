"""The w4a16 fused-MoE kernel (MXFP4 experts, 16/32-bit activations) against a float64 reference of
the same experts dequantized, on CPU through Triton's interpreter at tiny shapes and on the GPU when
there is one (python -m pytest tests/test_mxfp4_kernels.py on a CUDA machine, bfloat16 too).

Also the MXFP4 packing: what a weight dequantizes to packs again to the same values (a dequantized
checkpoint's experts go back to MXFP4 without loss).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_device import DEVICE

from atomrt.workers.kernels.moe.fused_moe_mxfp4 import fused_experts_mxfp4
from atomrt.workers.layers.quantization.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def _experts(num_experts: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, ...]:
    """MXFP4 experts [E, rows, cols] (packed, exponents) from random float weights whose groups
    span several binades, and their float64 values."""
    gen = torch.Generator().manual_seed(seed)
    groups = torch.randn(num_experts * rows, cols // 32, 32, generator=gen)
    binades = torch.randint(-3, 3, (num_experts * rows, cols // 32, 1), generator=gen)
    w = (groups * torch.exp2(binades.float())).view(num_experts * rows, cols)
    packed, exponents = quantize_mxfp4(w)
    values = dequantize_mxfp4(packed, exponents, "w").double()
    shape = (num_experts, rows)
    return (
        packed.view(*shape, cols // 2).to(DEVICE),
        exponents.view(*shape, cols // 32).to(DEVICE),
        values.view(*shape, cols),
    )


def _reference(x, w13, w2, weights, ids, limit):
    """float64: per token and slot, W2 (silu(min(W1 x, limit)) * clamp(W3 x, +-limit)), weighted."""
    x, inter = x.double().cpu(), w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).split(inter)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            out[t] += float(weights[t, j]) * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("limit", [None, 0.5], ids=["swiglu", "clamped"])
@pytest.mark.parametrize("hidden,inter", [(96, 64), (64, 32)], ids=["k96-i64", "k64-i32"])
def test_fused_experts_mxfp4_matches_the_float64_reference(
    hidden: int, inter: int, limit: float | None
) -> None:
    """Gate/up K tiles that end half full (hidden 96 = 64 + 32), several experts per block, a token
    routed twice to one expert's neighbours, and the clamped SwiGLU of DeepSeek-V4."""
    num_experts, num_tokens, top_k = 4, 7, 2
    w13, s13, v13 = _experts(num_experts, 2 * inter, hidden, seed=hidden)
    w2, s2, v2 = _experts(num_experts, hidden, inter, seed=inter + 1)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, hidden, generator=gen) * 0.5
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    weights = torch.rand(num_tokens, top_k, generator=gen)
    out = fused_experts_mxfp4(
        x.to(DEVICE), w13, s13, w2, s2, weights.to(DEVICE), ids.to(DEVICE), limit
    )
    ref = _reference(x, v13, v2, weights, ids, limit)
    # float32 sums of terms up to ~100 (weights over several binades): relative to the largest
    scale = float(ref.abs().max())
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-5, atol=1e-5 * scale)
    if DEVICE == "cuda":  # bfloat16 activations, as the model runs them
        out = fused_experts_mxfp4(
            x.to(DEVICE, torch.bfloat16), w13, s13, w2, s2, weights.to(DEVICE), ids.to(DEVICE),
            limit,
        )  # fmt: skip
        torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-2, atol=2e-2 * scale)


def test_packing_keeps_the_values_and_refuses_bad_shapes() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=gen) * 10
    values = dequantize_mxfp4(*quantize_mxfp4(w), "w")
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(values), "w"), values)
    assert (values - w).abs().max() <= w.abs().max() / 4  # within e2m1's coarse steps
    zeros = dequantize_mxfp4(*quantize_mxfp4(torch.zeros(2, 32)), "w")
    assert torch.equal(zeros, torch.zeros(2, 32))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize_mxfp4(torch.zeros(2, 48))
    w13, s13, _ = _experts(2, 64, 64, seed=1)
    w2, s2, _ = _experts(2, 64, 32, seed=2)
    x, ids = torch.zeros(3, 64, device=DEVICE), torch.zeros(3, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="are not MXFP4 experts for x"):
        fused_experts_mxfp4(x, w13, s13, w2[:, :, :8], s2, torch.ones(3, 1, device=DEVICE), ids)

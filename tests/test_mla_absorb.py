"""MLA's absorbed-weight products by one Triton launch (workers/kernels/attention/mla_absorb.py)
against a float64 reference, on the strided views absorbed_decode passes it (q_nope a column slice
of q, transposed; W_UV's product written into the layer's output, transposed); and absorbed_decode
with MLA_ABSORB_KERNEL on against it off. On CPU the kernel runs through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE

from atomrt.runtime.forward_context import AttentionMetaData
from atomrt.workers.kernels.attention import mla_absorb as absorb
from atomrt.workers.kernels.attention.mla_absorb import (
    SKINNY_MAX,
    absorb_fits,
    mla_absorb,
    plan_mla_absorb,
)
from atomrt.workers.layers import mla as mla_layer
from atomrt.workers.layers.mla import MLAAttention, absorbed_decode
from atomrt.workers.layers.rotary import RotaryEmbedding
from atomrt.workers.runner.kv_cache import MLAKVCacheTensor

H, NOPE, ROPE, L, V = 4, 32, 16, 64, 32  # V2-Lite's ratios (qk_nope 128, L 512, v 128) scaled down


# bf16 as the models run; fp16 too, whose dot the interpreter runs as compiled (bf16 operands it
# widens to float32 first: launch.triton_interpreted, the UPCAST flag)
DTYPES = [torch.bfloat16, torch.float16]


def _rounded_exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bmm in float64, rounded once to x's dtype: what a float32-accumulating kernel should store
    to within its accumulation's error."""
    return torch.bmm(x.double().cpu(), w.double().cpu()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_w_uk_product_on_q_nope_slice(n: int, dtype: torch.dtype) -> None:
    """x = q[..., :nope] transposed (rows H * (nope + rope) apart, heads nope + rope apart) @ w_uk
    [H, nope, L] into a fresh [H, n, L]."""
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, H, NOPE + ROPE, generator=gen).to(DEVICE, dtype)
    w_uk = (torch.randn(H, NOPE, L, generator=gen) * 0.2).to(DEVICE, dtype)
    x = q[..., :NOPE].transpose(0, 1)
    assert not x.is_contiguous()
    out = torch.full((H, n, L), float("nan"), dtype=dtype, device=DEVICE)
    mla_absorb(x, w_uk, out)
    torch.testing.assert_close(out.cpu(), _rounded_exact(x, w_uk), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_w_uv_product_into_transposed_output(n: int, dtype: torch.dtype) -> None:
    """x = the decode's latent heads [H, n, L] (a transposed [n, H, L]) @ w_uv [H, L, v] written
    into output [n, H, v] transposed; output's other columns (a wider row: here a padded one) are
    left as they were."""
    gen = torch.Generator().manual_seed(10 + n)
    latent = torch.randn(H, n, L, generator=gen).to(DEVICE, dtype).transpose(0, 1)
    heads = latent.transpose(0, 1)
    w_uv = (torch.randn(H, L, V, generator=gen) * 0.2).to(DEVICE, dtype)
    wide = torch.full((n, H, V + 8), 7.0, dtype=dtype, device=DEVICE)
    output = wide[..., :V]
    mla_absorb(heads, w_uv, output.transpose(0, 1))
    want = _rounded_exact(heads, w_uv).transpose(0, 1)
    torch.testing.assert_close(output.cpu(), want, rtol=1e-2, atol=1e-2)
    assert bool((wide[..., V:] == 7.0).all())


@pytest.mark.parametrize("n", [1, 3])
def test_broadcast_products(n: int) -> None:
    """A plan whose rows take the broadcast-and-sum path (broadcast_max_rows), rows in a tile of
    the next power of two: both products on absorbed_decode's strided views, in bf16."""
    gen = torch.Generator().manual_seed(20 + n)
    plan = absorb.MLAAbsorbLaunch(block_n=16, block_k=16, broadcast_max_rows=4)
    q = torch.randn(n, H, NOPE + ROPE, generator=gen).to(DEVICE, torch.bfloat16)
    w_uk = (torch.randn(H, NOPE, L, generator=gen) * 0.2).to(DEVICE, torch.bfloat16)
    x = q[..., :NOPE].transpose(0, 1)
    q_latent = torch.full((H, n, L), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    mla_absorb(x, w_uk, q_latent, plan)
    torch.testing.assert_close(q_latent.cpu(), _rounded_exact(x, w_uk), rtol=1e-2, atol=1e-2)
    w_uv = (torch.randn(H, L, V, generator=gen) * 0.2).to(DEVICE, torch.bfloat16)
    output = torch.full((n, H, V), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    mla_absorb(q_latent, w_uv, output.transpose(0, 1), plan)
    want = _rounded_exact(q_latent, w_uv).transpose(0, 1)
    torch.testing.assert_close(output.cpu(), want, rtol=1e-2, atol=1e-2)


def test_uneven_tiles_and_float32() -> None:
    """Sizes that are no multiple of the tiles (masked loads and stores) in float32 (full-precision
    dots), against the float64 product."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 40, generator=gen, dtype=torch.float64)
    w = torch.randn(3, 40, 24, generator=gen, dtype=torch.float64)
    out = torch.empty(3, 5, 24, device=DEVICE)
    plan = absorb.MLAAbsorbLaunch(block_n=16, block_k=16)
    mla_absorb(x.float().to(DEVICE), w.float().to(DEVICE), out, plan)
    torch.testing.assert_close(out.double().cpu(), torch.bmm(x, w), rtol=1e-5, atol=1e-5)


def test_plan_fills_the_sms_and_checks() -> None:
    """V2-Lite's 16 heads on 132 SMs: W_UK's 512 columns in tiles of 32 (256 programs), W_UV's 128
    in the narrowest, 16 (128 programs); 128 heads take the widest tile. Misfit arguments raise,
    naming what."""
    assert plan_mla_absorb(16, 128, 512, 132).block_n == 32
    assert plan_mla_absorb(16, 512, 128, 132).block_n == 16
    assert plan_mla_absorb(128, 128, 512, 132).block_n == 128
    assert plan_mla_absorb(16, 512, 128, 132).block_k == 128
    x = torch.zeros(2, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not chain"):
        mla_absorb(x, torch.zeros(2, 4, 16, dtype=torch.bfloat16), torch.zeros(2, 1, 16))
    with pytest.raises(ValueError, match="one dtype"):
        mla_absorb(x, torch.zeros(2, 8, 16), torch.zeros(2, 1, 16))
    with pytest.raises(ValueError, match="out must be contiguous in its last"):
        mla_absorb(x, torch.zeros(2, 8, 16, dtype=torch.bfloat16), torch.zeros(2, 1, 32)[..., ::2])
    w = torch.zeros(2, 8, 16, dtype=torch.bfloat16)
    assert absorb_fits(torch.zeros(2, SKINNY_MAX, 8, dtype=torch.bfloat16, device=DEVICE), w)
    assert not absorb_fits(torch.zeros(2, SKINNY_MAX + 1, 8, dtype=torch.bfloat16), w)


def _layer() -> MLAAttention:
    torch.manual_seed(0)
    layer = MLAAttention(
        0, 64, H, None, L, NOPE, ROPE, V, (NOPE + ROPE) ** -0.5,
        RotaryEmbedding(ROPE, 256, 10000.0, None, True),
    )  # fmt: skip
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    layer.process_weights_after_loading()
    return layer.to(DEVICE, torch.bfloat16)


@pytest.mark.parametrize("rows", [2, SKINNY_MAX + 1])
def test_absorbed_decode_same_with_the_kernel(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """A bf16 MLA layer's absorbed decode (two requests, one and `rows - 1` rows, over a latent
    cache) with MLA_ABSORB_KERNEL on equals it off to bf16 rounding; past SKINNY_MAX rows the
    option leaves torch.bmm in place."""
    layer = _layer()
    block, blocks = 4, 12
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(blocks, block, L + ROPE, generator=gen).to(DEVICE, torch.bfloat16)
    md = AttentionMetaData(
        cu_seqlens_q=torch.tensor([0, 1, rows], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([9, rows + 6], dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(
            [[3, 7, 1, -1, -1, -1], [0, 2, 4, 5, 6, 8]], dtype=torch.int32, device=DEVICE
        ),
    )
    q = torch.randn(rows, H, NOPE + ROPE, generator=gen).to(DEVICE, torch.bfloat16)
    calls = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(args[0].shape)
        return mla_absorb(*args)

    monkeypatch.setattr(absorb, "mla_absorb", counted)  # absorbed_decode imports it per call
    outputs = []
    for on in (False, True):
        monkeypatch.setattr(mla_layer, "MLA_ABSORB_KERNEL", on)
        out = torch.full((rows, H, V), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        absorbed_decode(q, out, layer, md, MLAKVCacheTensor(0, cache))
        outputs.append(out.float().cpu())
    assert not outputs[0].isnan().any()
    torch.testing.assert_close(outputs[1], outputs[0], rtol=2e-2, atol=2e-2)
    if rows > SKINNY_MAX:
        assert torch.equal(outputs[1], outputs[0])
        assert not calls
    else:  # W_UK's product and W_UV's, with the option on only
        assert calls == [(H, rows, NOPE), (H, rows, L)]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, SKINNY_MAX])
def test_real_shapes_in_a_cuda_graph(n: int) -> None:
    """V2-Lite's shapes (16 heads, qk_nope 128, L 512, v 128) in bf16, both products launched in a
    recorded CUDA graph (as a FULL step runs them) and replayed on new inputs, against the float64
    product rounded to bf16."""
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, 16, 192, generator=gen).to("cuda", torch.bfloat16)
    heads = torch.randn(16, n, 512, generator=gen).to("cuda", torch.bfloat16)
    w_uk = (torch.randn(16, 128, 512, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    w_uv = (torch.randn(16, 512, 128, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    q_latent = torch.empty(16, n, 512, dtype=torch.bfloat16, device="cuda")
    output = torch.empty(n, 16, 128, dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        mla_absorb(q[..., :128].transpose(0, 1), w_uk, q_latent)
        mla_absorb(heads, w_uv, output.transpose(0, 1))

    step()  # compiles outside the recording
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    q.copy_(torch.randn(q.shape, generator=gen).to("cuda", torch.bfloat16))
    heads.copy_(torch.randn(heads.shape, generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    want_latent = _rounded_exact(q[..., :128].transpose(0, 1), w_uk)
    torch.testing.assert_close(q_latent.cpu(), want_latent, rtol=1e-2, atol=1e-2)
    want_out = _rounded_exact(heads, w_uv).transpose(0, 1)
    torch.testing.assert_close(output.cpu(), want_out, rtol=1e-2, atol=1e-2)

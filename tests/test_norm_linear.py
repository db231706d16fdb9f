"""The residual add + RMSNorm before a projection: the standalone Triton kernel, the norm fused into the
skinny GEMM's prologue, and the `add_rmsnorm_linear` op the Llama blocks call, against float64 and
against the model's eager torch code, on CPU through Triton's interpreter (fp32 and fp16: the
interpreter's bf16 rounding is not the GPU's; the GPU tier covers bf16).
"""

from __future__ import annotations

import pytest
import torch

from atomrt.runtime.forward_context import Context, set_forward_context
from atomrt.workers.kernels.rmsnorm import add_rmsnorm
from atomrt.workers.kernels.skinny_gemm import NORM_MAX_K, rmsnorm_skinny_linear
from atomrt.workers.layers import linear as linear_mod
from atomrt.workers.layers.norm import residual_add, rms_norm
from atomrt.workers.models.arch import ModelArch
from atomrt.workers.models.llama import LlamaDecoderLayer

EPS = 1e-5


def inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, k, generator=g).to(dtype)
    update = torch.randn(m, k, generator=g).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return hidden, update, norm_w, weight, bias


def reference(hidden, update, norm_w, weight, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (normed input @ weight^T + bias, h), with h and the normed rows rounded to the dtype
    as the model's code rounds them (the only roundings before the GEMM)."""
    h = hidden + update  # one rounding, as eager
    normed = rms_norm(h, norm_w, EPS)
    y = normed.double() @ weight.double().T
    return (y + bias.double() if bias is not None else y), h


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,k", [(1, 64), (3, 576), (5, 100)])
def test_add_rmsnorm_matches_eager(m: int, k: int, dtype: torch.dtype) -> None:
    hidden, update, norm_w, _, _ = inputs(m, k, 1, dtype)
    normed, h = add_rmsnorm(hidden, update, norm_w, EPS)
    assert torch.equal(h, hidden + update)
    torch.testing.assert_close(normed, rms_norm(hidden + update, norm_w, EPS), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 1728), (2, 64, 40), (3, 1000, 13), (4, NORM_MAX_K, 24)])
def test_rmsnorm_skinny_linear_matches_float64(m: int, k: int, n: int, dtype: torch.dtype, bias: bool) -> None:
    """Ragged N (a partial last tile), K not a power of two, every M of the broadcast path."""
    hidden, update, norm_w, weight, b = inputs(m, k, n, dtype, seed=m + k)
    y, h = rmsnorm_skinny_linear(hidden, update, norm_w, EPS, weight, b if bias else None)
    want_y, want_h = reference(hidden, update, norm_w, weight, b if bias else None)
    assert torch.equal(h, want_h), "hidden + update must be the eager sum exactly"
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(y.double(), want_y, **tol)


def test_rmsnorm_skinny_linear_rejects_out_of_range() -> None:
    hidden, update, norm_w, weight, _ = inputs(5, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="M=5"):
        rmsnorm_skinny_linear(hidden, update, norm_w, EPS, weight)
    hidden, update, norm_w, weight, _ = inputs(1, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="must match hidden"):
        rmsnorm_skinny_linear(hidden, update[:, :32], norm_w, EPS, weight)
    big = torch.zeros(1, NORM_MAX_K + 1)
    with pytest.raises(ValueError, match="K=1025"):
        rmsnorm_skinny_linear(big, big, torch.ones(NORM_MAX_K + 1), EPS, torch.zeros(4, NORM_MAX_K + 1))


def test_op_on_cpu_is_the_eager_code_bitwise() -> None:
    """Off CUDA the op is residual_add, rms_norm and F.linear: bitwise the unfused block's numbers,
    called directly and traced (one opaque op in the graph)."""
    hidden, update, norm_w, weight, bias = inputs(6, 48, 20, torch.float32)
    want_h = residual_add(hidden, update)
    want_y = torch.nn.functional.linear(rms_norm(want_h, norm_w, EPS), weight, bias)
    y, h = linear_mod.add_rmsnorm_linear(hidden, update, norm_w, EPS, weight, bias)
    assert torch.equal(h, want_h) and torch.equal(y, want_y)
    seen: set[str] = set()

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: linear_mod.add_rmsnorm_linear(*a, EPS, weight, bias), backend=backend,
                             fullgraph=True)
    y2, h2 = compiled(hidden, update, norm_w)
    assert torch.equal(y2, want_y) and torch.equal(h2, want_h)
    assert any("add_rmsnorm_linear" in op for op in seen)


def _arch(hidden_size: int) -> ModelArch:
    return ModelArch(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=hidden_size, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=hidden_size // 4, intermediate_size=2 * hidden_size,
                     max_position=64, rms_norm_eps=EPS)


def test_which_blocks_fuse_their_norms() -> None:
    assert LlamaDecoderLayer(_arch(64), 0, linear_mod.TPInfo(), 64).fused_norms
    assert not LlamaDecoderLayer(_arch(2048), 0, linear_mod.TPInfo(), 64).fused_norms  # rows too long


def test_fused_block_equals_unfused_block_on_cpu() -> None:
    """The block's (hidden, update) hand-over through add_rmsnorm_linear gives the unfused block's
    numbers (no KV cache: each call attends within its own rows)."""
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(_arch(64), 0, linear_mod.TPInfo(), 64)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    positions = torch.arange(5)
    hidden, update = torch.randn(5, 64), torch.randn(5, 64)
    assert layer.fused_norms

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with set_forward_context(None, None, Context(positions=positions), no_compile_layers={0: layer.self_attn.attn}):
            return layer(positions, hidden, update)

    fused = run()
    layer.fused_norms = False
    plain = run()
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=0, rtol=0)

"""ATOMRT_FP8_NORM_PROLOGUE: an FP8 projection after a residual add and RMSNorm takes them as one
`fp8_add_norm_linear` op (on CUDA, decode rows: one launch, w8a8_skinny_add_norm, which
tests/test_fp8_kernels.py checks against float64), giving what the add, the norm and the
projection give apart; traced by Dynamo as that op; a factor of the compile and trace caches only
when turned off (ATOMRT_FP8_NORM_PROLOGUE=0). On by default."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from atomrt.compile import cache
from atomrt.runtime import envs
from atomrt.workers.layers.linear import ColumnParallelLinear
from atomrt.workers.layers.norm import RMSNorm
from atomrt.workers.layers.quantization.fp8 import Fp8Config
from atomrt.workers.layers.quantization.fp8_layers import convert_linear, finish_linear

K, N, ROWS = 64, 48, 3


def _fp8_layer() -> tuple[ColumnParallelLinear, RMSNorm]:
    torch.manual_seed(0)
    layer = ColumnParallelLinear(K, N)
    with torch.no_grad():
        layer.weight.normal_(0, 0.1)
    convert_linear(layer, Fp8Config(online=True), "model.layers.0.self_attn.qkv_proj")
    finish_linear(layer)
    norm = RMSNorm(K, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
    return layer, norm


@pytest.fixture
def prologue_on(monkeypatch: pytest.MonkeyPatch) -> None:
    env = dataclasses.replace(envs.ENV, fp8_norm_prologue=True)
    monkeypatch.setattr(envs, "ENV", env)
    monkeypatch.setattr(cache, "ENV", env)  # as if set at start-up, where cache.py read it


def test_the_knob_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATOMRT_FP8_NORM_PROLOGUE", raising=False)
    assert envs.read_env().fp8_norm_prologue is True
    monkeypatch.setenv("ATOMRT_FP8_NORM_PROLOGUE", "0")
    assert envs.read_env().fp8_norm_prologue is False


def test_fused_op_gives_the_add_norm_and_projection(prologue_on: None) -> None:
    layer, norm = _fp8_layer()
    assert layer.quant_method.fuses_add_norm
    residual, update = torch.randn(ROWS, K), torch.randn(ROWS, K)
    h, y = layer.forward_add_norm(residual, update, norm)
    want_h = residual + update
    assert torch.equal(h, want_h)
    assert torch.equal(y, layer(norm(want_h)))


def test_traced_as_one_op(prologue_on: None) -> None:
    layer, norm = _fp8_layer()
    residual, update = torch.randn(ROWS, K), torch.randn(ROWS, K)
    ops = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(
        lambda r, u: layer.forward_add_norm(r, u, norm), backend=backend, fullgraph=True
    )
    h, y = compiled(residual, update)
    assert "atomrt.fp8_add_norm_linear" in ops
    eager_h, eager_y = layer.forward_add_norm(residual, update, norm)
    assert torch.equal(h, eager_h) and torch.equal(y, eager_y)


def test_on_by_default_and_out_of_the_cache_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATOMRT_FP8_NORM_PROLOGUE", raising=False)
    monkeypatch.setattr(envs, "ENV", envs.read_env())
    monkeypatch.setattr(cache, "ENV", envs.ENV)
    layer, _ = _fp8_layer()
    assert layer.quant_method.fuses_add_norm is True
    assert "fp8_norm_prologue" not in cache.compiler_factors(torch.device("cpu"))


def test_a_cache_factor_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATOMRT_FP8_NORM_PROLOGUE", "0")
    monkeypatch.setattr(cache, "ENV", envs.read_env())
    assert cache.compiler_factors(torch.device("cpu"))["fp8_norm_prologue"] is False

"""Programmatic dependent launch (ATOMRT_PDL=1) changes when kernels start, never what they compute.
The chains of dependent launches below run the kernels' PDL code twice: launched with the attribute
(overlapping) and without it (device_info.PDL_ATTRIBUTE = False: one after another), and must agree
bitwise. A kernel that touched its predecessor's output before `gdc_wait` would show up here as a
different number (a race), so the chains are long and each link reads the one before it. (Against
kernels compiled without the PDL code the results may differ in the last bit: the wait's position
can change how the compiler contracts multiply-adds.) The model test compares greedy tokens with
PDL off and on.

Run on the GPU machine (sm90+):  python -m pytest -m gpu tests/gpu/test_pdl_gpu.py
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import test_decode_attention as cpu_tier
import torch

from atomrt import SamplingParams
from atomrt.runtime import envs
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.workers.kernels import device_info
from atomrt.workers.kernels.attention.decode_attention import attention_step
from atomrt.workers.kernels.gemm.skinny_gemm import skinny_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
        reason="programmatic dependent launch needs sm90+",
    ),
]


def set_pdl(monkeypatch, on: bool) -> None:
    """ATOMRT_PDL as if set at start-up: the kernels' launch, and Inductor's option in configs made after."""
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, pdl=on))


def serialized(monkeypatch, fn):
    """fn() with the PDL code launched without the attribute: the kernels run one after another."""
    monkeypatch.setattr(device_info, "PDL_ATTRIBUTE", False)
    try:
        return fn()
    finally:
        monkeypatch.setattr(device_info, "PDL_ATTRIBUTE", True)


def differ_mask(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where two tensors differ bitwise in value; NaN equals NaN (the test caches poison unused slots)."""
    return (got != want) & ~(got.isnan() & want.isnan())


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    differ = differ_mask(got, want).nonzero()
    assert len(differ) == 0, (
        f"{what}: {len(differ)} of {got.numel()} elements differ, first at {differ[0].tolist()}: "
        f"{got[tuple(differ[0])].item()} vs {want[tuple(differ[0])].item()}"
    )


def test_use_pdl_follows_the_switch(monkeypatch) -> None:
    set_pdl(monkeypatch, False)
    assert not device_info.use_pdl(torch.device("cuda"))
    set_pdl(monkeypatch, True)
    assert device_info.use_pdl(torch.device("cuda"))
    assert not device_info.use_pdl(torch.device("cpu"))


def gemm_chain(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """x through every weight in turn, each product rescaled (a torch kernel between the links, as
    a norm sits between the model's projections)."""
    for w in weights:
        x = skinny_linear(x, w)
        x = x / x.float().norm().clamp_min(1e-3).to(x.dtype) * 4
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gemm_chain_in_a_graph_matches_serialized(monkeypatch, dtype) -> None:
    """60 dependent skinny GEMMs (SmolLM2-135M's projection shapes) captured with PDL, replayed over
    new inputs: bitwise the chain launched one kernel after another."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [
        (576, 576),
        (3072, 576),
        (576, 3072),
        (960, 576),
        (576, 960),
    ] * 12  # (N, K), each K the last N
    weights = [
        torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * k**-0.5 for n, k in shapes
    ]
    x = torch.randn(1, 576, device="cuda", dtype=dtype, generator=gen)
    set_pdl(monkeypatch, True)
    gemm_chain(x, weights)  # compiles the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemm_chain(x, weights)
    for seed in range(5):
        x.copy_(
            torch.randn(
                1,
                576,
                device="cuda",
                dtype=dtype,
                generator=torch.Generator("cuda").manual_seed(seed),
            )
        )
        graph.replay()
        ref = serialized(monkeypatch, lambda: gemm_chain(x, weights))
        torch.cuda.synchronize()
        assert_same(y, ref, f"replay {seed}")


def test_decode_attention_chain_in_a_graph_matches_serialized(monkeypatch) -> None:
    """Decode attention after a skinny GEMM that writes its q (the model's order), 20 layers deep in
    one graph: bitwise the serialized launches, KV cache included."""
    case = cpu_tier.make_decode_case(
        [170, 3000, 45], group=3, head_dim=64, num_kv_heads=3, dtype=torch.bfloat16, device="cuda"
    )
    b, r = case.batch, case.rotary
    capacity = b.block_tables.shape[1] * b.k_cache.shape[1]
    q_flat = b.q.reshape(b.q.shape[0], -1)
    w = (
        torch.randn(q_flat.shape[1], q_flat.shape[1], device="cuda", dtype=torch.bfloat16)
        * q_flat.shape[1] ** -0.5
    )
    out = torch.empty_like(b.q)
    k_cache0, v_cache0 = b.k_cache.clone(), b.v_cache.clone()

    def layers() -> None:
        for _ in range(20):
            q = skinny_linear(out.reshape(q_flat.shape), w).reshape(b.q.shape)
            attention_step(
                q,
                case.k,
                case.v,
                out,
                case.positions,
                r.cos_cache,
                r.sin_cache,
                b.k_cache,
                b.v_cache,
                case.slot_mapping,
                b.cu_seqlens_q,
                b.context_lens,
                b.block_tables,
                b.q.shape[2] ** -0.5,
                num_seqs=b.num_seqs,
                max_seqlen_q=1,
                max_seqlen_k=capacity,
                graph_safe=True,
            )

    def run_plain() -> tuple[torch.Tensor, ...]:
        out.copy_(b.q)
        b.k_cache.copy_(k_cache0)
        b.v_cache.copy_(v_cache0)
        layers()
        torch.cuda.synchronize()
        return out.clone(), b.k_cache.clone(), b.v_cache.clone()

    set_pdl(monkeypatch, False)
    plain = run_plain()
    set_pdl(monkeypatch, True)
    ref = serialized(monkeypatch, run_plain)
    print(
        "elements where the PDL code differs from the plain code (information only):",
        {
            name: int(differ_mask(a, b).sum())
            for a, b, name in zip(ref, plain, ("out", "k_cache", "v_cache"))
        },
    )
    eager = run_plain()  # also compiles the PDL launches outside the capture
    for got, want, name in zip(eager, ref, ("out", "k_cache", "v_cache")):
        assert_same(got, want, f"eager {name}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()
    for i in range(3):
        out.copy_(b.q)
        b.k_cache.copy_(k_cache0)
        b.v_cache.copy_(v_cache0)
        graph.replay()
        torch.cuda.synchronize()
        for got, want, name in zip((out, b.k_cache, b.v_cache), ref, ("out", "k_cache", "v_cache")):
            assert_same(got, want, f"replay {i} {name}")


def _generate(level: int, mode: str, async_scheduling: bool) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 49000) for _ in range(rng.randrange(1, 120))] for _ in range(24)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1 + (i * 7) % 40, ignore_eos=True)
        for i in range(24)
    ]
    cc = CompilationConfig(level=level, cudagraph_mode=mode, cuda_graph_sizes=[8])
    llm = LLM(
        model="SmolLM2-135M",
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        compilation_config=cc,
        max_num_seqs=24,
        async_scheduling=async_scheduling,
    )
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


@pytest.mark.parametrize(
    "level,mode,async_scheduling", [(3, "FULL", True), (3, "TR_HYBRID", False), (0, "FULL", False)]
)
def test_model_tokens_match_without_pdl(monkeypatch, level, mode, async_scheduling) -> None:
    """bf16 SmolLM2-135M shape (the skinny GEMMs and the decode kernel run; Inductor's kernels carry
    PDL code at level 3): the same greedy tokens, bitwise the same kernels' arithmetic, with PDL."""
    set_pdl(monkeypatch, False)
    plain = _generate(level, mode, async_scheduling)
    set_pdl(monkeypatch, True)
    with_pdl = _generate(level, mode, async_scheduling)
    mismatched = [i for i, (a, b) in enumerate(zip(with_pdl, plain)) if a != b]
    assert not mismatched, f"{mode} level {level}: requests {mismatched[:8]} differ with PDL"

"""The skinny GEMM kernel against a float64 reference, on CUDA when present, else on CPU through
Triton's interpreter.

Small shapes (N, K of a few hundred at most, not multiples of the tiles) and small explicit tiles, so
every case walks several K steps and masks the M, N and K edges while the interpreter stays fast.
The interpreter multiplies bfloat16 tl.dot operands as raw bit patterns (triton-lang/triton#11584),
so the dot path is checked in fp16 and fp32 here; bf16 runs through the broadcast path (which casts
to fp32 before multiplying) and, on the GPU, through benchmarks/sweep_gemm.py's check against F.linear.
"""

from __future__ import annotations

import functools

import pytest
import torch
import triton
from kernel_device import DEVICE

from atomrt.workers.kernels.gemm.skinny_configs import (
    BROADCAST_MAX_M,
    CONFIGS,
    SkinnyConfig,
    block_m_for,
    bucket_m,
    heuristic_config,
    pick_config,
)
from atomrt.workers.kernels.gemm.skinny_gemm import (
    DEFAULT_SKINNY_POLICY,
    SKINNY_MAX_M,
    SkinnyPolicy,
    skinny_linear,
    use_skinny,
)

# assert_close tolerances: outputs are ~1 (weights scaled by K^-0.5), so the output rounding dominates
TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 2**-7, "atol": 2**-7},
}
BROADCAST = SkinnyConfig(block_n=16, block_k=64, use_dot=False, num_warps=4, num_stages=2)
DOT = SkinnyConfig(block_n=16, block_k=32, use_dot=True, num_warps=4, num_stages=2)
MODEL_SHAPES = [  # (N, K) per TP rank of SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B
    (960, 576),
    (576, 576),
    (3072, 576),
    (576, 1536),
    (49152, 576),
    (3072, 2048),
    (2048, 2048),
    (16384, 2048),
    (2048, 8192),
    (128256, 2048),
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
    (128256, 4096),
]


def make_inputs(
    m: int, n: int, k: int, dtype: torch.dtype, *, bias: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * max(1, k) ** -0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x.to(DEVICE), w.to(DEVICE), b


def check(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, config: SkinnyConfig | None
) -> None:
    y = skinny_linear(x, w, b, config)
    ref = x.double().cpu() @ w.double().cpu().T  # [M, N]
    if b is not None:
        ref += b.double().cpu()
    assert y.dtype == x.dtype and y.shape == ref.shape
    torch.testing.assert_close(y.double().cpu(), ref, **TOLERANCES[x.dtype])


# (M, N, K): M powers of two and not, N and K never multiples of the tiles (or shorter than one)
CASES = [(1, 100, 200), (3, 77, 200), (17, 100, 77), (33, 40, 130), (64, 50, 96), (2, 9, 5)]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(
    "config,dtype",
    [
        (BROADCAST, torch.float32),
        (BROADCAST, torch.bfloat16),
        (DOT, torch.float32),
        (DOT, torch.float16),
    ],
    ids=["broadcast-fp32", "broadcast-bf16", "dot-fp32", "dot-fp16"],
)
@pytest.mark.parametrize("m,n,k", CASES, ids=[f"{m}x{n}x{k}" for m, n, k in CASES])
def test_matches_reference(
    m: int, n: int, k: int, config: SkinnyConfig, dtype: torch.dtype, bias: bool
) -> None:
    check(*make_inputs(m, n, k, dtype, bias=bias, seed=m + n + k), config)


@pytest.mark.parametrize("seed", range(8))
def test_random_shapes_and_configs(seed: int) -> None:
    gen = torch.Generator().manual_seed(1000 + seed)

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    m, n, k = (
        int(torch.randint(1, hi, (1,), generator=gen)) for hi in (SKINNY_MAX_M + 1, 150, 300)
    )
    use_dot = seed % 2 == 1
    config = SkinnyConfig(
        block_n=pick([16, 32] if use_dot else [4, 8, 16, 32]),
        block_k=pick([16, 32, 64, 128]),
        use_dot=use_dot,
        num_warps=pick([2, 4, 8]),
        num_stages=pick([1, 2, 3]),
    )
    dtype = pick(
        [torch.float32, torch.float16]
        if use_dot
        else [torch.float32, torch.float16, torch.bfloat16]
    )
    check(*make_inputs(m, n, k, dtype, bias=seed % 3 == 0, seed=seed), config)


@pytest.mark.parametrize("m,n,k", [(1, 200, 300), (4, 100, 64), (5, 64, 100), (32, 100, 200)])
def test_default_config(m: int, n: int, k: int) -> None:
    """config=None: the heuristic (the interpreter counts 4 SMs) picks the path and the tiles."""
    dtype = (
        torch.float32 if m > 4 else torch.bfloat16
    )  # the dot path only in fp32 here (see module doc)
    check(*make_inputs(m, n, k, dtype, bias=True), None)


def test_strided_inputs() -> None:
    """x rows with a row stride (a slice), x with a non-unit K stride (copied), and a weight that is a
    column slice of a wider matrix (row stride > K), as a view into a fused weight would be."""
    m, n, k = 5, 60, 90
    x_wide, w_wide, b = make_inputs(2 * m, n, 2 * k + 3, torch.float32, bias=True, seed=7)
    x_rows = x_wide[::2, :k]  # stride (2 * (2k + 3), 1)
    w_cols = w_wide[:, 3 : 3 + k]  # stride (2k + 3, 1)
    assert not x_rows.is_contiguous() and not w_cols.is_contiguous()
    for config in (BROADCAST, DOT):
        check(x_rows, w_cols, b, config)
    x_t = torch.randn(k, m, device=DEVICE).T  # stride (1, m): K not contiguous
    check(x_t, w_cols.contiguous(), None, BROADCAST)


def test_empty_dimensions() -> None:
    x, w, b = make_inputs(3, 10, 0, torch.float32, bias=True)
    torch.testing.assert_close(skinny_linear(x, w, b), b.expand(3, 10))  # K = 0: bias only
    zeros = functools.partial(torch.zeros, device=DEVICE)
    assert skinny_linear(zeros(0, 8), zeros(10, 8)).shape == (0, 10)
    assert skinny_linear(zeros(2, 8), zeros(0, 8)).shape == (2, 0)


@pytest.mark.parametrize(
    "x,w,b,match",
    [
        (
            torch.zeros(8),
            torch.zeros(4, 8),
            None,
            r"want x \[M, K\] and weight \[N, K\], got x \(8,\)",
        ),
        (torch.zeros(2, 3, 8), torch.zeros(4, 8), None, r"got x \(2, 3, 8\)"),
        (torch.zeros(2, 8), torch.zeros(4, 8, 1), None, r"weight \(4, 8, 1\)"),
        (
            torch.zeros(2, 8),
            torch.zeros(4, 7),
            None,
            r"x \(2, 8\) has K=8 but weight \(4, 7\) has K=7",
        ),
        (torch.zeros(65, 8), torch.zeros(4, 8), None, r"M=65 > SKINNY_MAX_M=64; use F.linear"),
        (
            torch.zeros(2, 8),
            torch.zeros(4, 8, dtype=torch.float16),
            None,
            r"x torch.float32 and weight torch.float16",
        ),
        (
            torch.zeros(2, 8, dtype=torch.int32),
            torch.zeros(4, 8, dtype=torch.int32),
            None,
            r"one of bf16, fp16, fp32",
        ),
        (
            torch.zeros(2, 8),
            torch.zeros(8, 4).T,
            None,
            r"weight \(4, 8\) must be contiguous along K",
        ),
        (
            torch.zeros(2, 8),
            torch.zeros(4, 8),
            torch.zeros(5),
            r"bias must be \[4\] torch.float32 .* got \(5,\)",
        ),
        (
            torch.zeros(2, 8),
            torch.zeros(4, 8),
            torch.zeros(4, dtype=torch.float16),
            r"got \(4,\) torch.float16",
        ),
    ],
    ids=[
        "x-1d",
        "x-3d",
        "w-3d",
        "k-mismatch",
        "m-too-big",
        "dtype-mismatch",
        "int-dtype",
        "w-k-strided",
        "bias-shape",
        "bias-dtype",
    ],
)
def test_rejects_bad_arguments(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        skinny_linear(x, w, b)


def test_config_validation_names_the_knob() -> None:
    with pytest.raises(ValueError, match="block_n must be a power of two, got 24"):
        SkinnyConfig(block_n=24, block_k=64, use_dot=False, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="use_dot needs block_n and block_k >= 16"):
        SkinnyConfig(block_n=8, block_k=64, use_dot=True, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        SkinnyConfig(block_n=8, block_k=64, use_dot=False, num_warps=4, num_stages=0)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16, 17, 32, 64])
def test_heuristic_at_model_shapes(m: int) -> None:
    """Valid launches that fill an H200 (two programs per SM) whenever the narrowest tile allows it,
    keep the register / shared-memory budgets, and never tile K wider than K needs."""
    for n, k in MODEL_SHAPES:
        config = heuristic_config(m, n, k, 132)
        assert config.use_dot == (m > 4)
        min_n = 16 if config.use_dot else 8
        assert triton.cdiv(n, config.block_n) >= min(2 * 132, triton.cdiv(n, min_n)), (
            m,
            n,
            k,
            config,
        )
        assert config.block_k <= max(32, triton.next_power_of_2(k))
        block_m = block_m_for(m, config.use_dot)
        if config.use_dot:
            assert config.num_stages * (config.block_n + block_m) * config.block_k * 2 <= 160 << 10
        else:
            assert config.block_n * block_m * config.block_k <= 8192
        assert pick_config(m, n, k) == CONFIGS.get(
            (bucket_m(m), n, k), config
        )  # the sweep's table first


def test_pick_config_prefers_table_by_bucketed_m(monkeypatch: pytest.MonkeyPatch) -> None:
    swept = SkinnyConfig(block_n=32, block_k=256, use_dot=True, num_warps=8, num_stages=4)
    monkeypatch.setitem(CONFIGS, (32, 960, 576), swept)
    assert pick_config(17, 960, 576) == swept and pick_config(32, 960, 576) == swept
    assert pick_config(16, 960, 576) == heuristic_config(16, 960, 576)  # another bucket
    x, w, _ = make_inputs(17, 96, 40, torch.float32, bias=False)
    monkeypatch.setitem(CONFIGS, (32, 96, 40), DOT)
    check(x, w, None, None)


def test_use_skinny_only_on_cuda() -> None:
    x, w, _ = make_inputs(1, 8, 16, torch.bfloat16, bias=False)
    x, w = x.cpu(), w.cpu()  # make_inputs builds on DEVICE: CUDA where present
    assert not use_skinny(x, w, BROADCAST_MAX_M)  # CPU tensors go to F.linear
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        assert (
            use_skinny(xc, wc, BROADCAST_MAX_M)
            and use_skinny(xc, wc, 1)
            and not use_skinny(xc, wc, 0)
        )
        assert not use_skinny(xc.float(), wc.float(), BROADCAST_MAX_M)
        assert not use_skinny(torch.zeros(2, 16, device="cuda", dtype=torch.bfloat16), wc, 1)
        assert not use_skinny(
            xc, torch.zeros(16, 8, device="cuda", dtype=torch.bfloat16).T, BROADCAST_MAX_M
        )


@pytest.mark.parametrize(
    "n, k, single_row, batch",
    [
        (3072, 2048, True, True),  # Llama-3.2-1B qkv, 6.3M elements
        (4096, 4096, True, False),  # Llama-3.1-8B o, 16.8M: at and above 16M, one row only
        (28672, 4096, True, False),  # Llama-3.1-8B gate_up, 117M
        (128256, 4096, False, False),  # Llama-3.1-8B's vocabulary x hidden, 525M: never
    ],
)
def test_default_policy_by_batch_size(n: int, k: int, single_row: bool, batch: bool) -> None:
    """The measured rule: Llama-3.1-8B's weights only at bs=1 (its bs=2 and bs=4 steps were slower on
    the skinny GEMM); small weights at every batch the broadcast path takes."""
    max_rows = DEFAULT_SKINNY_POLICY.max_rows(n * k)
    assert (max_rows >= 1) is single_row
    assert (max_rows == BROADCAST_MAX_M) is batch
    assert max_rows in (0, 1, BROADCAST_MAX_M)


def test_layers_take_their_policy_at_construction() -> None:
    """A layer decides from its own weight's size under the policy it was built with: nothing reads
    a module constant at run time."""
    from atomrt.workers.layers.linear import ColumnParallelLinear, RowParallelLinear

    tight = SkinnyPolicy(max_weight_elems=100, m1_max_weight_elems=1000, gated_max_weight_elems=50)
    assert ColumnParallelLinear(8, 8, skinny=tight).skinny_max_rows == BROADCAST_MAX_M  # 64 < 100
    assert ColumnParallelLinear(16, 16, skinny=tight).skinny_max_rows == 1  # 256: single rows only
    assert ColumnParallelLinear(64, 64, skinny=tight).skinny_max_rows == 0  # 4096: never
    assert ColumnParallelLinear(64, 64).skinny_max_rows == BROADCAST_MAX_M  # the default policy
    assert (
        RowParallelLinear(4, 8, skinny=tight).fuses_gate
        and not RowParallelLinear(8, 8, skinny=tight).fuses_gate
    )


def test_layer_linear_op_is_f_linear_on_cpu() -> None:
    """The layers' `linear` (and its custom op, what a compiled graph calls) is F.linear off CUDA."""
    from atomrt.workers.layers.linear import linear

    x, w, b = torch.randn(5, 12), torch.randn(7, 12), torch.randn(7)
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert torch.equal(
        torch.ops.atomrt.linear(x, w, None, BROADCAST_MAX_M), torch.nn.functional.linear(x, w)
    )
    compiled = torch.compile(lambda x, w: linear(x, w) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, w), torch.nn.functional.linear(x, w) * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 100, 200), (3, 77, 130), (4, 40, 1000)])
def test_gated_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    """gated=True: (silu(gate) * up) @ W^T from a [M, 2K] gate | up row, the activation rounded to
    x's dtype first, against float64."""
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, 2 * k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    gate, up = x[:, :k].double().cpu(), x[:, k:].double().cpu()
    act = (gate * torch.sigmoid(gate) * up).to(dtype).double()
    for config in (None, BROADCAST):
        y = skinny_linear(x, w, None, config=config, gated=True)
        want = act @ w.double().cpu().T
        torch.testing.assert_close(y.double().cpu(), want, **TOLERANCES[dtype])


def test_gated_rejects_bad_widths() -> None:
    with pytest.raises(ValueError, match="gated x must be"):
        skinny_linear(torch.zeros(1, 10), torch.zeros(4, 6), gated=True)


def test_layer_silu_mul_linear_on_cpu() -> None:
    """The layers' fused activation + projection is silu_and_mul then F.linear off CUDA, traced too."""
    from atomrt.workers.layers.activation import silu_and_mul
    from atomrt.workers.layers.linear import silu_mul_linear

    x, w = torch.randn(5, 24), torch.randn(7, 12)
    want = torch.nn.functional.linear(silu_and_mul(x), w)
    assert torch.equal(silu_mul_linear(x, w), want)
    compiled = torch.compile(
        lambda x, w: silu_mul_linear(x, w) + 1, backend="aot_eager", fullgraph=True
    )
    assert torch.equal(compiled(x, w), want + 1)


def traced_ops(fn, *inputs: torch.Tensor) -> tuple[object, set[str]]:
    """fn(*inputs) compiled in one graph: its outputs, and the names of the ops Dynamo traced."""
    seen: set[str] = set()

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)(*inputs), seen


def test_large_gated_weight_leaves_the_activation_to_inductor() -> None:
    """Where the policy does not fuse the gate (a large down projection) the traced graph holds silu,
    mul and the plain linear op (Inductor fuses silu * mul into one kernel); below, the one fused op."""
    from atomrt.workers.layers.linear import RowParallelLinear

    def ops_traced(n: int, k: int) -> set[str]:
        layer = RowParallelLinear(k, n)
        layer.weight.data.normal_()
        x = torch.randn(2, 2 * k)
        got, seen = traced_ops(lambda x: layer(x, gated_input=True), x)
        want = torch.nn.functional.linear(
            torch.nn.functional.silu(x[:, :k]) * x[:, k:], layer.weight
        )
        torch.testing.assert_close(got, want)
        return seen

    small = ops_traced(8, 16)
    assert any("silu_mul_linear" in op for op in small)
    big_k = DEFAULT_SKINNY_POLICY.gated_max_weight_elems // 8 + 1
    big = ops_traced(8, big_k)
    assert not any("silu_mul_linear" in op for op in big)
    assert any("atomrt.linear" in op for op in big) and any("silu" in op for op in big)


def test_pdl_needs_the_switch_and_a_cuda_device(monkeypatch) -> None:
    """ATOMRT_PDL=1 turns programmatic dependent launch on for sm90+ CUDA devices only (the kernels'
    PDL code is checked on the GPU: tests/gpu/test_pdl_gpu.py), and adds Inductor's PDL option to
    the compilation config, whose hash keys the compile cache; an explicit setting is kept."""
    import dataclasses

    from atomrt.runtime import envs
    from atomrt.runtime.config import CompilationConfig
    from atomrt.workers.kernels import device_info

    off = dataclasses.replace(envs.ENV, pdl=False)
    monkeypatch.setattr(envs, "ENV", off)
    assert not device_info.use_pdl(torch.device("cuda", 0))  # decided before any CUDA call
    plain = CompilationConfig(level=3)
    assert "triton.enable_pdl" not in plain.inductor_compile_config
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(off, pdl=True))
    assert not device_info.use_pdl(torch.device("cpu"))
    with_pdl = CompilationConfig(level=3)
    assert with_pdl.inductor_compile_config == {"triton.enable_pdl": True}
    assert with_pdl.compute_hash() != plain.compute_hash()
    user = CompilationConfig(level=3, inductor_compile_config={"triton.enable_pdl": False})
    assert user.inductor_compile_config == {"triton.enable_pdl": False}


def add_norm_reference(
    residual: torch.Tensor,
    update: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    b: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = residual + update as eager rounds it; y in float64 on the CPU from RMSNorm's eager
    output."""
    from atomrt.workers.layers.norm import rms_norm

    h = residual + update
    y = rms_norm(h, norm_weight, eps).double().cpu() @ w.double().cpu().T
    return h, y + b.double().cpu() if b is not None else y


# The interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest): bf16 is checked on the
# GPU (tests/gpu/test_skinny_gemm_gpu.py); fp16 and fp32 here, where h must match eager bit for bit.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,n,k", [(1, 100, 200), (3, 77, 130), (4, 40, 1000), (2, 9, 5)])
def test_add_norm_matches_reference(m: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    """skinny_add_norm_linear: h = residual + update exactly as eager; y from RMSNorm(h) against
    float64, with the default config (one K step up to 1024) and with several K steps."""
    from atomrt.workers.kernels.gemm.skinny_gemm import skinny_add_norm_linear

    gen = torch.Generator().manual_seed(m * n + k)
    residual, update = (torch.randn(m, k, generator=gen).to(DEVICE, dtype) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    want_h, want_y = add_norm_reference(residual, update, norm_weight, 1e-5, w, b)
    for config in (None, BROADCAST):
        h, y = skinny_add_norm_linear(residual, update, norm_weight, 1e-5, w, b, config=config)
        assert torch.equal(h, want_h)
        torch.testing.assert_close(y.double().cpu(), want_y, **TOLERANCES[dtype])


def test_add_norm_rejects_bad_arguments() -> None:
    from atomrt.workers.kernels.gemm.skinny_gemm import skinny_add_norm_linear

    zeros = functools.partial(torch.zeros, device=DEVICE)
    x, w, nw = zeros(2, 8), zeros(4, 8), torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="update"):
        skinny_add_norm_linear(x, zeros(2, 7), nw, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight must be"):
        skinny_add_norm_linear(x, x, torch.ones(7, device=DEVICE), 1e-6, w)
    with pytest.raises(ValueError, match="broadcast path"):
        skinny_add_norm_linear(zeros(5, 8), zeros(5, 8), nw, 1e-6, w)
    h, y = skinny_add_norm_linear(x[:0], x[:0], nw, 1e-6, w)  # no rows: nothing to launch
    assert h.shape == (0, 8) and y.shape == (0, 4)


@pytest.mark.parametrize("stats_values", [64, 4096], ids=["narrow", "wide"])
@pytest.mark.parametrize("m,k", [(1, 300), (3, 1000), (4, 2500)])
def test_add_norm_statistics_pass_any_width(m: int, k: int, stats_values: int) -> None:
    """The NORM prologue's statistics pass (K wider than one K step) gives the same h and a y within
    fp32's tolerance whether it walks K in many narrow steps (each masked at K's end) or in one or a
    few wide ones: narrow at 64 values, and the default's 4096 values over all M rows."""
    from atomrt.workers.kernels.gemm import skinny_gemm

    gen = torch.Generator().manual_seed(m + k)
    residual, update = (torch.randn(m, k, generator=gen).to(DEVICE) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE)
    w = (torch.randn(30, k, generator=gen) * k**-0.5).to(DEVICE)
    want_h, want_y = add_norm_reference(residual, update, norm_weight, 1e-6, w, None)
    config = SkinnyConfig(block_n=16, block_k=128, use_dot=False, num_warps=4, num_stages=2)
    stats_block = skinny_gemm.norm_stats_block(m, k, config, stats_values)
    wide = min(triton.next_power_of_2(k), stats_values // block_m_for(m, False))
    assert stats_block == max(
        config.block_k, wide
    )  # narrow: the K tile's 128, so several masked steps
    h, y = skinny_gemm.skinny_add_norm_linear(
        residual, update, norm_weight, 1e-6, w, config=config, stats_values=stats_values
    )
    assert torch.equal(h, want_h)
    torch.testing.assert_close(y.double().cpu(), want_y, **TOLERANCES[torch.float32])


def test_norm_stats_block_takes_an_8b_row_in_one_step() -> None:
    """norm_stats_block: the Llama-3.1-8B row (K 4096) at M=1 in one step of the pass, whatever the
    GEMM's K tile; wider M rows share the 4096 values; at most K's next power of two, else at least
    block_k."""
    from atomrt.workers.kernels.gemm.skinny_gemm import norm_stats_block

    for block_k in (128, 256, 512):
        config = SkinnyConfig(block_n=8, block_k=block_k, use_dot=False, num_warps=2, num_stages=3)
        assert norm_stats_block(1, 4096, config) == 4096
        assert norm_stats_block(4, 4096, config) == max(block_k, 1024)
        assert norm_stats_block(1, 2048, config) == 2048
        assert norm_stats_block(1, 100, config) == 128  # (one K step: ONE_STEP, no pass is made)
    wide_k = SkinnyConfig(block_n=8, block_k=8192, use_dot=False, num_warps=2, num_stages=3)
    assert norm_stats_block(1, 16384, wide_k) == 8192

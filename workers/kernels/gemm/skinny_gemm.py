# Skinny GEMM for decode-sized batches: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), M <= SKINNY_MAX_M.
# What lives here: the launchers `skinny_linear` / `skinny_add_norm_linear`, the gate `use_skinny`
# and `SkinnyPolicy` (which weights take it). The Triton kernel is in skinny_kernels.py, the launch
# configs (heuristic + a table a GPU sweep fills, benchmarks/sweep_gemm.py) in skinny_configs.py.
# No layer code: the linear layers call `skinny_linear` when `use_skinny` says so, F.linear
# otherwise.
#
# Design: decode GEMMs read the whole weight once and do almost no arithmetic, so the kernel is a
# weight stream. One program owns BLOCK_N output columns (W rows) and all M rows of x, and walks K
# in BLOCK_K steps: every weight byte is loaded exactly once, by one program, and x (a few KB) is
# re-read from L2. Wide K tiles split K across the warps of a program, so there is no split-K across
# programs: that would need either a second kernel (reduce / cast) or an fp32 workspace plus a
# self-resetting semaphore, each costing more than it saves at these sizes; small BLOCK_N gives
# the programs instead. Two prologues fuse the layer before the GEMM into its x tiles (broadcast
# path; each program recomputes them from x, a few KB, while its weight tiles stream):
#   GATED  x = silu(gate) * up, the gated MLP's activation (the down projection);
#   NORM   x = rms_norm(residual + update), the residual add and RMSNorm before q/k/v and gate/up
#          (`skinny_add_norm_linear`; program 0 also writes residual + update, the next residual).
# Two inner products (constexpr USE_DOT):
#   USE_DOT=False  broadcast-multiply + tl.sum over K: no padding of M, best for M <= 4 or so;
#   USE_DOT=True   tl.dot(W tile, x tile^T) with M padded to 16: W's BLOCK_N is the MMA's M side.
# The launch depends only on (M, N, K, dtype), never on data: safe to capture in a CUDA graph.
# Importing this module needs no GPU.

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from atomrt.workers.kernels import device_info
from atomrt.workers.kernels.device_info import sm_count, use_pdl
from atomrt.workers.kernels.gemm.skinny_configs import (
    BROADCAST_MAX_M,
    SkinnyConfig,
    block_m_for,
    heuristic_config,
    pick_config,
)
from atomrt.workers.kernels.gemm.skinny_kernels import skinny_gemm_kernel
from atomrt.workers.kernels.launch import launch

SKINNY_MAX_M = 64  # the kernel keeps all M rows of x in registers: larger M belongs to cuBLAS
NORM_STATS_VALUES = (
    4096  # NORM prologue: x values (over all M rows) per step of the statistics pass
)


@dataclass(frozen=True)
class SkinnyPolicy:
    """Which projections take the skinny GEMM, and its prologues' settings. A model's linear layers
    get one at construction and decide from their weight's size (`max_rows`); the defaults are the
    H200 measurements' (docs/perf.md, skinny GEMM): batches of 2-4 rows only below 16M weight
    elements (larger weights on the heuristic's launches were slower than cuBLAS), single rows below
    128M (every projection of the three bench models), the gated MLP's SiLU-and-mul fused into the
    down projection only below 2M (it is recomputed per weight element: a win only while small)."""

    max_weight_elems: int = 1 << 24  # batches of 2..BROADCAST_MAX_M rows: weights below this
    m1_max_weight_elems: int = 1 << 27  # single rows: weights below this
    gated_max_weight_elems: int = 1 << 21  # fused SiLU-and-mul: weights up to this
    norm_stats_values: int = NORM_STATS_VALUES

    def max_rows(self, weight_elems: int) -> int:
        """The largest batch the skinny GEMM takes for a weight of this many elements: 0 (never),
        1 (single rows) or BROADCAST_MAX_M."""
        if weight_elems < self.max_weight_elems:
            return BROADCAST_MAX_M
        return 1 if weight_elems < self.m1_max_weight_elems else 0

    def fuses_gate(self, weight_elems: int) -> bool:
        return weight_elems <= self.gated_max_weight_elems


DEFAULT_SKINNY_POLICY = SkinnyPolicy()
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def norm_stats_block(
    m: int, k: int, config: SkinnyConfig, stats_values: int = NORM_STATS_VALUES
) -> int:
    """K elements per step of the NORM prologue's statistics pass (when K > block_k): up to
    `stats_values` of x per step over all M rows, at least block_k, at most K's next power of two
    (the latter wins where they disagree: K <= block_k makes no pass).
    Every program makes the pass before its K loop can use x, and each step is a dependent round trip
    to L2: in block_k steps the pass took 16 round trips for Llama-3.1-8B's qkv at block_k 256, 32
    for its gate_up at 128. 4096 values take an 8B row at M=1 in one step."""
    block_m = block_m_for(m, config.use_dot)
    return min(triton.next_power_of_2(max(1, k)), max(config.block_k, stats_values // block_m))


def use_skinny(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    """Whether a linear layer should call skinny_linear rather than F.linear for this input: a CUDA
    bf16/fp16 batch of at most `max_rows` rows (the layer's `SkinnyPolicy.max_rows`). From M=8 up
    the H200 sweep found cuBLAS as fast or faster on most model shapes, hence BROADCAST_MAX_M."""
    return (
        x.is_cuda
        and x.dim() == 2
        and weight.dim() == 2
        and x.shape[0] <= max_rows
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.shape[1] == weight.shape[1]
        and weight.stride(1) == 1
    )


def skinny_linear(
    x: torch.Tensor,  # [M, K] ([M, 2K] gate | up when gated), M <= SKINNY_MAX_M
    weight: torch.Tensor,  # [N, K], K contiguous (nn.Linear's layout)
    bias: torch.Tensor | None = None,  # [N]
    config: SkinnyConfig | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """y = x @ weight^T (+ bias) in x's dtype, accumulated in fp32: F.linear for decode batches.
    gated: y = (silu(x[:, :K]) * x[:, K:]) @ weight^T, the SiLU-and-mul of a gated MLP fused into the
    down projection (broadcast path only)."""
    if gated:
        if x.dim() != 2 or x.shape[1] != 2 * weight.shape[-1]:
            raise ValueError(
                f"skinny_linear: gated x must be [M, 2K] for weight {tuple(weight.shape)}, got {tuple(x.shape)}"
            )
        m, n, k = _check_linear_args(x[:, : weight.shape[1]], weight, bias)
    else:
        m, n, k = _check_linear_args(x, weight, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)  # [M, N]
    if m == 0 or n == 0:
        return y
    config = config or pick_config(m, n, k, num_sms=sm_count(x.device))
    if gated and config.use_dot:
        if m > BROADCAST_MAX_M:
            raise ValueError(
                f"skinny_linear: gated runs the broadcast path, M={m} > {BROADCAST_MAX_M}"
            )
        config = heuristic_config(m, n, k, sm_count(x.device))
    _launch(x, weight, bias, y, config, gated=gated)
    return y


def skinny_add_norm_linear(
    residual: torch.Tensor,  # [M, K], M <= BROADCAST_MAX_M
    update: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K], K contiguous
    bias: torch.Tensor | None = None,  # [N]
    config: SkinnyConfig | None = None,
    stats_values: int = NORM_STATS_VALUES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = residual + update, y = RMSNorm(h) @ weight^T (+ bias), with RMSNorm's eager
    arithmetic (fp32 statistics; the normalized row and its product with norm_weight each rounded
    to the input dtype). A decoder layer's residual add, norm and next projection in one launch of
    the broadcast path: the norm runs in the GEMM's prologue, on every program."""
    m, n, k = _check_linear_args(residual, weight, bias)
    if (
        update.shape != residual.shape
        or update.dtype != residual.dtype
        or update.device != residual.device
    ):
        raise ValueError(
            f"skinny_add_norm_linear: update {tuple(update.shape)} {update.dtype} on {update.device} must match "
            f"residual {tuple(residual.shape)} {residual.dtype} on {residual.device}"
        )
    if (
        norm_weight.shape != (k,)
        or norm_weight.dtype != residual.dtype
        or norm_weight.device != residual.device
    ):
        raise ValueError(
            f"skinny_add_norm_linear: norm_weight must be [{k}] {residual.dtype} on {residual.device}, got "
            f"{tuple(norm_weight.shape)} {norm_weight.dtype} on {norm_weight.device}"
        )
    if m > BROADCAST_MAX_M:
        raise ValueError(
            f"skinny_add_norm_linear: the norm runs on the broadcast path, M={m} > {BROADCAST_MAX_M}"
        )
    residual, update, norm_weight = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (residual, update, norm_weight)
    )
    y = torch.empty((m, n), device=residual.device, dtype=residual.dtype)
    if m == 0 or n == 0:  # no program runs to write h
        return residual + update, y
    h = torch.empty((m, k), device=residual.device, dtype=residual.dtype)
    config = config or pick_config(m, n, k, num_sms=sm_count(residual.device))
    if config.use_dot:
        config = heuristic_config(m, n, k, sm_count(residual.device))
    _launch(
        residual,
        weight,
        bias,
        y,
        config,
        norm=(update, norm_weight, h, eps),
        stats_values=stats_values,
    )
    return h, y


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    config: SkinnyConfig,
    *,
    gated: bool = False,
    norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]
    | None = None,  # update, norm weight, h, eps
    stats_values: int = NORM_STATS_VALUES,
) -> None:
    """One skinny_gemm_kernel launch writing y (and h with `norm`); arguments already checked."""
    (m, n), k = y.shape, weight.shape[1]
    update, norm_weight, h, eps = (
        norm if norm is not None else (y, y, y, 0.0)
    )  # unused without NORM
    grid = (triton.cdiv(n, config.block_n),)
    one_step = k <= config.block_k
    pdl = use_pdl(x.device)
    launch(
        skinny_gemm_kernel,
        grid,
        x,
        weight,
        bias if bias is not None else y,
        y,
        update,
        norm_weight,
        h,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        bias.stride(0) if bias is not None else 0,
        y.stride(0),
        update.stride(0),
        h.stride(0),
        eps,
        BLOCK_M=block_m_for(m, config.use_dot),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_DOT=config.use_dot,
        EVEN_K=k > 0
        and k % config.block_k == 0,  # K = 0 takes the masked loads (a peeled first step)
        HAS_BIAS=bias is not None,
        GATED=gated,
        NORM=norm is not None,
        ONE_STEP=one_step,
        STATS_BLOCK=norm_stats_block(m, k, config, stats_values)
        if norm is not None and not one_step
        else config.block_k,
        IEEE_DOT=x.dtype == torch.float32,
        NUM_STAGES=config.num_stages,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl and device_info.PDL_ATTRIBUTE,
    )


def _check_linear_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[int, int, int]:
    """Validates shapes, dtypes, devices and layouts; returns (M, N, K)."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"skinny_linear: want x [M, K] and weight [N, K], got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(
            f"skinny_linear: x {tuple(x.shape)} has K={k} but weight {tuple(weight.shape)} has K={weight.shape[1]}"
        )
    if m > SKINNY_MAX_M:
        raise ValueError(
            f"skinny_linear: x {tuple(x.shape)} has M={m} > SKINNY_MAX_M={SKINNY_MAX_M}; use F.linear"
        )
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"skinny_linear: x {x.dtype} and weight {weight.dtype} must share one of bf16, fp16, fp32"
        )
    if weight.device != x.device:
        raise ValueError(f"skinny_linear: x is on {x.device}, weight on {weight.device}")
    if weight.stride(1) != 1 and k > 1:
        raise ValueError(
            f"skinny_linear: weight {tuple(weight.shape)} must be contiguous along K, has strides {weight.stride()}"
        )
    if bias is not None and (
        bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device
    ):
        raise ValueError(
            f"skinny_linear: bias must be [{n}] {x.dtype} on {x.device}, got {tuple(bias.shape)} "
            f"{bias.dtype} on {bias.device}"
        )
    return m, n, k

# Skinny GEMM for decode-sized batches: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), M <= SKINNY_MAX_M.
# What lives here: the Triton kernel, the launchers `skinny_linear` / `skinny_add_norm_linear`, the
# gate `use_skinny` and `SkinnyPolicy` (which weights take it); the launch configs (heuristic + a
# table a GPU sweep fills, benchmarks/sweep_gemm.py) are in skinny_configs.py. No layer code:
# the linear layers call `skinny_linear` when `use_skinny` says so, F.linear otherwise.
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
import triton.language as tl

from atomrt.workers.kernels import device_info
from atomrt.workers.kernels.device_info import sm_count, use_pdl
from atomrt.workers.kernels.gemm.skinny_configs import (
    BROADCAST_MAX_M,
    SkinnyConfig,
    block_m_for,
    heuristic_config,
    pick_config,
)

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


@triton.jit
def skinny_gemm_kernel(
    x_ptr,  # [M, K], K contiguous
    w_ptr,  # [N, K], K contiguous
    bias_ptr,  # [N]; unused unless HAS_BIAS
    y_ptr,  # [M, N]
    u_ptr,
    nw_ptr,
    h_ptr,  # NORM only: update [M, K], the norm's weight [K], out: h = x + update [M, K]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_bias,
    stride_ym,
    stride_um,
    stride_hm,
    eps,  # NORM only: the RMSNorm's epsilon
    BLOCK_M: tl.constexpr,  # next power of two of M (at least 16 with USE_DOT)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # x is [M, 2K] (gate | up) and the product reads silu(gate) * up (broadcast path)
    NORM: tl.constexpr,  # the product reads rms_norm(x + update) * norm weight (broadcast path)
    ONE_STEP: tl.constexpr,  # K <= BLOCK_K: the K loop is one step (NORM takes the row's statistics there)
    STATS_BLOCK: tl.constexpr,  # NORM without ONE_STEP: K elements per step of the statistics pass
    IEEE_DOT: tl.constexpr,  # fp32 inputs: full-precision dots instead of tf32
    NUM_STAGES: tl.constexpr,  # set on the K loop too, so that the broadcast path's loads pipeline
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (device_info.use_pdl)
):
    """Columns pid * BLOCK_N .. + BLOCK_N of y for all M rows. The tile is kept transposed,
    acc [BLOCK_N, BLOCK_M], so that W's rows are the MMA's M side on the dot path."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    if USE_DOT:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = _dot_tile(
            x_ptr,
            w_ptr,
            M,
            N,
            K,
            stride_xm,
            stride_wn,
            cols,
            rows,
            BLOCK_K,
            EVEN_K,
            IEEE_DOT,
            NUM_STAGES,
        )
    else:
        acc = _broadcast_tile(
            x_ptr,
            w_ptr,
            u_ptr,
            nw_ptr,
            h_ptr,
            M,
            N,
            K,
            stride_xm,
            stride_wn,
            stride_um,
            stride_hm,
            eps,
            cols,
            rows,
            BLOCK_K,
            EVEN_K,
            GATED,
            NORM,
            ONE_STEP,
            STATS_BLOCK,
            NUM_STAGES,
            USE_PDL,
        )
    col_valid = cols < N
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_bias, mask=col_valid, other=0.0)
        acc += bias.to(tl.float32)[:, None]
    y_ptrs = y_ptr + rows[None, :] * stride_ym + cols[:, None]  # [BLOCK_N, BLOCK_M]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=col_valid[:, None] & (rows < M)[None, :])


@triton.jit
def _dot_tile(
    x_ptr,
    w_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    cols,
    rows,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """acc [BLOCK_N, BLOCK_M] = W tile [BLOCK_N, BLOCK_K] @ x tile^T [BLOCK_K, BLOCK_M], over K."""
    ks = tl.arange(0, BLOCK_K)
    col_valid = (cols < N)[:, None]
    row_valid = (rows < M)[:, None]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([cols.shape[0], rows.shape[0]], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_valid, other=0.0)
            w = tl.load(w_ptrs, mask=col_valid, other=0.0)
        else:
            k_valid = (k0 + ks < K)[None, :]
            x = tl.load(x_ptrs, mask=row_valid & k_valid, other=0.0)
            w = tl.load(w_ptrs, mask=col_valid & k_valid, other=0.0)
        if IEEE_DOT:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _broadcast_tile(
    x_ptr,
    w_ptr,
    u_ptr,
    nw_ptr,
    h_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_um,
    stride_hm,
    eps,
    cols,
    rows,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    ONE_STEP: tl.constexpr,
    STATS_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """acc [BLOCK_N, BLOCK_M] = sum over K of W [BLOCK_N, 1, BLOCK_K] * x [1, BLOCK_M, BLOCK_K].
    The tiles are loaded 3-D, so the product keeps the loads' 16-byte-vector layout: expanding 2-D
    loads instead makes Triton convert the W tile's layout through shared memory on every step.
    USE_PDL and NORM peel the first K step off the loop and load its weight tile first: before the
    wait on the previous kernel (PDL; no kernel writes weights during a forward), and before the
    norm's pass over x (NORM), so that memory round trip overlaps the wait or the pass. With ONE_STEP
    NORM makes no separate pass: the step's x tile is the whole row and gives the statistics;
    without, the pass reads STATS_BLOCK-wide tiles, each step one dependent round trip."""
    n3 = cols[:, None, None]
    m3 = rows[None, :, None]
    k3 = tl.arange(0, BLOCK_K)[None, None, :]
    x_ptrs = x_ptr + m3 * stride_xm + k3  # [1, BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + n3.to(tl.int64) * stride_wn + k3  # [BLOCK_N, 1, BLOCK_K]
    u_ptrs = u_ptr + m3 * stride_um + k3
    h_ptrs = h_ptr + m3 * stride_hm + k3
    store_h = tl.program_id(0) == 0  # one program writes the residual stream's new value
    inv_rms = tl.zeros([1, rows.shape[0], 1], dtype=tl.float32)  # NORM: set below, per row
    acc = tl.zeros([cols.shape[0], rows.shape[0]], dtype=tl.float32)
    if USE_PDL or NORM:
        w = _load_w_step(w_ptrs, N, K, 0, n3, k3, EVEN_K)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if NORM and not ONE_STEP:
            inv_rms = _inv_rms(x_ptr, u_ptr, M, K, stride_xm, stride_um, eps, m3, STATS_BLOCK)
        acc = _broadcast_step(
            acc,
            w,
            x_ptrs,
            u_ptrs,
            nw_ptr,
            h_ptrs,
            store_h,
            inv_rms,
            eps,
            M,
            K,
            0,
            m3,
            k3,
            EVEN_K,
            GATED,
            NORM,
            ONE_STEP,
        )
    for k0 in tl.range(BLOCK_K if USE_PDL or NORM else 0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = _load_w_step(w_ptrs, N, K, k0, n3, k3, EVEN_K)
        acc = _broadcast_step(
            acc,
            w,
            x_ptrs,
            u_ptrs,
            nw_ptr,
            h_ptrs,
            store_h,
            inv_rms,
            eps,
            M,
            K,
            k0,
            m3,
            k3,
            EVEN_K,
            GATED,
            NORM,
            ONE_STEP,
        )
    return acc


@triton.jit
def _load_w_step(w_ptrs, N, K, k0, n3, k3, EVEN_K: tl.constexpr):
    """The weight tile [BLOCK_N, 1, BLOCK_K] of the K step at k0."""
    if EVEN_K:
        return tl.load(w_ptrs + k0, mask=n3 < N, other=0.0)
    return tl.load(w_ptrs + k0, mask=(n3 < N) & (k0 + k3 < K), other=0.0)


@triton.jit
def _residual_sum(x_ptrs, u_ptrs, mask):
    """x + update, rounded once to x's dtype (as `residual + update` is in eager)."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    return (x.to(tl.float32) + tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)


@triton.jit
def _inv_rms(x_ptr, u_ptr, M, K, stride_xm, stride_um, eps, m3, STATS_BLOCK: tl.constexpr):
    """[1, BLOCK_M, 1]: 1 / sqrt(mean((x + update)^2) + eps) per row, in fp32 (a pass over x's rows:
    a few KB, read again by the K loop from L1/L2). Each step of the pass waits on its loads, so the
    pass costs cdiv(K, STATS_BLOCK) dependent round trips: STATS_BLOCK is wide (norm_stats_block)."""
    k3 = tl.arange(0, STATS_BLOCK)[None, None, :]
    x_ptrs = x_ptr + m3 * stride_xm + k3
    u_ptrs = u_ptr + m3 * stride_um + k3
    sum_sq = tl.zeros([1, m3.shape[1]], dtype=tl.float32)
    for k0 in range(0, K, STATS_BLOCK):
        h = _residual_sum(x_ptrs + k0, u_ptrs + k0, (m3 < M) & (k0 + k3 < K)).to(tl.float32)
        sum_sq += tl.sum(h * h, axis=2)
    return tl.rsqrt(sum_sq / K + eps)[:, :, None]


@triton.jit
def _broadcast_step(
    acc,
    w,
    x_ptrs,
    u_ptrs,
    nw_ptr,
    h_ptrs,
    store_h,
    inv_rms,
    eps,
    M,
    K,
    k0,
    m3,
    k3,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    ONE_STEP: tl.constexpr,
):
    """acc + the products of the K step at k0: w against x's tile.
    GATED: x = silu(gate) * up, from the halves of a [M, 2K] row, rounded to x's dtype as the unfused
    activation hands it over (every program recomputes it: x is a few KB, the weight is the cost).
    NORM: x = norm weight * (h * inv_rms), h = x + update, each product rounded to x's dtype as
    RMSNorm's eager forward rounds it; program 0 (store_h) also writes h. ONE_STEP: the tile holds
    the whole row, and inv_rms comes from it (x, update and the norm weight load in one round trip)."""
    if EVEN_K:
        x_mask = m3 < M
    else:
        x_mask = (m3 < M) & (k0 + k3 < K)
    if NORM:
        h = _residual_sum(x_ptrs + k0, u_ptrs + k0, x_mask)
        norm_w = tl.load(
            nw_ptr + k0 + k3, mask=k0 + k3 < K, other=0.0
        )  # before the branch: one round trip
        if store_h:
            tl.store(h_ptrs + k0, h, mask=x_mask)
        if ONE_STEP:
            h32 = h.to(tl.float32)
            inv_rms = tl.rsqrt(tl.sum(h32 * h32, axis=2) / K + eps)[:, :, None]
        x = (h.to(tl.float32) * inv_rms).to(h.dtype)
        x = (norm_w.to(tl.float32) * x.to(tl.float32)).to(h.dtype)
    else:
        x = tl.load(x_ptrs + k0, mask=x_mask, other=0.0)
    if GATED:
        gate = x.to(tl.float32)
        up = tl.load(x_ptrs + k0 + K, mask=x_mask, other=0.0).to(tl.float32)
        x = (gate * tl.sigmoid(gate) * up).to(x.dtype)
    return acc + tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=2)


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
    skinny_gemm_kernel[grid](
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

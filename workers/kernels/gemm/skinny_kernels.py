# The skinny GEMM's Triton kernel and its jitted helpers, and nothing else: the design, the launchers,
# the gate and the policy are in skinny_gemm.py, the launch configs in skinny_configs.py.

import triton
import triton.language as tl


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

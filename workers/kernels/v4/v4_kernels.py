"""DeepSeek-V4's Triton kernels over its per-token cache rows (workers/layers/v4_attention.py):

- `v4_pool`: the compressor. For each row, the softmax over a window's tokens (per channel) of
  gate + ape weights their kv; the pooled row is RMS-normalised (times the norm weight). A CSA
  window pools 2 * rate slots: the previous window's tokens through the first half of the
  projections (ignored for window 0), then its own through the second half.
- `v4_index_scores`: the lightning indexer's score of each (query row, compressed entry):
  sum_h w_h * relu(q_h . k) * scale; -inf where the entry is not given (slot < 0).
- `v4_sparse_attention`: each query row's attention over the keys it is given (the window's and
  the picked compressed entries, as element offsets into the cache; < 0: none), with the head's
  sink logit in the softmax and the keys as the values.

Rows are gathered through slots / offsets given on the device, so a launch depends on the row
count alone. The top-k between the scores and the attention is torch's. Shapes (n = query rows):
  rows      [num_slots, width] the cache's rows (any dtype; the arithmetic is float32)
  slots     [n, span] int64 the window's token slots of each row (span = rate, or 2 * rate)
  q         [n, H, D];  iq [n, Hi, Di];  iw [n, Hi] float32;  sinks [H] float32
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# window slots the compressor's kernel pools per loop iteration (a [POOL_BLOCK_J, head_dim] tile of
# kv and of gate in registers)
POOL_BLOCK_J = 8
# The sparse attention's plan: query heads a program (None: up to 64, the whole head set of
# DeepSeek-V4-Flash's 64 heads on one rank, whose [64, 512] float32 accumulator spills), warps, and
# with ATTN_TENSOR_CORES the products in the model's 16-bit dtype (else float32 FMA).
# Named plans, (ATTN_HEAD_TILE, ATTN_WARPS, ATTN_TENSOR_CORES), that the benchmarks choose from.
ATTN_PLANS = {
    "h64": (None, 4, False),
    "h16": (16, 4, False),
    "h16-tc": (16, 4, True),
    "h16-tc-w8": (16, 8, True),
    "h32-tc-w8": (32, 8, True),
}
# 16 heads a program with tensor-core products: on an H100 at V4-Flash's 64 heads of 512, 128 window
# keys + 16 entries, 22.0 us at 1 row and 884.7 us at 2048 rows, against the 64-head float32 plan's
# 2333.4 and 68149.5 us (benchmarks/bench_v4_kernels.py, 6185488); the products differ from float32
# FMA's by a bfloat16 rounding (max 0.0039 at 1 row).
DEFAULT_ATTN_PLAN = "h16-tc"
ATTN_HEAD_TILE, ATTN_WARPS, ATTN_TENSOR_CORES = ATTN_PLANS[DEFAULT_ATTN_PLAN]


def use_attn_plan(name: str) -> None:
    """Launch the sparse attention with the named plan of ATTN_PLANS from now on."""
    global ATTN_HEAD_TILE, ATTN_WARPS, ATTN_TENSOR_CORES
    ATTN_HEAD_TILE, ATTN_WARPS, ATTN_TENSOR_CORES = ATTN_PLANS[name]


@triton.jit
def _v4_pool_kernel(
    rows_ptr,
    slots_ptr,  # [n, SPAN] int64
    windows_ptr,  # [n] int64: the window each row pools (< 0: none, zeros)
    ape_ptr,  # [RATE, C * D] float32
    norm_ptr,  # [D] float32
    out_ptr,  # [n, D]
    row_stride,
    kv_col,
    gate_col,
    eps,
    D: tl.constexpr,
    RATE: tl.constexpr,
    C: tl.constexpr,  # 2: overlapping (CSA) windows, 1: HCA
    BLOCK_D: tl.constexpr,
    BLOCK_J: tl.constexpr,  # window slots per iteration
):
    i = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    w = tl.load(windows_ptr + i)
    if w < 0:  # a row that ends no window (most decode steps' rows): zeros, no slot read
        tl.store(
            out_ptr + i * D + d,
            tl.zeros([BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
            mask=dm,
        )
        return
    m = tl.full([BLOCK_D], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    # a loop over tiles of slots, not unrolled per slot: its code does not grow with the rate
    # (an unrolled rate-128 window took minutes to compile)
    for j0 in range(0, C * RATE, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        jm = j < C * RATE
        slot = tl.load(slots_ptr + i * (C * RATE) + j, mask=jm, other=-1)
        use = jm & (slot >= 0)
        # CSA: the previous window's tokens (none for window 0) through the first half of the
        # projections, then the own window's through the second half
        ch = (j // RATE) * D
        if C == 2:
            use = use & ((j >= RATE) | ((j * 0 + w) > 0))
        lm = use[:, None] & dm[None, :]
        base = rows_ptr + slot.to(tl.int64)[:, None] * row_stride + ch[:, None] + d[None, :]
        kv = tl.load(base + kv_col, mask=lm, other=0.0).to(tl.float32)
        g = tl.load(base + gate_col, mask=lm, other=0.0).to(tl.float32)
        ape = ape_ptr + (j % RATE)[:, None] * (C * D) + ch[:, None] + d[None, :]
        g = g + tl.load(ape, mask=jm[:, None] & dm[None, :], other=0.0)
        g = tl.where(lm, g, float("-inf"))
        m_new = tl.maximum(m, tl.max(g, axis=0))
        alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
        p = tl.where(lm, tl.exp(g - m_new[None, :]), 0.0)
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * kv, axis=0)
        m = m_new
    pooled = tl.where(dm, acc / tl.where(l_sum > 0, l_sum, 1.0), 0.0)
    rms = tl.sqrt(tl.sum(pooled * pooled, axis=0) / D + eps)
    weight = tl.load(norm_ptr + d, mask=dm, other=0.0)
    tl.store(out_ptr + i * D + d, (pooled / rms * weight).to(out_ptr.dtype.element_ty), mask=dm)


def pool_constexprs(d: int, rate: int, overlap: bool) -> dict[str, int]:
    """The compressor kernel's compile-time arguments for entries d wide pooled over windows of
    `rate` tokens (overlapping: CSA's 2 * rate slots)."""
    c = 2 if overlap else 1
    block_j = min(POOL_BLOCK_J, triton.next_power_of_2(c * rate))
    return dict(D=d, RATE=rate, C=c, BLOCK_D=triton.next_power_of_2(d), BLOCK_J=block_j)


def v4_pool(
    rows: torch.Tensor,
    slots: torch.Tensor,
    windows: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    kv_col: int,
    gate_col: int,
    eps: float,
    overlap: bool,
    out: torch.Tensor,
) -> torch.Tensor:
    """out [n, D] <- the normalised pooled entry of each row's window `windows` [n] (not yet
    rotated); zeros for a row whose window is < 0, which reads no slot."""
    n, d = out.shape
    rate = ape.shape[0]
    if n:
        _v4_pool_kernel[(n,)](
            rows,
            slots.contiguous(),
            windows.contiguous(),
            ape.float().contiguous(),
            norm_weight.float().contiguous(),
            out,
            rows.stride(0),
            kv_col,
            gate_col,
            eps,
            **pool_constexprs(d, rate, overlap),
        )
    return out


@triton.jit
def index_tile_scores(
    q_ptr,  # [n, H, DI]
    w_ptr,  # [n, H] float32
    rows_ptr,
    slot,  # [BLOCK_T] the keys' rows
    valid,  # [BLOCK_T]
    i,  # the query row
    row_stride,
    col,
    scale,
    H: tl.constexpr,
    DI: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The lightning indexer's scores [BLOCK_T] float32 of query row i against the keys at
    columns col.. of the rows `slot` names (0 where not `valid`)."""
    d = tl.arange(0, BLOCK_D)
    dm = d < DI
    keys = tl.load(
        rows_ptr + slot.to(tl.int64)[:, None] * row_stride + col + d[None, :],
        mask=valid[:, None] & dm[None, :],
        other=0.0,
    ).to(tl.float32)
    acc = tl.zeros([BLOCK_T], tl.float32)
    for h in range(H):
        qh = tl.load(q_ptr + (i * H + h) * DI + d, mask=dm, other=0.0).to(tl.float32)
        s = tl.maximum(tl.sum(keys * qh[None, :], axis=1), 0.0) * scale
        acc += s * tl.load(w_ptr + i * H + h)
    return acc


@triton.jit
def _v4_index_scores_kernel(
    q_ptr,  # [n, H, DI]
    w_ptr,  # [n, H] float32
    rows_ptr,
    eslots_ptr,  # [n, T] int64, < 0: no entry
    out_ptr,  # [n, T] float32
    row_stride,
    col,
    scale,
    T,
    H: tl.constexpr,
    DI: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    slot = tl.load(eslots_ptr + i * T + t, mask=tm, other=-1)
    valid = tm & (slot >= 0)
    acc = tl.zeros([BLOCK_T], tl.float32)
    # a tile past the row's entries (a graph-safe launch covers every entry a row could have)
    # only stores -inf
    if tl.max(valid.to(tl.int32), axis=0) > 0:
        acc = index_tile_scores(q_ptr, w_ptr, rows_ptr, slot, valid, i, row_stride, col, scale,
                                H, DI, BLOCK_T, BLOCK_D)  # fmt: skip
    tl.store(out_ptr + i * T + t, tl.where(valid, acc, float("-inf")), mask=tm)


def v4_index_scores(
    iq: torch.Tensor, iw: torch.Tensor, rows: torch.Tensor, entry_slots: torch.Tensor, col: int
) -> torch.Tensor:
    """[n, T] float32 indexer scores of each row's entries (the rows `entry_slots` [n, T] name,
    their keys at column `col`); -inf where a slot is < 0."""
    n, h, di = iq.shape
    t = entry_slots.shape[1]
    out = torch.empty(n, t, dtype=torch.float32, device=iq.device)
    if n and t:
        block_t = min(64, triton.next_power_of_2(t))
        _v4_index_scores_kernel[(n, triton.cdiv(t, block_t))](
            iq.contiguous(),
            iw.float().contiguous(),
            rows,
            entry_slots.contiguous(),
            out,
            rows.stride(0),
            col,
            di**-0.5,
            t,
            H=h,
            DI=di,
            BLOCK_T=block_t,
            BLOCK_D=triton.next_power_of_2(di),
        )
    return out


@triton.jit
def _v4_sparse_attn_kernel(
    q_ptr,  # [n, H, D]
    rows_ptr,  # flat cache elements
    koff_ptr,  # [n, K] int64 element offsets of each key row, < 0: none
    sink_ptr,  # [H] float32
    out_ptr,  # [n, H, D]
    lens_ptr,  # HAS_LENS: [n] each row's count of keys (its first offsets; the rest unread)
    scale,
    K,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,  # the products in float32 (else in q's dtype, on tensor cores)
    HAS_LENS: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(
        q_ptr + (i * H + h[:, None]) * D + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    m = tl.load(sink_ptr + h, mask=hm, other=0.0)  # the sink: a logit whose value is zero
    l_sum = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    num_keys = K
    if HAS_LENS:  # the loop stops at the row's last key, not at the fixed width's end
        num_keys = tl.minimum(tl.maximum(tl.load(lens_ptr + i), 0), K)
    for k0 in range(0, num_keys, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        off = tl.load(koff_ptr + i * K + k, mask=k < num_keys, other=-1)
        valid = off >= 0
        # a block of masked keys adds nothing: skipped (a fixed-width entry list is mostly mask)
        if tl.max(off, axis=0) >= 0:
            keys = tl.load(
                rows_ptr + off[:, None] + d[None, :], mask=valid[:, None] & dm[None, :], other=0.0
            )
            if FP32_DOT:
                keys = keys.to(tl.float32)
                s = tl.dot(q, tl.trans(keys), input_precision="ieee")
            else:
                keys = keys.to(q.dtype)
                s = tl.dot(q, tl.trans(keys))
            s = tl.where(valid[None, :], s * scale, float("-inf"))  # [BLOCK_H, BLOCK_K]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            if FP32_DOT:
                pv = tl.dot(p, keys, input_precision="ieee")
            else:
                pv = tl.dot(p.to(keys.dtype), keys)
            acc = acc * alpha[:, None] + pv
            m = m_new
    out = acc / l_sum[:, None]
    tl.store(
        out_ptr + (i * H + h[:, None]) * D + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hm[:, None] & dm[None, :],
    )


def attn_plan(num_heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """The sparse attention's compile-time arguments and warps for `num_heads` query heads of
    `head_dim` in `dtype`: `ATTN_HEAD_TILE` heads a program (None: up to 64) and, under
    `ATTN_TENSOR_CORES` with a 16-bit q, its products in q's dtype."""
    tile = ATTN_HEAD_TILE or min(64, triton.next_power_of_2(num_heads))
    return dict(
        BLOCK_H=max(16, min(tile, triton.next_power_of_2(num_heads))),
        BLOCK_K=16,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        FP32_DOT=not ATTN_TENSOR_CORES or dtype == torch.float32,
        num_warps=ATTN_WARPS,
    )


def v4_sparse_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    key_offsets: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    key_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """out [n, H, D] <- each row's softmax (with the head's sink) over the keys at `key_offsets`
    [n, K] (element offsets into `rows`, whose D columns from there are the key and the value).
    `key_lens` [n] (read on the device): row i attends its first key_lens[i] offsets alone, its
    program stopping there (for a fixed-width list whose tail is -1: the keys before the tail);
    without it every program walks all K (a masked block is skipped, but its offsets are read)."""
    n, h, d = q.shape
    k = key_offsets.shape[1]
    if n:
        plan = attn_plan(h, d, q.dtype)
        lens = key_offsets if key_lens is None else key_lens.contiguous()
        _v4_sparse_attn_kernel[(n, triton.cdiv(h, plan["BLOCK_H"]))](
            q.contiguous(),
            rows,
            key_offsets.contiguous(),
            sinks.float().contiguous(),
            out,
            lens,
            scale,
            k,
            H=h,
            D=d,
            HAS_LENS=key_lens is not None,
            **plan,
        )
    return out

# MLA's absorbed-weight products at decode sizes, one launch for every head:
#   mla_absorb      - out[h, i, :] = x[h, i, :] @ w[h] for the n rows of each head h: W_UK's product
#                     (q_nope [H, n, qk_nope] @ w_uk [H, qk_nope, L]) and W_UV's (the attention's
#                     latent heads [H, n, L] @ w_uv [H, L, v]) of absorbed_decode (layers/mla.py)
#   plan_mla_absorb - its column tile, reduction tile and warps, from the weight shape and SMs
#   absorb_fits     - whether a product is one the kernel takes (n <= SKINNY_MAX, Triton can run)
# At a few rows the products are a read of the weights (2 MiB of bf16 each on V2-Lite's 16 heads)
# for a few hundred FLOPs, which cuBLAS's batched GEMM serves latency-bound (about 3.4 us a call on
# an H100 at n = 1). Here each program keeps all n rows of one head and one block of output columns,
# and walks the reduction once: the weights are read once, by as many programs as fill the SMs.
# Input rows and output rows may be strided (q_nope is a column slice of q, transposed; W_UV's
# product writes into the layer's output transposed), so nothing is copied. Importing this module
# needs no GPU.

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atomrt.workers.kernels.device_info import sm_count
from atomrt.workers.kernels.launch import launch, triton_interpreted, triton_runs_on

# rows (decode tokens) up to which absorbed_decode takes the kernel when MLA_ABSORB_KERNEL is on;
# past it torch.bmm (a real GEMM by then). A tl.dot launch holds its rows in a tile of at least 16
# rows (tl.dot's smallest), so every count up to 16 runs the same compiled variant.
SKINNY_MAX = 16
MIN_BLOCK_M = 16
MAX_BLOCK_N = 128
MIN_BLOCK_N = 16
MAX_BLOCK_K = 128


@dataclass(frozen=True)
class MLAAbsorbLaunch:
    """One launch of mla_absorb_kernel: output columns and reduction rows a program takes at a
    time, warps and pipeline stages. A launch of at most `broadcast_max_rows` rows multiplies by
    broadcast and sum in registers (its rows in a tile of the next power of two) instead of
    tl.dot (whose operands pass through shared memory): 0, tl.dot always, until a GPU sweep
    (bench_mla_absorb.py --sweep) shows the other faster at one row."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    broadcast_max_rows: int = 0


@functools.lru_cache(maxsize=256)
def plan_mla_absorb(num_heads: int, k: int, n_cols: int, num_sms: int) -> MLAAbsorbLaunch:
    """The widest column tile (MIN_BLOCK_N..MAX_BLOCK_N) whose (head, column block) programs are
    at least as many as the SMs, so that the weight read is spread over all of them (V2-Lite's 16
    heads on an H100: W_UK's 512 columns in tiles of 32, 256 programs; W_UV's 128 in the narrowest
    tile, 16, 128 programs); the reduction in tiles of up to MAX_BLOCK_K."""
    block_n = MAX_BLOCK_N
    while block_n > MIN_BLOCK_N and num_heads * triton.cdiv(n_cols, block_n) < num_sms:
        block_n //= 2
    block_n = max(MIN_BLOCK_N, min(block_n, triton.next_power_of_2(max(1, n_cols))))
    block_k = max(16, min(MAX_BLOCK_K, triton.next_power_of_2(max(1, k))))
    return MLAAbsorbLaunch(block_n=block_n, block_k=block_k)


@triton.jit(do_not_specialize=["n_rows"])
def mla_absorb_kernel(
    x_ptr,  # [H, n, K], unit stride along K
    w_ptr,  # [H, K, N], unit stride along N
    out_ptr,  # [H, n, N], unit stride along N
    n_rows,
    k_dim,
    n_cols,
    stride_xh,
    stride_xi,
    stride_wh,
    stride_wk,
    stride_oh,
    stride_oi,
    BLOCK_M: tl.constexpr,  # >= n_rows, a power of two (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # K % BLOCK_K == 0 and N % BLOCK_N == 0: unmasked weight loads
    IEEE_DOT: tl.constexpr,  # float32 inputs: full-precision dots instead of tf32
    UPCAST: tl.constexpr,  # dot float32 copies of the operands (bf16 under the interpreter)
    DOT: tl.constexpr,  # tl.dot; else broadcast products summed over the reduction tile
):
    """Program (h, j): out[h, :n, j * BLOCK_N : (j + 1) * BLOCK_N] = x[h, :n] @ w[h, :, that
    block], accumulated in float32 and stored in out's dtype."""
    h = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + h * stride_xh + rows[:, None] * stride_xi
    w_cols = w_ptr + h * stride_wh + cols[None, :]
    row_ok = rows[:, None] < n_rows
    col_ok = cols[None, :] < n_cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        kk = k0 + ks
        if EVEN:
            x = tl.load(x_rows + kk[None, :], mask=row_ok, other=0.0)
            w = tl.load(w_cols + kk[:, None] * stride_wk)
        else:
            k_ok = kk < k_dim
            x = tl.load(x_rows + kk[None, :], mask=row_ok & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + kk[:, None] * stride_wk, mask=k_ok[:, None] & col_ok, other=0.0)
        if not DOT:
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        elif UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        elif IEEE_DOT:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    out = out_ptr + h * stride_oh + rows[:, None] * stride_oi + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok & col_ok)


def absorb_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether mla_absorb takes x [H, n, K] @ w [H, K, N]: at most SKINNY_MAX rows, one dtype, on
    a device Triton runs on (CUDA, or any under Triton's interpreter)."""
    return x.shape[1] <= SKINNY_MAX and x.dtype == w.dtype and triton_runs_on(x)


def mla_absorb(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, plan: MLAAbsorbLaunch | None = None
) -> torch.Tensor:
    """out[h] = x[h] @ w[h] (torch.bmm(x, w, out=out)) for x [H, n, K], w [H, K, N] and out
    [H, n, N], each of unit stride along its last dimension and any other strides; float32
    accumulation, rounded to out's dtype. `plan` forces a launch (the benchmark's sweep); None
    plans it from the weight shape. Returns `out`."""
    if x.dim() != 3 or w.dim() != 3 or out.dim() != 3:
        raise ValueError(
            f"mla_absorb: want x [H, n, K], w [H, K, N], out [H, n, N], have {tuple(x.shape)}, "
            f"{tuple(w.shape)}, {tuple(out.shape)}"
        )
    num_heads, n_rows, k_dim = x.shape
    n_cols = w.shape[2]
    if w.shape[:2] != (num_heads, k_dim) or tuple(out.shape) != (num_heads, n_rows, n_cols):
        raise ValueError(
            f"mla_absorb: shapes do not chain: x {tuple(x.shape)} @ w {tuple(w.shape)} -> out "
            f"{tuple(out.shape)}"
        )
    if x.dtype != w.dtype:
        raise ValueError(f"mla_absorb: x is {x.dtype}, w {w.dtype}: want one dtype")
    for t, name in ((x, "x"), (w, "w"), (out, "out")):
        if t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(
                f"mla_absorb: {name} must be contiguous in its last dimension, has stride "
                f"{t.stride(2)}"
            )
    if not num_heads or not n_rows or not n_cols:
        return out
    if plan is None:
        plan = plan_mla_absorb(num_heads, k_dim, n_cols, sm_count(x.device))
    dot = n_rows > plan.broadcast_max_rows
    block_m = triton.next_power_of_2(n_rows)
    if dot:
        block_m = max(MIN_BLOCK_M, block_m)
    even = k_dim % plan.block_k == 0 and n_cols % plan.block_n == 0
    launch(
        mla_absorb_kernel,
        (num_heads, triton.cdiv(n_cols, plan.block_n)),
        x,
        w,
        out,
        n_rows,
        k_dim,
        n_cols,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k,
        EVEN=even,
        IEEE_DOT=x.dtype == torch.float32,
        # Triton's interpreter multiplies bfloat16 tl.dot operands as raw bit patterns
        # (triton-lang/triton#11584): there they are widened to float32 (exact products, as the
        # compiled bf16 dot's, accumulated in float32 alike)
        UPCAST=x.dtype == torch.bfloat16 and triton_interpreted(),
        DOT=dot,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    return out

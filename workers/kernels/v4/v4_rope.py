# Hot path (worker, four or five times per DeepSeek-V4 layer): the partial rotary embedding.
# What may live here: one launch planned from shapes alone (a CUDA graph records it).
"""DeepSeek-V4's rotary embedding of a head's trailing channels (workers/layers/v4_modules.py's
`rope_tail`) in one launch: each row's leading channels copied, its trailing 2 * half rotated in
interleaved pairs in float32,

    (x1, x2) -> (x1 * cos - x2 * sin, x2 * cos + x1 * sin)

with one (cos, sin) of `half` angles per token, shared by the token's heads. torch takes some ten
small kernels a call (the widening, four products, the sum and difference, the interleave, the
narrowing and the concatenation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _v4_rope_tail_kernel(
    x_ptr,  # [rows, D], rows = tokens x heads
    cos_ptr,  # [tokens, HALF]
    sin_ptr,  # [tokens, HALF]
    out_ptr,  # [rows, D]
    heads,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    t = r // heads
    nope: tl.constexpr = D - 2 * HALF
    d = tl.arange(0, BLOCK_D)
    keep = d < nope
    tl.store(out_ptr + r * D + d, tl.load(x_ptr + r * D + d, mask=keep), mask=keep)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    first = r * D + nope + 2 * j
    x1 = tl.load(x_ptr + first, mask=jm, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + first + 1, mask=jm, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * HALF + j, mask=jm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * HALF + j, mask=jm, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + first, (x1 * c - x2 * s).to(dtype), mask=jm)
    tl.store(out_ptr + first + 1, (x2 * c + x1 * s).to(dtype), mask=jm)


def v4_rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, D] or [n, H, D]; cos, sin [n, half] (or [n, 1, half] against [n, H, D]) -> x with
    its trailing 2 * half channels rotated (a new tensor in x's dtype)."""
    half, d = cos.shape[-1], x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.reshape(-1, d)
    cos, sin = cos.reshape(-1, half), sin.reshape(-1, half)
    assert cos.shape[0] * heads == rows.shape[0] and sin.shape == cos.shape, (x.shape, cos.shape)
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _v4_rope_tail_kernel[(rows.shape[0],)](
            rows.contiguous(),
            cos.contiguous(),
            sin.contiguous(),
            out,
            heads,
            D=d,
            HALF=half,
            BLOCK_D=triton.next_power_of_2(max(d - 2 * half, 1)),
            BLOCK_HALF=triton.next_power_of_2(half),
            num_warps=1,
        )
    return out.view(x.shape)

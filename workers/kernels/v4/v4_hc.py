# Hot path (worker, twice per DeepSeek-V4 layer): the hyper-connections' mixing weights.
# What may live here: one launch planned from shapes alone (a CUDA graph records it).
"""DeepSeek-V4's mHC mixing weights of a block in one launch (workers/layers/v4_hyper.py has the
formulas): from each row's hc + hc + hc * hc mixing logits,

    pre  = sigmoid(l_pre * s0 + b_pre) + eps
    post = 2 * sigmoid(l_post * s1 + b_post)
    comb = Sinkhorn-Knopp(softmax(l_comb * s2 + b_comb) + eps)

one program per row, its hc x hc matrix in registers through every Sinkhorn iteration, where torch
takes some 120 small kernels a block (six per iteration). float32 throughout, as the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _v4_hc_mix_kernel(
    mix_ptr,  # [n, (2 + HC) * HC] float32 logits: pre | post | comb (row-major hc x hc)
    scale_ptr,  # [3] float32
    base_ptr,  # [(2 + HC) * HC] float32
    pre_ptr,  # [n, HC] float32
    post_ptr,  # [n, HC] float32
    comb_ptr,  # [n, HC, HC] float32
    eps,
    iters,
    HC: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    width: tl.constexpr = (2 + HC) * HC
    j = tl.arange(0, HC)
    row = mix_ptr + i * width
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    pre = tl.sigmoid(tl.load(row + j) * s0 + tl.load(base_ptr + j)) + eps
    post = 2 * tl.sigmoid(tl.load(row + HC + j) * s1 + tl.load(base_ptr + HC + j))
    tl.store(pre_ptr + i * HC + j, pre)
    tl.store(post_ptr + i * HC + j, post)
    cell = 2 * HC + j[:, None] * HC + j[None, :]  # [HC, HC]: (r, c) at r * HC + c
    logits = tl.load(row + cell) * s2 + tl.load(base_ptr + cell)
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + eps  # softmax over each row's columns
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)  # the columns, then rows and columns
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    tl.store(comb_ptr + i * HC * HC + j[:, None] * HC + j[None, :], comb)


def v4_hc_mix(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [n, (2 + hc) * hc] float32 -> (pre [n, hc], post [n, hc], comb [n, hc, hc]);
    hc a power of two."""
    n = mixes.shape[0]
    pre = mixes.new_empty(n, hc)
    post = mixes.new_empty(n, hc)
    comb = mixes.new_empty(n, hc, hc)
    if n:
        _v4_hc_mix_kernel[(n,)](
            mixes.contiguous(), scale, base, pre, post, comb, eps, iters, HC=hc, num_warps=1
        )
    return pre, post, comb

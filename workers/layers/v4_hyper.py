"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual is `hc_mult` streams
per token, [n, hc, hidden], that each block reads collapsed and writes back expanded.

Per block, from the streams X (flattened to hc * hidden and RMS-normalised without a weight):
one projection `fn` gives hc + hc + hc * hc mixing logits, which with `scale` and `base` become

    pre  = sigmoid(l_pre * s0 + b_pre) + eps                     (collapse: block input = sum_j pre_j X_j)
    post = 2 * sigmoid(l_post * s1 + b_post)                     (expand: the block's output times post_k)
    comb = Sinkhorn-Knopp(softmax(l_comb * s2 + b_comb) + eps)   (mix: X'_k = sum_j comb_jk X_j)

and the block's output streams are post_k * F(input) + sum_j comb_jk X_j. Sinkhorn-Knopp divides
comb's columns, then `hc_sinkhorn_iters - 1` times its rows and columns, by their sums (+ eps): a
doubly-stochastic matrix, so the mix neither grows nor shrinks the streams. The hyper head, before
the final norm, is a collapse alone (its own `pre`). Every weight here is float32, and so is the
arithmetic (transformers keeps these modules in float32 whatever the model's dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension (no weight), in float32, rounded once to x's dtype.
    torch's rms_norm: on CUDA one fused kernel, where a widened copy of x and its square would
    each take twice a 16-bit x's bytes (a prefill's queries [n, heads, head_dim]: the bulk of
    DeepSeek-V4-Flash's activation peak)."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def sinkhorn_knopp(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., hc, hc] positive -> doubly stochastic: columns, then (iters - 1) x (rows, columns)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """One block's mHC weights; its parameters are the checkpoint's `hc_<block>_fn`, `_base`,
    `_scale` (registered by the decoder layer under those names)."""

    def __init__(
        self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float
    ) -> None:
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        n = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(n, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [n, hc, hidden] -> (post [n, hc], comb [n, hc, hc] float32, the collapsed block
        input [n, hidden] in the streams' dtype)."""
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn)  # [n, (2 + hc) * hc]
        if _use_mix_kernel(mixes, self.hc):
            from atomrt.workers.kernels.v4.v4_hc import v4_hc_mix

            pre, post, comb = v4_hc_mix(
                mixes, self.scale, self.base, self.hc, self.iters, self.hc_eps
            )
        else:
            pre, post, comb = hc_mix(mixes, self.scale, self.base, self.hc, self.iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


# The mixing weights in one Triton launch (workers/kernels/v4/v4_hc.py) rather than some 120 small
# torch kernels a block (eager CUDA, and what a CUDA graph records at level 0; traced, Inductor
# fuses the torch ones): on an H100, 3.88 against 192.99 us at 1 row, 4.96 against 233.02 us at
# 2048 (benchmarks/bench_v4_kernels.py, 6185488).
HC_MIX_KERNEL = True


def _use_mix_kernel(mixes: torch.Tensor, hc: int) -> bool:
    return (
        HC_MIX_KERNEL and mixes.is_cuda and hc & (hc - 1) == 0 and not torch.compiler.is_compiling()
    )


def hc_mix(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [n, (2 + hc) * hc] float32 logits -> (pre [n, hc], post [n, hc], comb [n, hc, hc])."""
    l_pre, l_post, l_comb = mixes.split([hc, hc, hc * hc], dim=-1)
    b_pre, b_post, b_comb = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(l_pre * scale[0] + b_pre) + eps
    post = 2 * torch.sigmoid(l_post * scale[1] + b_post)
    comb = torch.softmax(l_comb.view(-1, hc, hc) * scale[2] + b_comb.view(hc, hc), dim=-1) + eps
    return pre, post, sinkhorn_knopp(comb, iters, eps)


def hyper_residual(
    streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The block's output streams: post_k * out + sum_j comb_jk streams_j, [n, hc, hidden]."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The last collapse of the streams, before the final norm: sum_j pre_j X_j with
    pre = sigmoid(fn(rms(X)) * scale + base) + eps."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base)
        pre = pre + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

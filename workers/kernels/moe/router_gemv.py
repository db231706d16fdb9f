# Hot path (worker, once per MoE layer when deepseek_moe.ROUTER_KERNEL is on): DeepSeekMoE's float32
# router projection of a decode step's few tokens in one launch.
# No `from __future__ import annotations` here: the op's schema is inferred from real annotations.
"""`router_logits`: DeepSeekMoE's router logits [n, E] float32 = x [n, K] @ W [E, K]^T, W float32
(workers/layers/deepseek_moe.py, `GroupedRouter`), x in the model's dtype widened in the kernel,
products summed in float32.

cuBLAS runs `F.linear(x.float(), W)` at decode sizes as a split-K GEMV of two launches (a dot
kernel, then a reduce), plus the widening copy of x: three launches for a projection whose whole
cost is reading W once (V2-Lite: 64 x 2048 float32, 512 KiB; V3: 256 x 7168, 7 MiB). Here one
launch of one program per BLOCK_E experts reads its rows of W once, in BLOCK_K steps, against all n
tokens' x (a few KB, from L2): W's bytes are spread over E / BLOCK_E programs, no split over K, so
no second launch, workspace or atomics. The tiles are 3-D ([BLOCK_E, BLOCK_N, BLOCK_K]) and the
step's products are summed over K into a [BLOCK_E, BLOCK_N] accumulator.

For n <= ROUTER_GEMV_MAX_TOKENS on a device Triton runs on (CUDA, or any under Triton's
interpreter); F.linear otherwise. The launch depends only on shapes and dtypes, never on data:
capturable. The token count is not specialized on (`do_not_specialize`): a model compiles one
variant per padded token count (1, 2, 4, 8, 16), each at its first launch, which the capture sizes'
warm-ups (and the eager warm-up batches) make before any graph is recorded, as for `grouped_topk`.

`torch.ops.atomrt.router_logits` wraps it for traced models: opaque to Dynamo (the token count is
decided inside, at run time: no guard on a dynamic batch), its fake gives the output shape.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atomrt.compile.custom_register import direct_register_custom_op
from atomrt.workers.kernels.launch import triton_runs_on

ROUTER_GEMV_MAX_TOKENS = 16  # above it, cuBLAS's GEMM (the weight is re-read per program here)
_X_TILE_ELEMS = 4096  # BLOCK_N * BLOCK_K: the x tile a program holds per step (32 floats a thread)


@dataclass(frozen=True)
class RouterConfig:
    """A launch of the router kernel: experts per program, K per step, warps, pipeline stages."""

    block_e: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    sum_last: bool = False  # keep the products per K lane, summed over K once after the loop


def router_config(num_tokens: int, num_experts: int, hidden: int) -> RouterConfig:
    """The default launch: one expert a program (V2-Lite's 64 programs, V3's 256, each one row of W),
    a K step as wide as the x tile allows, so that a program's weight comes in few round trips (at
    one token: V2-Lite's 2048-wide row in one step of 4 warps, V3's 7168 in two of 8 warps), 16
    weight values a thread a step."""
    block_n = triton.next_power_of_2(max(num_tokens, 1))
    block_k = min(triton.next_power_of_2(hidden), max(_X_TILE_ELEMS // block_n, 128))
    return RouterConfig(block_e=1, block_k=block_k, num_warps=8 if block_k >= 4096 else 4)


@triton.jit(do_not_specialize=["num_tokens"])
def router_gemv_kernel(
    x_ptr,  # [n, K], K contiguous (bfloat16, float16 or float32)
    w_ptr,  # [E, K] float32, K contiguous
    out_ptr,  # [n, E] float32
    num_tokens,
    num_experts,
    hidden,
    stride_x,
    stride_w,
    stride_o,
    BLOCK_N: tl.constexpr,  # the token count padded to a power of two
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0: no K mask
    NUM_STAGES: tl.constexpr,
    SUM_LAST: tl.constexpr,  # sum over K once after the loop (no cross-warp sum per step)
):
    """Logits of experts pid * BLOCK_E .. + BLOCK_E for every token."""
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    tokens = tl.arange(0, BLOCK_N)
    e3 = experts[:, None, None]
    t3 = tokens[None, :, None]
    k3 = tl.arange(0, BLOCK_K)[None, None, :]
    w_ptrs = w_ptr + e3.to(tl.int64) * stride_w + k3  # [BLOCK_E, 1, BLOCK_K]
    x_ptrs = x_ptr + t3.to(tl.int64) * stride_x + k3  # [1, BLOCK_N, BLOCK_K]
    e_valid = e3 < num_experts
    t_valid = t3 < num_tokens
    if SUM_LAST:
        acc = tl.zeros([BLOCK_E, BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k0, mask=e_valid, other=0.0)
            x = tl.load(x_ptrs + k0, mask=t_valid, other=0.0)
        else:
            k_valid = k0 + k3 < hidden
            w = tl.load(w_ptrs + k0, mask=e_valid & k_valid, other=0.0)
            x = tl.load(x_ptrs + k0, mask=t_valid & k_valid, other=0.0)
        if SUM_LAST:
            acc += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=2)
    if SUM_LAST:
        logits = tl.sum(acc, axis=2)
    else:
        logits = acc
    out_ptrs = out_ptr + tokens[None, :].to(tl.int64) * stride_o + experts[:, None]
    tl.store(
        out_ptrs, logits, mask=(experts < num_experts)[:, None] & (tokens < num_tokens)[None, :]
    )


def router_gemv(
    x: torch.Tensor, weight: torch.Tensor, config: Optional[RouterConfig] = None
) -> torch.Tensor:
    """[n, K] x (any float dtype), [E, K] float32 weight -> [n, E] float32 logits, one launch of
    the kernel (whatever n: `router_logits` keeps it to small n)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"router_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [n, K] "
            "and [E, K]"
        )
    if weight.dtype != torch.float32:
        raise ValueError(f"router_gemv: the router weight must be float32, got {weight.dtype}")
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    out = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_experts == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    cfg = config or router_config(num_tokens, num_experts, hidden)
    router_gemv_kernel[(triton.cdiv(num_experts, cfg.block_e),)](
        x, weight, out, num_tokens, num_experts, hidden, x.stride(0), weight.stride(0),
        out.stride(0),
        BLOCK_N=triton.next_power_of_2(num_tokens),
        BLOCK_E=cfg.block_e,
        BLOCK_K=cfg.block_k,
        EVEN_K=hidden % cfg.block_k == 0,
        NUM_STAGES=cfg.num_stages,
        SUM_LAST=cfg.sum_last,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x.float(), weight)` for the float32 router: the kernel for a decode step's few
    tokens where Triton runs, F.linear otherwise."""
    if x.shape[0] <= ROUTER_GEMV_MAX_TOKENS and triton_runs_on(x):
        return router_gemv(x, weight)
    return F.linear(x.float(), weight)


def _router_logits_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


# Opaque to Dynamo: the kernel-or-GEMM choice is made on the run's token count, not traced.
direct_register_custom_op("router_logits", router_logits, fake_impl=_router_logits_fake)

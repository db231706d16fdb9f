# Paged attention for a decode batch (at most one query row per sequence), on CUDA:
#   decode_attention  - one launch of decode_attention_kernel: the rotary embedding of q and the new
#                       k, the KV write, split-KV attention, and the merge of the splits (the last
#                       program of each (sequence, KV head) merges, through per-microbatch counters)
#   attention_step    - what the attention op runs on CUDA: decode_attention for a decode batch, else
#                       paged_attention's rope_write_kv / write_kv_cache then unified attention
# Launch paths as in paged_attention.py: graph-safe (bucket values only) or host-planned. Launches
# go through a LaunchMemo (kernels/launch.py): past the first of each specialization they skip
# Triton's dispatch, and eager split launches reuse a kept workspace.
# Importing this module needs no GPU.

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from atomrt.workers.kernels import device_info
from atomrt.workers.kernels.attention.decode_kernels import decode_attention_kernel
from atomrt.workers.kernels.attention.paged_attention import (
    LOG2E,
    MAX_PARTIAL_BYTES,
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    attend_planned,
    cache_strides,
    check_attention_args,
    kv_scales_arg,
    plan_lengths,
    rope_write_kv,
    row_strides,
    unit_kv_scales,
    unit_last_stride,
    write_kv_cache,
)
from atomrt.workers.kernels.attention.workspace import kept_split_workspace
from atomrt.workers.kernels.device_info import device_scratch, sm_count, use_pdl
from atomrt.workers.kernels.launch import LaunchMemo


@dataclass(frozen=True)
class DecodeLaunch:
    """One launch of the decode kernel (one query row per sequence): tiles, KV splits, warps."""

    block_m: int  # tile rows: the group's query heads, padded to >= 16 for tl.dot
    head_dim_p: int
    tile_n: int  # keys per inner iteration
    num_splits: int  # grid dim 2; the live context decides how many of them work
    min_tiles_per_split: int
    num_warps: int
    num_stages: int
    # Over an e4m3 cache with a 16-bit q: widen keys and values to float16 and take float16
    # products (False: q's dtype, as over any other cache).
    fp8_f16_products: bool = True
    # Load each K/V tile an iteration ahead of its products (pipelined by hand); off until measured
    # faster (benchmarks/bench_decode_attention.py times both).
    prefetch_kv: bool = False
    # Over an e4m3 cache with float16 products: widen each V tile before the layout change tl.dot
    # needs, not after (16-bit shared-memory moves instead of byte reads; decode_kernels._widen_v);
    # off until measured faster (bench_decode_attention.py --kv-cache-dtype fp8 --sweep).
    widen_v_first: bool = False
    # With prefetch_kv: load the first K/V tile before the rotary's cos / sin round trip, not
    # after it, so that a short context's one tile waits on one round trip less; off until
    # measured faster (bench_decode_attention.py's fused_early).
    early_kv: bool = False

    def __post_init__(self) -> None:
        if self.early_kv and not self.prefetch_kv:
            raise ValueError(
                "DecodeLaunch: early_kv loads the prefetched first tile; set prefetch_kv"
            )
        if self.widen_v_first and self.tile_n < 32:
            # compiled for an H100, 16-key tiles widened first gave attention 0.1-0.25 off a
            # float64 reference at head_dim 32 to 128 (loaded in the loop; prefetched they held)
            raise ValueError(
                f"DecodeLaunch: widen_v_first needs tiles of at least 32 keys, got {self.tile_n}"
            )


# The e4m3 cache's launch at head_dim 128: (tile_n, num_warps, num_stages, widen_v_first, the
# programs an SM is given at that plan). Widening an e4m3 tile of 128 keys after its layout change
# took ~140 registers a thread at 8 warps: one program per SM, where the bfloat16 cache's ~90 fit
# two; V widened first, 64-key tiles in 3 stages take fewer (benchmarks/kernel_stats.py decode
# --kv-cache-dtype fp8 prints registers and programs an SM).
# FP8_PLAN_D128 serves batches that give every SM a (sequence, KV head) program (splitting them
# further to fill its programs an SM, counted with the split path compiled in where it splits);
# FP8_SPLIT_PLAN_D128 smaller batches, whose keys split to give every SM two programs. Start-up
# warms both (workers/kernels/attention/variants.py).
# Set from bench_decode_attention.py --shape "Llama-3.1-8B bs32|bs1" --ctx 8192 --kv-cache-dtype
# fp8 --sweep (H100 80GB HBM3, commit 4978fb3): at bs 32 t64w4s3v (4 warps, 4 programs an SM, 2
# splits) 244.2 us against the former 64-key, 8-warp, 1-stage plan's 343.6 (bfloat16 cache 363.6,
# t64w8s3v 307.6); at bs 1 t64w8s3v 22.14 us against 22.73 (t64w4s2v 22.51; 32 splits each).
FP8_PLAN_D128 = (64, 4, 3, True, 4)
FP8_SPLIT_PLAN_D128 = (64, 8, 3, True)
SPLIT_CHUNK = 4  # splits the merging program reads per step
DECODE_COUNTERS = 4096  # split counters per microbatch: a split launch has < num_sms (seq, KV head)
UBATCHES = 2  # two-batch overlap's microbatches, whose launches may overlap: a counter region each


@functools.lru_cache(maxsize=4096)
def plan_decode(
    num_seqs: int,
    max_seqlen_k: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    num_sms: int,
    fp8_cache: bool = False,
) -> DecodeLaunch:
    """Tiles and split count of a decode launch over contexts of at most `max_seqlen_k` keys (the KV
    capacity on the graph-safe path). Splits only when (sequence, KV head) pairs leave SMs idle, as
    plan_attention does; inside the kernel a split works only on MIN_KEYS_PER_SPLIT keys or more.
    `fp8_cache`: the caches are e4m3 (kv_cache_dtype fp8)."""
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    # 128-key tiles: fewer dependent round trips per program; faster than 64-key tiles at long
    # contexts and even at short ones (benchmarks/bench_decode_attention.py --sweep).
    tile_n = 128 if head_dim_p <= 128 else 32
    num_warps = 8 if head_dim_p >= 128 else 4
    num_stages, widen_v_first, per_sm = 2, False, 0
    num_programs = max(1, num_seqs * num_kv_heads)
    fp8_d128 = fp8_cache and head_dim_p == 128
    if fp8_d128 and num_programs < num_sms:
        tile_n, num_warps, num_stages, widen_v_first = FP8_SPLIT_PLAN_D128
    elif fp8_d128:
        tile_n, num_warps, num_stages, widen_v_first, per_sm = FP8_PLAN_D128
    num_splits = 1
    if num_programs <= DECODE_COUNTERS:
        partial_bytes = max(1, num_seqs * num_kv_heads * group * head_dim * 4)
        max_splits = min(
            MAX_SPLITS, max_seqlen_k // MIN_KEYS_PER_SPLIT, MAX_PARTIAL_BYTES // partial_bytes
        )
        if num_programs < num_sms:
            num_splits = max(1, min(max_splits, triton.cdiv(2 * num_sms, num_programs)))
        elif fp8_d128:  # every SM has a program: splits fill the SMs' program slots, one wave
            num_splits = max(1, min(max_splits, num_sms * per_sm // num_programs))
    return DecodeLaunch(
        block_m=max(16, triton.next_power_of_2(group)),
        head_dim_p=head_dim_p,
        tile_n=tile_n,
        num_splits=num_splits,
        min_tiles_per_split=max(1, MIN_KEYS_PER_SPLIT // tile_n),
        num_warps=num_warps,
        num_stages=num_stages,
        widen_v_first=widen_v_first,
    )


def prepare_decode_counters(device: torch.device) -> torch.Tensor:
    """The device's split counters (zeroed int32, UBATCHES regions of DECODE_COUNTERS), allocated on
    first use, with the unit KV cache scales (paged_attention.unit_kv_scales). Allocate them before
    any CUDA-graph capture (the KV-cache allocation does): a recording cannot zero new memory.
    Launches of one region must not overlap in time: a step's run in order on one stream; two-batch
    overlap's microbatches each use their own region."""
    unit_kv_scales(device)
    return device_scratch(
        "decode attention: split counters",
        device,
        lambda d: torch.zeros(UBATCHES * DECODE_COUNTERS, dtype=torch.int32, device=d),
        hint="call decode_attention.prepare_decode_counters(device) before capturing (allocate_kv_cache does)",
    )


def decode_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before the rotary embedding
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; rows of no sequence are left as they are
    positions: Optional[torch.Tensor],  # [num_tokens] int64, with cos/sin caches; None: no rotary
    cos_cache: Optional[torch.Tensor],  # [max_position, head_dim / 2] fp32
    sin_cache: Optional[torch.Tensor],
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = not written
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32; every sequence has 0 or 1 rows
    context_lens: torch.Tensor,  # [num_seqs] int32, including the new row
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    plan: DecodeLaunch,
    *,
    num_seqs: int,
    ubatch: int = 0,
    kv_scales: Optional[torch.Tensor] = None,  # an e4m3 cache's [k_scale, v_scale] (kv_scales_arg)
) -> None:
    """A decode step in one launch: the rotary embedding of q and k, k and v into the cache at
    `slot_mapping`, and attention of each sequence's row over its context including the new key.
    The caller guarantees at most one row per sequence (the kernel reads nothing past it)."""
    launch = _decode_launch(
        q, k, v, out, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping,
        cu_seqlens_q, context_lens, block_tables, scale, plan, num_seqs=num_seqs, ubatch=ubatch,
        kv_scales=kv_scales,
    )  # fmt: skip
    if launch is not None:
        _DECODE_LAUNCHES(*launch)


def _decode_launch(
    q, k, v, out, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, cu_seqlens_q,
    context_lens, block_tables, scale: float, plan: DecodeLaunch, *, num_seqs: int, ubatch: int = 0,
    kv_scales: Optional[torch.Tensor] = None,
) -> Optional[tuple]:  # fmt: skip
    """decode_attention's checks (its arguments), then its launch as (grid, tensors, scalars,
    constexprs) for _DECODE_LAUNCHES; None when there is nothing to launch."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"decode_attention: k {tuple(k.shape)}, v {tuple(v.shape)} do not fit q {tuple(q.shape)} "
            f"and the caches' {num_kv_heads} KV heads"
        )
    has_rope = positions is not None
    if has_rope and (
        cos_cache is None
        or sin_cache is None
        or cos_cache.shape[1:] != (head_dim // 2,)
        or head_dim % 2
    ):
        raise ValueError(
            f"decode_attention: rotary caches do not fit head_dim {head_dim} (want [max_position, {head_dim // 2}])"
        )
    if num_seqs == 0 or num_tokens == 0:
        return None
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    split = plan.num_splits > 1
    if split:
        partial, m, l = kept_split_workspace(
            num_tokens, num_heads, plan.num_splits, head_dim, q.device
        )
        counters = prepare_decode_counters(q.device)[ubatch * DECODE_COUNTERS :]
        partial_strides, ml_strides = partial.stride()[:3], m.stride()[:2]
    else:
        partial = m = l = counters = out  # unused
        partial_strides, ml_strides = (0, 0, 0), (0, 0)
    if has_rope:
        rope_args = (positions, cos_cache.contiguous(), sin_cache.contiguous())
    else:
        rope_args = (slot_mapping, out, out)  # unused
    tensors = (q, k, v, out, partial, m, l, counters, *rope_args, k_cache, v_cache, slot_mapping)
    tensors += (cu_seqlens_q, context_lens, block_tables, kv_scales_arg(kv_scales, k_cache))
    scalars = (
        scale * LOG2E,
        plan.num_splits,
        num_kv_heads,
        num_tokens,
        block_tables.shape[1],
        *row_strides(q, k, v, out),
        *partial_strides,
        *ml_strides,
        *cache_strides(k_cache, v_cache),
        block_tables.stride(0),
        head_dim,
    )
    constexprs = _decode_constexprs(
        plan,
        num_heads // num_kv_heads,
        head_dim,
        k_cache.shape[1],
        has_rope,
        q.dtype == torch.float32,
        plan.fp8_f16_products
        and k_cache.dtype == torch.float8_e4m3fn
        and q.dtype in (torch.bfloat16, torch.float16),
        use_pdl(q.device),
    )
    return (num_seqs, num_kv_heads, plan.num_splits), tensors, scalars, constexprs


# every decode launch outside a CUDA-graph recording repeats the last one's specialization: launch
# them past Triton's dispatch (a TR_HYBRID step makes one per layer)
_DECODE_LAUNCHES = LaunchMemo(decode_attention_kernel)


# Whole decode launches bound once and repeated, for eager steps that pass the same tensors again: a
# TR_HYBRID eager region gets the same static buffers at every step of its bucket. Keyed by every
# argument's address, shape and stride, the sequence count and the stream (_bound_key); each entry
# holds the plan's inputs and, per plan (the split count follows the live context), the launch.
_BOUND: dict[
    tuple, tuple[tuple[int, int, int, int, bool], dict[DecodeLaunch, Callable[[int], None]]]
] = {}
MAX_BOUND = 512


def _bound_key(
    q, k, v, out, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, cu_seqlens_q,
    context_lens, block_tables, scale, num_seqs, stream, ubatch, kv_scales,
) -> tuple:  # fmt: skip
    return (
        stream, ubatch, num_seqs, scale, q.dtype, k_cache.dtype,
        None if kv_scales is None else kv_scales.data_ptr(),
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
        None if positions is None else positions.data_ptr(),
        None if cos_cache is None else cos_cache.data_ptr(),
        None if sin_cache is None else sin_cache.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
        cu_seqlens_q.data_ptr(), context_lens.data_ptr(), block_tables.data_ptr(),
        q.shape, k.shape, v.shape, out.shape, k_cache.shape, block_tables.shape,
        q.stride(), k.stride(), v.stride(), out.stride(), k_cache.stride(), v_cache.stride(),
        block_tables.stride(),
    )  # fmt: skip


def _binds_its_arguments(q, k, v, cos_cache, sin_cache) -> bool:
    """Whether the launch just made passed these tensors themselves (no contiguous copy, whose
    address would outlive its data) and runs outside a CUDA-graph capture."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    if cos_cache is not None and not (cos_cache.is_contiguous() and sin_cache.is_contiguous()):
        return False
    return not torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=256)
def _decode_constexprs(
    plan: DecodeLaunch,
    group: int,
    head_dim: int,
    block_size: int,
    has_rope: bool,
    ieee_dot: bool,
    f16_products: bool,
    pdl: bool,
) -> tuple[tuple[str, object], ...]:
    """decode_attention_kernel's constexprs and launch options, in its signature's order."""
    return (
        ("GROUP", group),
        ("BLOCK_M", plan.block_m),
        ("HALF", head_dim // 2),
        ("HEAD_DIM_P", plan.head_dim_p),
        ("TILE_N", plan.tile_n),
        ("BLOCK_SIZE", block_size),
        ("HAS_ROPE", has_rope),
        ("SPLIT", plan.num_splits > 1),
        ("MIN_TILES_PER_SPLIT", plan.min_tiles_per_split),
        ("SPLIT_CHUNK", SPLIT_CHUNK),
        ("IEEE_DOT", ieee_dot),
        ("F16_PRODUCTS", f16_products),
        ("USE_PDL", pdl),
        ("PREFETCH_KV", plan.prefetch_kv),
        ("WIDEN_V_FIRST", plan.widen_v_first and f16_products),
        ("EARLY_KV", plan.early_kv),
        ("num_warps", plan.num_warps),
        ("num_stages", plan.num_stages),
        ("launch_pdl", pdl and device_info.PDL_ATTRIBUTE),
    )


def attention_step(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    positions: Optional[torch.Tensor],  # [num_tokens] int64, or None (no rotary embedding)
    cos_cache: Optional[torch.Tensor],
    sin_cache: Optional[torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    num_seqs: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    graph_safe: bool,
    cu_seqlens_q_cpu: Optional[list[int]] = None,
    context_lens_cpu: Optional[list[int]] = None,
    ubatch: int = 0,
    kv_scales: Optional[torch.Tensor] = None,  # an e4m3 cache's [k_scale, v_scale] (kv_scales_arg)
) -> Optional[Callable[[int], None]]:
    """The attention op's CUDA work: rotary (with `positions`), the KV write, attention into `out`.

    A batch of at most one row per sequence -- by the bucket on the graph-safe path, by the live
    lengths otherwise -- is one decode_attention launch; any other batch is rope_write_kv (or
    write_kv_cache) followed by unified_attention. Returns the bound launch (a callable of the
    stream) that repeats a host-planned decode launch with these very arguments, when it keeps one."""
    lengths = plan_lengths(
        q, block_tables, k_cache.shape[1], num_seqs, max_seqlen_q, max_seqlen_k, graph_safe,
        cu_seqlens_q_cpu, context_lens_cpu,
    )  # fmt: skip
    plan_q, plan_k, _ = lengths
    key = None
    if plan_q == 1 and not graph_safe and q.is_cuda:  # an eager decode step: bound launches
        index = q.get_device()
        stream = torch._C._cuda_getCurrentRawStream(index)
        key = _bound_key(
            q, k, v, out, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping,
            cu_seqlens_q, context_lens, block_tables, scale, num_seqs, stream, ubatch, kv_scales,
        )  # fmt: skip
        entry = _BOUND.get(key)
        if entry is not None:
            launch = entry[1].get(plan_decode(num_seqs, plan_k, *entry[0]))
            if launch is not None:
                launch(stream)
                return launch
    num_kv_heads, head_dim = check_attention_args(q, k_cache, v_cache, out, block_tables)
    if plan_q == 1:
        fp8_cache = k_cache.dtype == torch.float8_e4m3fn
        dims = (num_kv_heads, q.shape[1] // num_kv_heads, head_dim, sm_count(q.device), fp8_cache)
        plan = plan_decode(num_seqs, plan_k, *dims)
        launch = _decode_launch(
            q, k, v, out, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping,
            cu_seqlens_q, context_lens, block_tables, scale, plan, num_seqs=num_seqs, ubatch=ubatch,
            kv_scales=kv_scales,
        )  # fmt: skip
        if launch is None:
            return None
        _DECODE_LAUNCHES(*launch)
        if key is not None and _binds_its_arguments(q, k, v, cos_cache, sin_cache):
            # the caller's tensors are at the key's addresses whenever it hits; only the split
            # workspace (tensors 4-6, kept per stream and regrown; `out` without splits) must
            # outlive this call
            keep = launch[1][4:7] if plan.num_splits > 1 else ()
            bound = _DECODE_LAUNCHES.bound(*launch, keep=keep)
            if bound is not None:
                if len(_BOUND) >= MAX_BOUND:
                    _BOUND.clear()
                _BOUND.setdefault(key, (dims, {}))[1][plan] = bound
                return bound
        return None
    if positions is not None:
        q = rope_write_kv(
            q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, kv_scales
        )
    else:
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    attend_planned(
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, scale, num_seqs, lengths,
        kv_scales,
    )  # fmt: skip
    return None

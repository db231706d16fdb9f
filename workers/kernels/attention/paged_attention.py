# Paged attention on CUDA: the kernels' entry points for prefill and mixed batches, and their launch planning.
#   write_kv_cache     - scatter this step's k, v rows into the paged cache at slot_mapping
#   rope_write_kv      - the same, after the rotary embedding of k, and the rotated q into a new tensor
#   unified_attention  - causal attention of ragged query rows over their paged context (prefill with
#                        prior context, decode, several rows per sequence for MTP verify), GQA, split-KV
# A decode batch (one row per sequence) takes decode_attention.py instead: rotary, KV write,
# attention and the split merge in one launch; its `attention_step` is what the attention op runs.
# Two launch paths (see the guide: FULL vs TR_HYBRID):
#   graph_safe=True   the launch depends only on the bucket (shapes, num_seqs, max_seqlen_q, KV capacity),
#                     so a FULL CUDA graph can replay it with new metadata in the same buffers;
#   graph_safe=False  the launch is planned on the host from the step's real lengths (eager regions).
# The kernels themselves live in attention_kernels.py. Importing this module needs no GPU.

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from atomrt.workers.kernels.attention.attention_kernels import (
    paged_attention_kernel,
    reduce_splits_kernel,
    rope_write_kv_kernel,
    write_kv_kernel,
)
from atomrt.workers.kernels.attention.workspace import split_workspace
from atomrt.workers.kernels.device_info import device_scratch, sm_count
from atomrt.workers.kernels.launch import launch

LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 256  # a KV split shorter than this costs more in the reduce than it saves
MAX_SPLITS = 32
MAX_PARTIAL_BYTES = 64 << 20


@dataclass(frozen=True)
class AttentionLaunch:
    """One launch of the attention kernel: tile sizes, grid and KV split count."""

    group: int  # query heads per KV head
    group_p: int  # group rounded up to a power of two
    block_q: int  # query rows (tokens) per tile
    block_m: int  # tile rows = block_q * group_p
    tile_n: int  # keys per inner iteration
    head_dim_p: int
    num_q_blocks: int  # query tiles per sequence; grid dim 0 = num_seqs * num_q_blocks
    num_splits: int  # KV splits; > 1 adds the reduce kernel
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=4096)
def plan_attention(
    num_seqs: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    num_sms: int,
) -> AttentionLaunch:
    """Tiles and split count for a batch of `num_seqs` sequences of at most `max_seqlen_q` query rows
    and `max_seqlen_k` keys. Pure (and cached: it runs once per layer call on the host path);
    the graph-safe path feeds it bucket values only."""
    group_p = triton.next_power_of_2(group)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    cap_m = 128 if head_dim_p <= 128 else 64
    block_m = max(16, group_p, min(cap_m, triton.next_power_of_2(max(1, max_seqlen_q) * group_p)))
    block_q = block_m // group_p
    num_q_blocks = triton.cdiv(max(1, max_seqlen_q), block_q)
    tile_n = 64 if head_dim_p <= 128 else 32
    # Few query tiles over long contexts (decode of a small batch) leave SMs idle: split the keys.
    # Split only when the grid leaves SMs idle; aim at two programs per SM, no split under
    # MIN_KEYS_PER_SPLIT keys, and partial outputs (fp32, one per split) of at most MAX_PARTIAL_BYTES.
    num_programs = max(1, num_seqs * num_q_blocks * num_kv_heads)
    num_splits = 1
    if num_programs < num_sms:
        partial_bytes = max(1, num_seqs * max_seqlen_q * num_kv_heads * group * head_dim * 4)
        max_splits = min(
            MAX_SPLITS, max_seqlen_k // MIN_KEYS_PER_SPLIT, MAX_PARTIAL_BYTES // partial_bytes
        )
        num_splits = max(1, min(max_splits, triton.cdiv(2 * num_sms, num_programs)))
    num_warps = 8 if block_m * head_dim_p >= 128 * 128 else 4
    return AttentionLaunch(
        group=group,
        group_p=group_p,
        block_q=block_q,
        block_m=block_m,
        tile_n=tile_n,
        head_dim_p=head_dim_p,
        num_q_blocks=num_q_blocks,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=2 if block_m >= 128 else 3,
    )


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padded row (skipped)
    kv_scales: Optional[torch.Tensor] = None,  # an e4m3 cache's [k_scale, v_scale] (kv_scales_arg)
) -> None:
    """Writes row i of k, v at slot `slot_mapping[i]` (= block * block_size + offset) of the caches
    (an e4m3 cache: k / k_scale and v / v_scale, saturated)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_kv_fits("write_kv_cache", k, v, k_cache, v_cache, head_dim)
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"write_kv_cache: slot_mapping has {slot_mapping.shape[0]} rows for {num_tokens} tokens"
        )
    if num_tokens == 0:
        return
    k, v = unit_last_stride(k), unit_last_stride(v)
    _check_unit_last_stride(k_cache, "k_cache")
    _check_unit_last_stride(v_cache, "v_cache")
    head_dim_p = triton.next_power_of_2(head_dim)
    heads_per_prog = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // head_dim_p))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_prog))
    launch(
        write_kv_kernel,
        grid,
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        kv_scales_arg(kv_scales, k_cache),
        row_strides(k, v),
        cache_strides(k_cache, v_cache),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PER_PROG=heads_per_prog,
        HEAD_DIM_P=head_dim_p,
    )


def rope_write_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_position, head_dim / 2] fp32
    sin_cache: torch.Tensor,  # [max_position, head_dim / 2] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padded row
    kv_scales: Optional[torch.Tensor] = None,  # an e4m3 cache's [k_scale, v_scale] (kv_scales_arg)
) -> torch.Tensor:
    """Rotary embedding (half-split layout) of q and k, and k, v written at `slot_mapping`, in one
    launch. Returns the rotated q ([num_tokens, num_heads, head_dim], contiguous); padded rows get a
    rotated q too, and nothing in the cache."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _check_kv_fits("rope_write_kv", k, v, k_cache, v_cache, head_dim)
    if (
        head_dim % 2
        or cos_cache.shape[1:] != (head_dim // 2,)
        or sin_cache.shape != cos_cache.shape
    ):
        raise ValueError(
            f"rope_write_kv: cos/sin caches {tuple(cos_cache.shape)}, {tuple(sin_cache.shape)} "
            f"do not fit head_dim {head_dim} (want [max_position, {head_dim // 2}])"
        )
    if (
        slot_mapping.shape[0] < num_tokens
        or positions.shape[0] < num_tokens
        or k.shape[0] != num_tokens
    ):
        raise ValueError(
            f"rope_write_kv: {num_tokens} query rows, {k.shape[0]} key rows, "
            f"{positions.shape[0]} positions, {slot_mapping.shape[0]} slots"
        )
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    _check_unit_last_stride(k_cache, "k_cache")
    _check_unit_last_stride(v_cache, "v_cache")
    launch(
        rope_write_kv_kernel,
        (num_tokens,),
        q,
        k,
        v,
        q_out,
        positions,
        cos_cache.contiguous(),
        sin_cache.contiguous(),
        k_cache,
        v_cache,
        slot_mapping,
        kv_scales_arg(kv_scales, k_cache),
        row_strides(q, k, v),
        cache_strides(k_cache, v_cache),
        num_heads,
        num_kv_heads,
        HALF=head_dim // 2,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_P=triton.next_power_of_2(num_heads),
        KV_HEADS_P=triton.next_power_of_2(num_kv_heads),
        HALF_P=triton.next_power_of_2(head_dim // 2),
        num_warps=4 if num_heads * head_dim >= 2048 else 2,
    )
    return q_out


def plan_lengths(
    q: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    num_seqs: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    graph_safe: bool,
    cu_seqlens_q_cpu: Optional[list[int]],
    context_lens_cpu: Optional[list[int]],
) -> tuple[int, int, int]:
    """(rows per sequence, keys per sequence, rows to reduce) that a launch is planned for."""
    if graph_safe:
        # Bucket values only: the padded batch, the bucket's rows per sequence, the KV capacity.
        return max_seqlen_q, block_tables.shape[1] * block_size, q.shape[0]
    if cu_seqlens_q_cpu is not None and context_lens_cpu is not None:
        lens_q = [cu_seqlens_q_cpu[i + 1] - cu_seqlens_q_cpu[i] for i in range(num_seqs)]
        return (
            max(lens_q, default=0),
            max(context_lens_cpu[:num_seqs], default=0),
            cu_seqlens_q_cpu[num_seqs],
        )
    return max_seqlen_q, max_seqlen_k, q.shape[0]


def unified_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written in place (padded rows left as they are)
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, KV length including this step's rows
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, -1 past the end
    scale: float,
    *,
    num_seqs: int,  # sequences in the batch (the bucket's on the graph-safe path)
    max_seqlen_q: int,  # bound on a sequence's query rows
    max_seqlen_k: int,  # bound on a sequence's keys (host-planned path without host lengths)
    graph_safe: bool,  # plan from the bounds and the KV capacity only (a FULL graph replays it)
    cu_seqlens_q_cpu: Optional[list[int]] = None,  # host copies of the lengths: the host-planned
    context_lens_cpu: Optional[list[int]] = None,  # path plans from them when given
    kv_scales: Optional[torch.Tensor] = None,  # an e4m3 cache's [k_scale, v_scale] (kv_scales_arg)
) -> None:
    """Causal paged attention: query row j of sequence s (n_q rows) sits at position
    context_lens[s] - n_q + j and attends to keys 0..that position of its block table. The
    launch is planned by `plan_lengths`."""
    check_attention_args(q, k_cache, v_cache, out, block_tables)
    lengths = plan_lengths(
        q, block_tables, k_cache.shape[1], num_seqs, max_seqlen_q, max_seqlen_k, graph_safe,
        cu_seqlens_q_cpu, context_lens_cpu,
    )  # fmt: skip
    attend_planned(
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, scale, num_seqs, lengths,
        kv_scales,
    )  # fmt: skip


def attend_planned(
    q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, scale: float,
    num_seqs: int, lengths: tuple[int, int, int], kv_scales: Optional[torch.Tensor] = None,
) -> None:  # fmt: skip
    """unified_attention (its arguments) after its checks, for `plan_lengths`' (rows, keys, rows to
    reduce)."""
    plan_q, plan_k, reduce_rows = lengths
    if num_seqs == 0 or plan_q == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[2], q.shape[2]
    plan = plan_attention(
        num_seqs,
        plan_q,
        plan_k,
        num_kv_heads,
        q.shape[1] // num_kv_heads,
        head_dim,
        sm_count(q.device),
    )
    launch_attention(
        plan,
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        context_lens,
        block_tables,
        scale,
        num_seqs=num_seqs,
        reduce_rows=reduce_rows,
        kv_scales=kv_scales,
    )


def launch_attention(
    plan: AttentionLaunch, q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
    scale: float, *, num_seqs: int, reduce_rows: int, kv_scales: Optional[torch.Tensor] = None,
) -> None:  # fmt: skip
    """Runs one planned launch of unified_attention's arguments (tests call it directly to force a
    split count)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    q = unit_last_stride(q)
    grid = (num_seqs * plan.num_q_blocks, num_kv_heads, plan.num_splits)
    split = plan.num_splits > 1
    if split:
        partial, m, l = split_workspace(num_tokens, num_heads, plan.num_splits, head_dim, q.device)
        dst, stride_os, m_arg, l_arg = partial, partial.stride(2), m, l
        stride_mt, stride_mh = m.stride(0), m.stride(1)
    else:
        dst, stride_os, m_arg, l_arg, stride_mt, stride_mh = out, 0, out, out, 0, 0
    launch(
        paged_attention_kernel,
        grid,
        q,
        k_cache,
        v_cache,
        dst,
        m_arg,
        l_arg,
        cu_seqlens_q,
        context_lens,
        block_tables,
        kv_scales_arg(kv_scales, k_cache),
        scale * LOG2E,
        plan.num_q_blocks,
        plan.num_splits,
        q.stride(0),
        q.stride(1),
        dst.stride(0),
        dst.stride(1),
        stride_os,
        stride_mt,
        stride_mh,
        *cache_strides(k_cache, v_cache),
        block_tables.stride(0),
        head_dim,
        GROUP=plan.group,
        GROUP_P=plan.group_p,
        BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m,
        HEAD_DIM_P=plan.head_dim_p,
        TILE_N=plan.tile_n,
        BLOCK_SIZE=k_cache.shape[1],
        SPLIT=split,
        IEEE_DOT=q.dtype == torch.float32,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if not split or reduce_rows == 0:
        return
    launch(
        reduce_splits_kernel,
        (reduce_rows, num_heads),
        partial,
        m,
        l,
        out,
        cu_seqlens_q,
        num_seqs,
        plan.num_splits,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        m.stride(0),
        m.stride(1),
        out.stride(0),
        out.stride(1),
        head_dim,
        SPLITS_P=triton.next_power_of_2(MAX_SPLITS),  # one variant for every split count
        HEAD_DIM_P=plan.head_dim_p,
        num_warps=4,
    )


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
) -> tuple[int, int]:
    """Validates shapes and dtypes; returns (num_kv_heads, head_dim)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"unified_attention: want q [T, H, D] and caches [blocks, block_size, Hk, D], got "
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"unified_attention: q has {num_heads} heads of dim {head_dim}, the cache {num_kv_heads} KV heads "
            f"of dim {k_cache.shape[3]}; heads must be a multiple of KV heads and dims equal"
        )
    if out.shape != q.shape:
        raise ValueError(
            f"unified_attention: out {tuple(out.shape)} must have q's shape {tuple(q.shape)}"
        )
    fp8_cache = k_cache.dtype == torch.float8_e4m3fn  # kv_cache_dtype fp8: widened when read
    if (q.dtype != k_cache.dtype and not fp8_cache) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"unified_attention: q {q.dtype} and caches {k_cache.dtype}/{v_cache.dtype} must share a dtype"
            " (or the caches be float8_e4m3fn)"
        )
    if head_dim < 16:
        raise ValueError(f"unified_attention: head_dim {head_dim} < 16 is not supported")
    _check_unit_last_stride(out, "out")
    _check_unit_last_stride(k_cache, "k_cache")
    _check_unit_last_stride(v_cache, "v_cache")
    if block_tables.stride(1) != 1:
        raise ValueError("unified_attention: block_tables rows must be contiguous")
    return num_kv_heads, head_dim


def unit_kv_scales(device: torch.device) -> torch.Tensor:
    """[1.0, 1.0] float32 on `device`, made once: the `kv_scales` of a cache that has none set. Make
    it before any CUDA-graph capture (allocate_kv_cache does, with the decode split counters)."""
    return device_scratch(
        "attention: unit KV cache scales",
        device,
        lambda d: torch.ones(2, dtype=torch.float32, device=d),
        hint="call paged_attention.unit_kv_scales(device) before capturing (allocate_kv_cache does)",
    )


def kv_scales_arg(kv_scales: Optional[torch.Tensor], cache: torch.Tensor) -> torch.Tensor:
    """The kernels' `kv_scales` for `cache`: [k_scale, v_scale] float32 on its device, an e4m3
    cache's per-tensor scales (it holds k / k_scale; a latent cache's one scale is k_scale), which
    the write kernels divide by and the attention kernels multiply back; a layer's are set at
    start-up (runner/kv_scales.py). None: 1.0 and 1.0. A cache of another dtype never reads them."""
    if kv_scales is None:
        return unit_kv_scales(cache.device)
    if kv_scales.dtype != torch.float32 or kv_scales.numel() != 2:
        raise ValueError(
            f"kv_scales must be [k_scale, v_scale] float32, got {kv_scales.dtype} "
            f"{tuple(kv_scales.shape)}"
        )
    return kv_scales


def row_strides(*rows: torch.Tensor) -> tuple[int, ...]:
    """The kernels' token and head strides of each [T, heads, D] tensor in `rows`."""
    strides: tuple[int, ...] = ()
    for t in rows:  # a loop: half the host time of a generator (launches run it every step)
        strides += t.stride()[:2]
    return strides


def cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """The kernels' block, slot and head strides of the key cache, then of the value cache."""
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])


def _check_kv_fits(op: str, k, v, k_cache, v_cache, head_dim: int) -> None:
    """k and v [T, Hk, D] fit the caches [blocks, block_size, Hk, head_dim]."""
    if (
        k_cache.shape[2:] != (k.shape[1], head_dim)
        or v_cache.shape != k_cache.shape
        or v.shape != k.shape
    ):
        raise ValueError(
            f"{op}: k {tuple(k.shape)}, v {tuple(v.shape)} do not fit caches "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )


def _check_unit_last_stride(t: torch.Tensor, name: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last (head_dim) dimension, has stride {t.stride(-1)}"
        )


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()

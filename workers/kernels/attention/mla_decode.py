# Multi-head latent attention (DeepSeek's MLA) over a paged latent KV cache, on CUDA (the cache
# writes are in mla_write.py):
#   mla_decode_attention - attention of absorbed query rows (one per request for decode, k + 1 for a
#                          verify step) over their paged latent context: the query heads grouped over
#                          the one latent head, split-KV (as many splits working as the live context
#                          fills), then a merge of the splits that saw a key (a second launch,
#                          or with merge_in_kernel the last split program to finish)
#   plan_mla_decode      - tiles and split count, from host-known shapes only
# Every launch reads its lengths on the device and is planned from shapes (rows, requests, heads, the
# block table's KV capacity), never from live lengths: graph-safe, with no host synchronisation.
# Launches go through a LaunchMemo (kernels/launch.py); eager split launches reuse a kept workspace.
# The kernels are in mla_kernels.py and mla_merge_kernels.py. Importing this module needs no GPU.

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from atomrt.workers.kernels import device_info
from atomrt.workers.kernels.attention.decode_attention import (
    DECODE_COUNTERS,
    UBATCHES,
    prepare_decode_counters,
)
from atomrt.workers.kernels.attention.mla_kernels import mla_decode_kernel
from atomrt.workers.kernels.attention.mla_merge_kernels import mla_merge_kernel
from atomrt.workers.kernels.attention.paged_attention import (
    LOG2E,
    MAX_PARTIAL_BYTES,
    kv_scales_arg,
    unit_last_stride,
)
from atomrt.workers.kernels.attention.workspace import kept_split_workspace
from atomrt.workers.kernels.device_info import sm_count
from atomrt.workers.kernels.launch import LaunchMemo, launch

MAX_TILE_M = 32  # query rows x heads per program: its fp32 accumulator is MAX_TILE_M x kv_lora_rank
MAX_ROW_BLOCKS = 256  # programs per request and head tile that share out its query tiles
MIN_KEYS_PER_SPLIT = 64  # and at least 4 per query head: a split's partials (H x L fp32) stay small
# One latent head serves every query head, so a few requests make a few programs: a lone request
# needs about as many splits as the GPU has SMs to keep enough of its cache reads in flight.
MAX_SPLITS = 128
MERGE_TILE = 4096  # fp32 partials a merge program holds at once (splits x latent columns)
# A plan of at most this many splits merges them in the decode kernel (merge_in_kernel: one launch,
# its last split program to finish reading every split's partials) rather than in a launch of its
# own. `bench_mla_decode.py --plans --heads 16 --bs 1,8,32,128 --ctx 8192` on one H100 (4978fb3),
# merge in the kernel vs a launch: 2 splits at bs 128 490 vs 513 us, at bs 32 351 vs 355; 4 splits
# at bs 32 202 vs 207 but at bs 8 191 vs 183; 8 splits and more lose (bs 32: 154 vs 143 us).
MERGE_IN_KERNEL_MAX_SPLITS = 2
MERGE_SPLITS = 4  # merge_in_kernel: splits the merging program reads per step
MERGE_REGS = 4096  # and fp32 partials it holds at once (rows x MERGE_SPLITS x latent columns)


@dataclass(frozen=True)
class MLADecodeLaunch:
    """One launch of the MLA decode kernel: tiles, KV splits, warps."""

    heads_p: int  # query heads per tile, a power of two
    block_q: int  # query rows per tile
    block_m: int  # tile rows = max(16, block_q * heads_p)
    num_row_blocks: int  # programs sharing a request's query tiles (grid dim 0: x head tiles)
    block_n: int  # keys per inner iteration
    lora_p: int  # kv_lora_rank rounded up to a power of two (>= 16)
    rope_p: int  # the rotary dim, likewise
    num_splits: int  # grid dim 2; > 1 adds the merge launch
    min_tiles_per_split: int  # key tiles a working split takes at least (the live context decides)
    num_warps: int
    num_stages: int
    # each key tile's block ids load with the previous tile's rows, not before its own: off, as
    # measured (bench_mla_decode.py on an H100: of copy 0.495 against 0.505 at bs 32, 0.620 against
    # 0.637 at bs 128, level at bs 1 and 8)
    prefetch_blocks: bool = False
    # each key tile's rows (and block ids) load before the tile before is summed: a tile's loads
    # overlap the previous tile's products, held in registers (with it, prefetch_blocks is unused);
    # off, as measured (bench_mla_variants.py on an H100, 16 heads, 8k keys: with bf16 partials
    # 15.57 against 15.15 us at bs 1, 51.18 against 49.32 at bs 8)
    prefetch_kv: bool = False
    # with splits, the last split program of each (request, program column) to finish merges the
    # splits (self-resetting counters: the decode attention's, prepare_decode_counters) instead of
    # a merge launch; a launch with more such columns than a counter region holds keeps the merge
    # launch
    merge_in_kernel: bool = False
    # with splits, the partial outputs are stored in bfloat16 (m and l stay fp32): half the bytes
    # the splits write and the merge reads again (at bs 1 and 128 splits, 2.1 of 4.2 MB beside a
    # 9.4 MB cache); they are unnormalised sums of weights <= 1 times the values, so their rounding
    # (2^-9 relative) is about the output's own. Off: on an H100 (bench_mla_variants.py, 16 heads,
    # 8k keys) 15.15 against 15.63 us at bs 1 and 49.32 against 49.93 at bs 8, within a run's spread
    partials_bf16: bool = False
    # merge_in_kernel: splits the merging program reads per step, and the fp32 partials it holds at
    # once (rows x merge_splits x latent columns); a step's loads all go out before its sums, so
    # more of them put more bytes in flight for the one program that merges every split
    merge_splits: int = MERGE_SPLITS
    merge_regs: int = MERGE_REGS
    # the merge launch (splits, no merge_in_kernel) starts with programmatic dependent launch on
    # sm90+: the decode kernel signals at its start, so the merge's programs are scheduled as soon
    # as every decode program is, and wait (gdc_wait) for the whole decode before reading: the gap
    # between the two launches is hidden. The kernel before the decode has finished by then (the
    # decode launches without the attribute), as device_info.use_pdl's contract has it. Off: on an
    # H100 (bench_mla_variants.py) 15.81 against 15.63 us at bs 1, 49.65 against 49.93 at bs 8.
    merge_pdl: bool = False


@functools.lru_cache(maxsize=4096)
def plan_mla_decode(
    num_reqs: int,
    num_rows: int,
    max_seqlen_k: int,
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    num_sms: int,
) -> MLADecodeLaunch:
    """Tiles and split count for `num_reqs` requests holding `num_rows` query rows over contexts of
    at most `max_seqlen_k` keys (the block table's capacity). A tile holds up to MAX_TILE_M
    (row, head) pairs: all heads of a model of up to 32 (one cache read per request and split), and
    the rows of a verify step where heads leave room; a request's further query tiles go to
    programs of their own (a long run of rows, as a prefill chunk has, runs side by side). The keys
    are split only when the programs leave SMs idle: about two programs per SM. Inside the kernel a
    split works on MIN_KEYS_PER_SPLIT keys or more (and 4 per head, so that a split's fp32 partials
    stay under about half the cache bytes it reads): a context shorter than the capacity works
    fewer splits, and a short one a single split."""
    heads_p = min(MAX_TILE_M, triton.next_power_of_2(max(1, num_heads)))
    rows_per_req = triton.cdiv(max(1, num_rows), max(1, num_reqs))  # a hint: any layout is served
    block_q = max(1, min(triton.next_power_of_2(rows_per_req), MAX_TILE_M // heads_p))
    block_m = max(16, block_q * heads_p)
    block_q = block_m // heads_p  # rows a padded tile has room for anyway
    num_row_blocks = min(MAX_ROW_BLOCKS, triton.cdiv(rows_per_req, block_q))
    lora_p = max(16, triton.next_power_of_2(kv_lora_rank))
    rope_p = max(16, triton.next_power_of_2(max(1, rope_dim)))
    block_n = 32 if lora_p >= 256 else 64
    min_keys = max(MIN_KEYS_PER_SPLIT, 4 * num_heads)
    num_programs = max(1, num_reqs * triton.cdiv(num_heads, heads_p) * num_row_blocks)
    num_splits = 1
    if num_programs < num_sms:
        partial_bytes = max(1, num_rows * num_heads * kv_lora_rank * 4)
        max_splits = min(MAX_SPLITS, max_seqlen_k // min_keys, MAX_PARTIAL_BYTES // partial_bytes)
        # at most two programs per SM, the most that stay resident: a split count past that leaves
        # a tail wave (V2-Lite's 16 heads, bs 32, 8k keys on an H100: 9 splits 202.9 us, 8 splits
        # 143.6 us; bench_mla_decode.py --sweep)
        num_splits = max(1, min(max_splits, (2 * num_sms) // num_programs))
    return MLADecodeLaunch(
        heads_p=heads_p,
        block_q=block_q,
        block_m=block_m,
        num_row_blocks=num_row_blocks,
        block_n=block_n,
        lora_p=lora_p,
        rope_p=rope_p,
        num_splits=num_splits,
        min_tiles_per_split=triton.cdiv(min_keys, block_n),
        num_warps=4 if block_m <= 16 else 8,
        num_stages=2,
        merge_in_kernel=1 < num_splits <= MERGE_IN_KERNEL_MAX_SPLITS,
    )


@functools.lru_cache(maxsize=1024)
def _with_splits(plan: MLADecodeLaunch, num_splits: int) -> MLADecodeLaunch:
    merge_in_kernel = 1 < num_splits <= MERGE_IN_KERNEL_MAX_SPLITS
    return dataclasses.replace(plan, num_splits=num_splits, merge_in_kernel=merge_in_kernel)


def mla_decode_attention(
    q: torch.Tensor,  # [R, H, kv_lora_rank + rope_dim], absorbed
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, keys of each request including this step's rows
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32: request b owns rows cu[b]..cu[b + 1]
    scale: float,
    out: torch.Tensor,  # [R, H, kv_lora_rank]
    num_kv_splits: Optional[int] = None,
    kv_scales: Optional[torch.Tensor] = None,  # an e4m3 cache's [k_scale, _] (kv_scales_arg)
    q_pe: Optional[torch.Tensor] = None,  # [R, H, rope_dim]: q's rotary part, q then [R, H, L]
    ubatch: int = 0,  # two-batch overlap's microbatch: its own split counters
) -> torch.Tensor:
    """out = softmax(scale * q K^T) V per request and head, where K is the full cache row and V its
    first kv_lora_rank columns; row j of a request with n rows sees keys 0..seq_len - n + j. A row
    that sees no key (a padded request of seq_len 0) and a row of no request (past
    cu_seqlens_q[B]) get zeros. q is rounded to the cache's dtype for the products.

    The launch is planned from shapes only, so it may be captured in a CUDA graph and replayed with
    new lengths: num_kv_splits=None sizes the split grid from the block table's KV capacity, an int
    (1..MAX_SPLITS) gives it that many; the live context decides how many of them work. Returns
    `out`. With `q_pe`, q holds the latent part alone and the kernel reads the rotary part from
    q_pe (any row and head strides): the absorbed product and the rotated q_pe need no copy into one
    row. `ubatch` (0..UBATCHES - 1) picks a merge_in_kernel plan's split counters: launches that
    may overlap in time (two-batch overlap's microbatches) need their own."""
    kv_lora_rank = _check_decode_args(
        q, kv_cache, block_table, seq_lens, cu_seqlens_q, out, num_kv_splits, q_pe
    )
    if isinstance(ubatch, bool) or not isinstance(ubatch, int) or not 0 <= ubatch < UBATCHES:
        raise ValueError(
            f"mla_decode_attention: ubatch {ubatch!r} must be an int in 0..{UBATCHES - 1}"
        )
    num_rows, num_heads, _ = q.shape
    num_reqs = seq_lens.shape[0]
    if num_rows == 0:
        return out
    if num_reqs == 0:
        return out.zero_()
    plan = plan_mla_decode(
        num_reqs,
        num_rows,
        block_table.shape[1] * kv_cache.shape[1],
        num_heads,
        kv_lora_rank,
        kv_cache.shape[2] - kv_lora_rank,
        sm_count(q.device),
    )
    if num_kv_splits is not None and num_kv_splits != plan.num_splits:
        plan = _with_splits(plan, num_kv_splits)
    launch_mla_decode(
        plan, q, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, out, kv_scales=kv_scales,
        q_pe=q_pe, ubatch=ubatch,
    )  # fmt: skip
    return out


# every decode launch outside a CUDA-graph recording repeats an earlier one's specialization: launch
# them past Triton's dispatch (a TR_HYBRID step makes one per layer)
_DECODE_LAUNCHES = LaunchMemo(mla_decode_kernel)


def launch_mla_decode(
    plan: MLADecodeLaunch,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    kv_scales: Optional[torch.Tensor] = None,
    q_pe: Optional[torch.Tensor] = None,
    ubatch: int = 0,
) -> None:
    """Runs one planned launch, and the merge when it splits (a second launch unless the plan merges
    in the kernel); after mla_decode_attention's checks: tests and the benchmark call it directly
    to force a plan."""
    num_rows, num_heads, _ = q.shape
    kv_lora_rank = out.shape[2]
    num_reqs = seq_lens.shape[0]
    q = unit_last_stride(q)
    q_pe = q[..., kv_lora_rank:] if q_pe is None else unit_last_stride(q_pe)
    split = plan.num_splits > 1
    grid = (triton.cdiv(num_heads, plan.heads_p) * plan.num_row_blocks, num_reqs, plan.num_splits)
    counters = out  # unused
    if split:
        partial, m, l = kept_split_workspace(
            num_rows, num_heads, plan.num_splits, kv_lora_rank, q.device
        )
        if plan.partials_bf16:  # the first half of each fp32 row, as bf16: the same allocation
            partial = partial.view(torch.bfloat16)[..., :kv_lora_rank]
        partial_strides, ml_strides = partial.stride()[:3], m.stride()[:2]
        if plan.merge_in_kernel and grid[0] * num_reqs > DECODE_COUNTERS:
            plan = _without_merge_in_kernel(plan)
        if plan.merge_in_kernel:
            counters = prepare_decode_counters(q.device)[ubatch * DECODE_COUNTERS :]
    else:
        partial = m = l = out  # unused
        partial_strides, ml_strides = (0, 0, 0), (0, 0)
    tensors = (q, q_pe, kv_cache, out, partial, m, l, counters, block_table, seq_lens, cu_seqlens_q)
    tensors += (kv_scales_arg(kv_scales, kv_cache),)
    scalars = (
        scale * LOG2E,
        num_reqs,
        num_rows,
        plan.num_splits,
        plan.min_tiles_per_split,
        plan.num_row_blocks,
        num_heads,
        kv_lora_rank,
        kv_cache.shape[2] - kv_lora_rank,
        block_table.shape[1],
        q.stride(0),
        q.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        out.stride(0),
        out.stride(1),
        *partial_strides,
        *ml_strides,
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
    )
    merge_pdl = split and not plan.merge_in_kernel and plan.merge_pdl and _pdl_capable(q.device)
    _DECODE_LAUNCHES(
        grid,
        tensors,
        scalars,
        _decode_constexprs(plan, kv_cache.shape[1], _product_dtype(q, kv_cache), merge_pdl),
    )
    if not split or plan.merge_in_kernel:
        return
    pdl = dict(USE_PDL=True, launch_pdl=device_info.PDL_ATTRIBUTE) if merge_pdl else {}
    splits_p = max(32, triton.next_power_of_2(plan.num_splits))  # few variants: 32, 64, 128
    dim_chunk = min(plan.lora_p, MERGE_TILE // splits_p)
    launch(
        mla_merge_kernel,
        (num_rows, num_heads, triton.cdiv(kv_lora_rank, dim_chunk)),
        partial,
        m,
        l,
        out,
        cu_seqlens_q,
        num_reqs,
        plan.num_splits,
        kv_lora_rank,
        *partial_strides,
        *ml_strides,
        out.stride(0),
        out.stride(1),
        SPLITS_P=splits_p,
        DIM_CHUNK=dim_chunk,
        num_warps=4,
        **pdl,
    )


def _pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch runs on `device` (CUDA sm90+)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=1024)
def _without_merge_in_kernel(plan: MLADecodeLaunch) -> MLADecodeLaunch:
    return dataclasses.replace(plan, merge_in_kernel=False)


def _product_dtype(q: torch.Tensor, kv_cache: torch.Tensor) -> torch.dtype:
    """The decode products' dtype: the cache's, or q's over an e4m3 cache (kv_cache_dtype fp8).
    Never memoized: a cache keyed by the tensors would keep every layer's KV cache alive after
    its engine shut down."""
    return q.dtype if kv_cache.dtype == torch.float8_e4m3fn else kv_cache.dtype


def _decode_constexprs(
    plan: MLADecodeLaunch, block_size: int, cache_dtype: torch.dtype, merge_pdl: bool = False
) -> tuple[tuple[str, object], ...]:
    """mla_decode_kernel's constexprs and launch options, in its signature's order."""
    merge_dim = min(plan.lora_p, max(16, plan.merge_regs // (plan.block_m * plan.merge_splits)))
    return (
        ("HEADS_P", plan.heads_p),
        ("BLOCK_Q", plan.block_q),
        ("BLOCK_M", plan.block_m),
        ("BLOCK_N", plan.block_n),
        ("LORA_P", plan.lora_p),
        ("ROPE_P", plan.rope_p),
        ("BLOCK_SIZE", block_size),
        ("SPLIT", plan.num_splits > 1),
        ("IEEE_DOT", cache_dtype == torch.float32),
        ("PREFETCH_BLOCKS", plan.prefetch_blocks),
        ("PREFETCH_KV", plan.prefetch_kv),
        ("MERGE_IN_KERNEL", plan.merge_in_kernel and plan.num_splits > 1),
        ("MERGE_SPLITS", plan.merge_splits),
        ("MERGE_DIM", merge_dim),
        ("LAUNCH_DEPENDENTS", merge_pdl),
        ("num_warps", plan.num_warps),
        ("num_stages", plan.num_stages),
    )


def _check_decode_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    out: torch.Tensor,
    num_kv_splits: Optional[int],
    q_pe: Optional[torch.Tensor] = None,
) -> int:
    """Validates mla_decode_attention's arguments (shapes, dtypes, layouts; nothing that needs the
    device's values); returns kv_lora_rank."""
    if q.dim() != 3 or kv_cache.dim() != 3 or out.dim() != 3:
        raise ValueError(
            f"mla_decode_attention: want q [R, H, L + P], kv_cache [num_blocks, block_size, L + P] "
            f"and out [R, H, L], got {tuple(q.shape)}, {tuple(kv_cache.shape)}, {tuple(out.shape)}"
        )
    num_rows, num_heads, width = q.shape
    kv_lora_rank = out.shape[2]
    if q_pe is not None:
        if (
            q_pe.dim() != 3
            or q_pe.shape[:2] != q.shape[:2]
            or width != kv_lora_rank
            or q_pe.dtype != q.dtype
            or q_pe.device != q.device
        ):
            raise ValueError(
                f"mla_decode_attention: with q_pe, want q [R, H, L] and q_pe [R, H, P] of one "
                f"dtype and device beside out [R, H, L], got q {tuple(q.shape)} {q.dtype}, q_pe "
                f"{tuple(q_pe.shape)} {q_pe.dtype}, out {tuple(out.shape)}"
            )
        width += q_pe.shape[2]
    if kv_cache.shape[2] != width or out.shape[:2] != q.shape[:2] or not 0 < kv_lora_rank <= width:
        raise ValueError(
            f"mla_decode_attention: q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)} and out "
            f"{tuple(out.shape)} do not fit: q and the cache rows share their width L + P, out is "
            f"[R, H, L]"
        )
    num_reqs = seq_lens.shape[0]
    if (
        seq_lens.dim() != 1
        or cu_seqlens_q.shape != (num_reqs + 1,)
        or block_table.dim() != 2
        or block_table.shape[0] < num_reqs
    ):
        raise ValueError(
            f"mla_decode_attention: seq_lens {tuple(seq_lens.shape)}, cu_seqlens_q "
            f"{tuple(cu_seqlens_q.shape)} and block_table {tuple(block_table.shape)} do not "
            f"describe B requests (want [B], [B + 1], [>= B, max_blocks])"
        )
    _check_integers(
        "mla_decode_attention",
        block_table=block_table,
        seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens_q,
    )
    if not (q.dtype.is_floating_point and kv_cache.dtype.is_floating_point):
        raise ValueError(
            f"mla_decode_attention: q {q.dtype} and kv_cache {kv_cache.dtype} must be floating point"
        )
    devices = {t.device for t in (q, kv_cache, block_table, seq_lens, cu_seqlens_q, out)}
    if len(devices) != 1:
        raise ValueError(
            f"mla_decode_attention: tensors on several devices {sorted(map(str, devices))}"
        )
    if num_kv_splits is not None and (
        isinstance(num_kv_splits, bool)
        or not isinstance(num_kv_splits, int)
        or not 1 <= num_kv_splits <= MAX_SPLITS
    ):
        raise ValueError(
            f"mla_decode_attention: num_kv_splits {num_kv_splits!r} must be an int in 1..{MAX_SPLITS}"
        )
    _check_unit_last_stride(kv_cache, "kv_cache")
    _check_unit_last_stride(out, "out")
    if block_table.stride(1) != 1:
        raise ValueError("mla_decode_attention: block_table rows must be contiguous")
    return kv_lora_rank


def _check_integers(fn: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{fn}: {name} must hold integers, has {t.dtype}")


def _check_unit_last_stride(t: torch.Tensor, name: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension, has stride {t.stride(-1)}"
        )

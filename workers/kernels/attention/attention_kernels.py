# The Triton kernels of paged attention, and nothing else: no planning, no launching.
# The launch side (which grid, which tiles, how many KV splits) is in paged_attention.py; the decode
# step's one-launch kernel is in decode_kernels.py.
#
# Shapes (T = query rows incl. padding, H = query heads, Hk = KV heads, D = head_dim, S = KV splits):
#   q, out            [T, H, D]
#   k_cache, v_cache  [num_blocks, block_size, Hk, D]
#   partial acc       [T, H, S, D] fp32, unnormalised;  partial m, l [T, H, S] fp32 (m in log2 units)
#   cu_seqlens_q      [num_seqs + 1],  context_lens [num_seqs],  block_tables [num_seqs, max_blocks]
#
# Every length is read from device memory inside the kernels, so a launch whose grid was fixed by a
# CUDA-graph bucket stays correct when replayed with new metadata in the same buffers.

import triton
import triton.language as tl

# Finite "minus infinity" for the running max: keeps exp2(m_old - m_new) free of inf - inf = NaN
# for rows that have not seen a visible key yet (or never will: padded rows, empty splits).
_NEG_BIG = tl.constexpr(-1.0e30)
FP8_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def to_cache(x, cache_ty: tl.constexpr, scale):
    """x in the cache's dtype: an e4m3 cache (kv_cache_dtype fp8) holds x / scale, its per-tensor
    scale (`load_kv_scales`), saturated at +-448 instead of overflowing; any other cache is a
    plain cast."""
    if cache_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32) / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(cache_ty)


@triton.jit
def load_kv_scales(kv_scales_ptr, cache_ty: tl.constexpr):
    """(k_scale, v_scale) of an e4m3 cache, read from `kv_scales_ptr` ([k_scale, v_scale] fp32):
    the factors that dequantize it (it holds k / k_scale, v / v_scale). Any other cache has none:
    (1.0, 1.0), nothing read. A read applies k_scale to the scores and v_scale to the output, not
    to every key and value: e4m3 values are exact in the products' dtype, so that is the same
    attention with fewer roundings."""
    if cache_ty == tl.float8e4nv:
        k_scale = tl.load(kv_scales_ptr).to(tl.float32)
        v_scale = tl.load(kv_scales_ptr + 1).to(tl.float32)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k_scale, v_scale


@triton.jit
def slot_ptrs(cache_ptr, block, offset, heads, cols, stride_b, stride_s, stride_h):
    """Pointers [heads, cols] into cache slot `offset` of block `block` of a cache [num_blocks,
    block_size, heads, D] with those strides."""
    return (
        cache_ptr + block * stride_b + offset * stride_s + heads[:, None] * stride_h + cols[None, :]
    )


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,  # [T, Hk, D]
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, Hk, D]
    slot_mapping_ptr,  # [T] int64, -1 = padded row
    kv_scales_ptr,  # [k_scale, v_scale] fp32: an e4m3 cache's (load_kv_scales)
    row_strides,  # (token, head) strides of k, then of v
    cache_strides,  # (block, slot, head) strides of k_cache, then of v_cache
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    """One program copies HEADS_PER_PROG heads of one token row into its cache slot."""
    stride_kt, stride_kh, stride_vt, stride_vh = row_strides
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch = cache_strides
    row = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.program_id(1) * HEADS_PER_PROG + tl.arange(0, HEADS_PER_PROG)
    dims = tl.arange(0, HEAD_DIM_P)
    mask = (heads < num_kv_heads)[:, None] & (dims < head_dim)[None, :]
    # [HEADS_PER_PROG, HEAD_DIM_P]
    k = tl.load(k_ptr + row * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + row * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = slot_ptrs(k_cache_ptr, block, offset, heads, dims, stride_kcb, stride_kcs, stride_kch)
    v_dst = slot_ptrs(v_cache_ptr, block, offset, heads, dims, stride_vcb, stride_vcs, stride_vch)
    cache_ty = k_cache_ptr.dtype.element_ty
    k_scale, v_scale = load_kv_scales(kv_scales_ptr, cache_ty)
    tl.store(k_dst, to_cache(k, cache_ty, k_scale), mask=mask)
    tl.store(v_dst, to_cache(v, cache_ty, v_scale), mask=mask)


@triton.jit
def rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,  # q [T, H, D], k/v [T, Hk, D]
    q_out_ptr,  # [T, H, D] contiguous: the rotated q
    positions_ptr,  # [T] int64
    cos_ptr,
    sin_ptr,  # [max_position, D / 2] fp32, contiguous
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, Hk, D]
    slot_mapping_ptr,  # [T] int64, -1 = padded row (rotated q only, nothing written to the cache)
    kv_scales_ptr,  # [k_scale, v_scale] fp32: an e4m3 cache's (load_kv_scales)
    row_strides,  # (token, head) strides of q, k, v
    cache_strides,  # (block, slot, head) strides of k_cache, then of v_cache
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,  # head_dim / 2
    BLOCK_SIZE: tl.constexpr,
    HEADS_P: tl.constexpr,  # next pow2 of num_heads
    KV_HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr,
):
    """One program per token row: rotary embedding (half-split layout) of q into q_out and of k, then
    k and v into the row's cache slot. cos/sin are rounded to q's dtype first and each rotated value
    is rounded once, from fp32 (Hugging Face computes `q * cos + rotate_half(q) * sin` in q's dtype)."""
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh = row_strides
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch = cache_strides
    row = tl.program_id(0)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    half = tl.arange(0, HALF_P)
    half_mask = half < HALF
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * HALF + half, mask=half_mask).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + half, mask=half_mask).to(dtype).to(tl.float32)[None, :]

    heads = tl.arange(0, HEADS_P)
    mask = (heads < num_heads)[:, None] & half_mask[None, :]
    src = q_ptr + row * stride_qt + heads[:, None] * stride_qh + half[None, :]
    x1 = tl.load(src, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask).to(tl.float32)
    dst = q_out_ptr + row * num_heads * 2 * HALF + heads[:, None] * 2 * HALF + half[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)

    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    kv_heads = tl.arange(0, KV_HEADS_P)
    kv_mask = (kv_heads < num_kv_heads)[:, None] & half_mask[None, :]
    src = k_ptr + row * stride_kt + kv_heads[:, None] * stride_kh + half[None, :]
    k1 = tl.load(src, mask=kv_mask).to(tl.float32)
    k2 = tl.load(src + HALF, mask=kv_mask).to(tl.float32)
    cache_ty = k_cache_ptr.dtype.element_ty
    k_scale, v_scale = load_kv_scales(kv_scales_ptr, cache_ty)
    # Round to q's dtype (what the unfused rotary hands over), then to the cache's.
    k_dst = slot_ptrs(
        k_cache_ptr, block, offset, kv_heads, half, stride_kcb, stride_kcs, stride_kch
    )
    tl.store(k_dst, to_cache((k1 * cos - k2 * sin).to(dtype), cache_ty, k_scale), mask=kv_mask)
    tl.store(
        k_dst + HALF, to_cache((k2 * cos + k1 * sin).to(dtype), cache_ty, k_scale), mask=kv_mask
    )
    v_src = v_ptr + row * stride_vt + kv_heads[:, None] * stride_vh + half[None, :]
    v_dst = slot_ptrs(
        v_cache_ptr, block, offset, kv_heads, half, stride_vcb, stride_vcs, stride_vch
    )
    v1 = tl.load(v_src, mask=kv_mask)
    v2 = tl.load(v_src + HALF, mask=kv_mask)
    tl.store(v_dst, to_cache(v1, cache_ty, v_scale), mask=kv_mask)
    tl.store(v_dst + HALF, to_cache(v2, cache_ty, v_scale), mask=kv_mask)


# The lengths a step changes are not specialized on (Triton would compile a kernel per "== 1" and
# "% 16 == 0" class of each): only the constexprs pick a compiled variant, which start-up warms.
@triton.jit(do_not_specialize=["num_q_blocks", "num_splits"])
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,  # SPLIT: partial acc [T, H, S, D] fp32; else out [T, H, D]
    m_ptr,
    l_ptr,  # SPLIT only: [T, H, S] fp32
    cu_seqlens_q_ptr,
    context_lens_ptr,
    block_tables_ptr,
    kv_scales_ptr,  # [k_scale, v_scale] fp32: an e4m3 cache's (load_kv_scales)
    scale_log2,  # softmax scale * log2(e)
    num_q_blocks,  # query tiles per sequence (grid dim 0 = num_seqs * num_q_blocks)
    num_splits,  # grid dim 2
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_os,  # stride_os: split stride of the partial acc (SPLIT only)
    stride_mt,
    stride_mh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query rows (tokens) per tile
    BLOCK_M: tl.constexpr,  # = BLOCK_Q * GROUP_P: tile rows, one per (token, head of the group)
    HEAD_DIM_P: tl.constexpr,
    TILE_N: tl.constexpr,  # keys per inner iteration (may span several cache blocks)
    BLOCK_SIZE: tl.constexpr,  # cache block size
    SPLIT: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # fp32 inputs: full-precision dots instead of tf32
):
    """Causal attention of one query tile of one sequence over one KV head, for one KV split.

    The tile packs BLOCK_Q consecutive query rows of the sequence times the GROUP query heads that
    share KV head `kvh`, so GQA reads each key once for the whole group. Row r of the tile is token
    r // GROUP_P of the tile and head kvh * GROUP + r % GROUP_P.
    """
    pid_q = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = pid_q // num_q_blocks
    q_block = pid_q % num_q_blocks

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    num_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= num_q:  # past this sequence's rows (padded sequences have none)
        return
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP_P  # query row within the sequence
    g = rows % GROUP_P
    row_valid = (tok < num_q) & (g < GROUP)
    head = kvh * GROUP + g
    q_pos = context_len - num_q + tok  # absolute position: sees keys 0..q_pos
    q_row = (q_start + tok).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < head_dim

    # [BLOCK_M, HEAD_DIM_P]
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    k_scale, v_scale = load_kv_scales(kv_scales_ptr, k_cache_ptr.dtype.element_ty)
    scale_log2 = scale_log2 * k_scale  # scores of the keys as the cache holds them

    # Keys this tile can see end at its last row's position; split them into num_splits ranges.
    last_tok = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, num_q) - 1
    kv_len = tl.maximum(context_len - num_q + last_tok + 1, 0)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(tile_begin, tile_end):
        keys = t * TILE_N + tl.arange(0, TILE_N)
        key_valid = keys < kv_len
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        in_block = keys % BLOCK_SIZE
        # K^T tile [HEAD_DIM_P, TILE_N], V tile [TILE_N, HEAD_DIM_P]
        k_off = block * stride_kb + in_block * stride_ks + kvh * stride_kh
        k = tl.load(
            k_cache_ptr + k_off[None, :] + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        ).to(q.dtype)  # widened from an e4m3 cache
        if IEEE_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale_log2  # [BLOCK_M, TILE_N], log2 units
        visible = row_valid[:, None] & (keys[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block * stride_vb + in_block * stride_vs + kvh * stride_vh
        v = tl.load(
            v_cache_ptr + v_off[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        ).to(q.dtype)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc * v_scale  # the values as the cache holds them: dequantized once, here
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if SPLIT:
        o_ptrs = (
            out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os
        )
        tl.store(o_ptrs + dims[None, :], acc, mask=store_mask)
        ml_off = q_row * stride_mt + head * stride_mh + split
        tl.store(m_ptr + ml_off, m_i, mask=row_valid)
        tl.store(l_ptr + ml_off, l_i, mask=row_valid)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_ptrs = out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def reduce_splits_kernel(
    acc_ptr,  # [T, H, S, D] fp32
    m_ptr,
    l_ptr,  # [T, H, S] fp32
    out_ptr,  # [T, H, D]
    cu_seqlens_q_ptr,
    num_seqs,
    num_splits,
    stride_at,
    stride_ah,
    stride_as,
    stride_mt,
    stride_mh,
    stride_ot,
    stride_oh,
    head_dim,
    SPLITS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    """Merges the KV splits of one (row, head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    num_rows = tl.load(cu_seqlens_q_ptr + num_seqs)
    if row >= num_rows:  # padded row: left as it is
        return
    row64 = row.to(tl.int64)
    splits = tl.arange(0, SPLITS_P)
    split_valid = splits < num_splits
    ml_off = row64 * stride_mt + head * stride_mh + splits
    m = tl.load(m_ptr + ml_off, mask=split_valid, other=_NEG_BIG)
    l = tl.load(l_ptr + ml_off, mask=split_valid, other=0.0)
    w = tl.where(split_valid, tl.exp2(m - tl.max(m, 0)), 0.0)  # [SPLITS_P]
    l_total = tl.sum(w * l, 0)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < head_dim
    a_ptrs = (
        acc_ptr + row64 * stride_at + head * stride_ah + splits[:, None] * stride_as + dims[None, :]
    )
    acc = tl.load(
        a_ptrs, mask=split_valid[:, None] & dim_valid[None, :], other=0.0
    )  # [SPLITS_P, HEAD_DIM_P]
    o = tl.sum(w[:, None] * acc, 0) / tl.where(l_total > 0.0, l_total, 1.0)
    tl.store(
        out_ptr + row64 * stride_ot + head * stride_oh + dims,
        o.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )

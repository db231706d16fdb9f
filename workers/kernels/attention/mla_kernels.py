# The Triton kernels of multi-head latent attention (MLA), and nothing else: the latent KV cache
# write and the paged decode over that cache (the merge of its KV splits is in mla_merge_kernels.py).
# The launch side (plans, split counts, workspace) is in mla_decode.py.
#
# Shapes (R = query rows incl. padding, H = query heads, L = kv_lora_rank, P = rotary dim, D = L + P,
# S = KV splits, B = requests):
#   q             [R, H, D]  absorbed query: columns :L meet the latent, columns L: the rotary key
#   kv_cache      [num_blocks, block_size, D]  per token the normalised latent, then the rotated k_pe
#   out           [R, H, L]
#   partial acc   [R, H, S, L] fp32 (or bf16), unnormalised;  m, l [R, H, S] fp32 (m in log2 units)
#   cu_seqlens_q  [B + 1],  seq_lens [B],  block_table [B, max_blocks]
#
# MLA decode is MQA over one latent head: K is the whole cache row and V its first L columns, so each
# cache tile is loaded once and serves both products, for every query head of the tile at once.
# Every length is read from device memory, so a launch fixed by a CUDA-graph bucket stays correct
# when replayed with new metadata in the same buffers.

import triton
import triton.language as tl

from atomrt.workers.kernels.attention.attention_kernels import _NEG_BIG, load_kv_scales, to_cache
from atomrt.workers.kernels.attention.mla_merge_kernels import _merge_splits


@triton.jit
def mla_write_kv_kernel(
    kv_c_ptr,  # [T, L] normalised latent
    k_pe_ptr,  # [T, P] rotated key part
    kv_cache_ptr,  # [num_blocks, block_size, L + P]
    slot_mapping_ptr,  # [T] int64, < 0 = padded row (skipped)
    kv_scales_ptr,  # an e4m3 cache's [k_scale, ...] fp32: the latent cache's one scale is k_scale
    stride_ct,
    stride_pt,
    stride_cb,
    stride_cs,
    num_slots,  # num_blocks * block_size: a slot past the cache is skipped, never written
    kv_lora_rank,
    rope_dim,
    BLOCK_SIZE: tl.constexpr,
    LORA_P: tl.constexpr,
    ROPE_P: tl.constexpr,
):
    """One program writes one token's cache row: the latent, then k_pe, in the cache's dtype."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    dst = kv_cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    cache_ty = kv_cache_ptr.dtype.element_ty
    scale, _ = load_kv_scales(kv_scales_ptr, cache_ty)
    lora = tl.arange(0, LORA_P)
    lora_valid = lora < kv_lora_rank
    latent = tl.load(kv_c_ptr + row * stride_ct + lora, mask=lora_valid)
    tl.store(dst + lora, to_cache(latent, cache_ty, scale), mask=lora_valid)
    rope = tl.arange(0, ROPE_P)
    rope_valid = rope < rope_dim
    k_pe = tl.load(k_pe_ptr + row * stride_pt + rope, mask=rope_valid)
    tl.store(dst + kv_lora_rank + rope, to_cache(k_pe, cache_ty, scale), mask=rope_valid)


@triton.jit
def _rotate_rows(x_ptrs, pos_rows, cos_ptr, sin_ptr, rope, rope_valid, rows_valid, HALF,
                 dtype: tl.constexpr, INTERLEAVED: tl.constexpr):  # fmt: skip
    """Rows [..., ROPE_P] of a rotary part rotated as RotaryEmbedding rotates them (its output
    de-interleaved when INTERLEAVED): each output element (x_a cos -+ x_b sin) with cos and sin
    rounded to `dtype`, each product and the sum rounded to it, as eager torch rounds them.
    `x_ptrs` points at each row's first rotary element, `pos_rows` [rows] at the rows' positions."""
    first = rope < HALF
    freq = tl.where(first, rope, rope - HALF)
    if INTERLEAVED:  # x1 = x[0::2], x2 = x[1::2]
        src_a = tl.where(first, 2 * freq, 2 * freq + 1)
        src_b = tl.where(first, 2 * freq + 1, 2 * freq)
    else:  # x1 = x[:HALF], x2 = x[HALF:]
        src_a = rope
        src_b = tl.where(first, rope + HALF, rope - HALF)
    mask = rows_valid[:, None] & rope_valid[None, :]
    a = tl.load(x_ptrs[:, None] + src_a[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptrs[:, None] + src_b[None, :], mask=mask, other=0.0).to(tl.float32)
    cs_off = pos_rows[:, None] * HALF + freq[None, :]
    cos = tl.load(cos_ptr + cs_off, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + cs_off, mask=mask, other=0.0).to(dtype).to(tl.float32)
    ac = (a * cos).to(dtype).to(tl.float32)
    bs = (b * sin).to(dtype).to(tl.float32)
    return tl.where(first[None, :], ac - bs, ac + bs).to(dtype)


@triton.jit
def mla_rope_write_kv_kernel(
    q_pe_ptr,  # [T, H, P] the query's rotary part, not rotated (any row and head strides)
    q_out_ptr,  # [T, H, P] out: q_pe rotated
    kv_c_ptr,  # [T, L] normalised latent
    k_pe_ptr,  # [T, P] the key's rotary part, not rotated
    positions_ptr,  # [T] int64
    cos_ptr,
    sin_ptr,  # [max_position, P / 2] float32
    kv_cache_ptr,  # [num_blocks, block_size, L + P]
    slot_mapping_ptr,  # [T] int64, < 0 = padded row (nothing written)
    kv_scales_ptr,  # an e4m3 cache's [k_scale, ...] fp32: the latent cache's one scale is k_scale
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_pt,
    stride_cb,
    stride_cs,
    num_heads,
    num_slots,  # num_blocks * block_size: a slot past the cache is skipped, never written
    kv_lora_rank,
    rope_dim,
    BLOCK_SIZE: tl.constexpr,
    HEADS_P: tl.constexpr,
    LORA_P: tl.constexpr,
    ROPE_P: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """One program per token: the rotary embedding of its query heads' q_pe (into q_out) and of
    its k_pe, and its cache row [latent | rotated k_pe] in the cache's dtype: what the MLA op ran as
    RotaryEmbedding's torch kernels, a cat and mla_write_kv_kernel, in one launch."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    half = rope_dim // 2
    rope = tl.arange(0, ROPE_P)
    rope_valid = rope < rope_dim
    heads = tl.arange(0, HEADS_P)
    heads_valid = heads < num_heads
    pos_rows = pos + tl.zeros([HEADS_P], dtype=tl.int64)
    q_rot = _rotate_rows(
        q_pe_ptr + row * stride_qt + heads * stride_qh, pos_rows, cos_ptr, sin_ptr, rope,
        rope_valid, heads_valid, half, dtype, INTERLEAVED,
    )  # fmt: skip
    out = q_out_ptr + row * stride_ot + heads[:, None] * stride_oh + rope[None, :]
    tl.store(out, q_rot, mask=heads_valid[:, None] & rope_valid[None, :])
    if (slot < 0) | (slot >= num_slots):
        return
    one = tl.arange(0, 1)
    k_rot = _rotate_rows(
        k_pe_ptr + row * stride_pt + one * 0, pos + one * 0, cos_ptr, sin_ptr, rope, rope_valid,
        one == 0, half, dtype, INTERLEAVED,
    )  # fmt: skip  # [1, ROPE_P]
    dst = kv_cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    cache_ty = kv_cache_ptr.dtype.element_ty
    scale, _ = load_kv_scales(kv_scales_ptr, cache_ty)
    lora = tl.arange(0, LORA_P)
    lora_valid = lora < kv_lora_rank
    latent = tl.load(kv_c_ptr + row * stride_ct + lora, mask=lora_valid)
    tl.store(dst + lora, to_cache(latent, cache_ty, scale), mask=lora_valid)
    k_dst = dst + kv_lora_rank + one[:, None] * 0 + rope[None, :]
    tl.store(k_dst, to_cache(k_rot, cache_ty, scale), mask=rope_valid[None, :])


@triton.jit
def _zero_unowned_rows(
    out_ptr,
    cu_seqlens_q_ptr,
    req,
    head_tile,
    num_reqs,
    num_rows,
    num_heads,
    kv_lora_rank,
    stride_or,
    stride_oh,
    HEADS_P: tl.constexpr,
    LORA_P: tl.constexpr,
):
    """Zeros this head tile of the rows past the last request's (rows of no request), every
    num_reqs-th from the request's own index, so that the requests' programs share them out."""
    heads = head_tile * HEADS_P + tl.arange(0, HEADS_P)
    lora = tl.arange(0, LORA_P)
    mask = (heads < num_heads)[:, None] & (lora < kv_lora_rank)[None, :]
    zeros = tl.zeros([HEADS_P, LORA_P], dtype=out_ptr.dtype.element_ty)
    first = (tl.load(cu_seqlens_q_ptr + num_reqs) + req).to(tl.int64)
    for i in range(0, tl.cdiv(tl.maximum(num_rows - first, 0), num_reqs)):
        row = first + i * num_reqs
        dst = out_ptr + row * stride_or + heads[:, None] * stride_oh + lora[None, :]
        tl.store(dst, zeros, mask=mask)


@triton.jit
def _tile_blocks(table_row, t, tile_end, kv_len, max_blocks, key_offsets, BLOCK_N: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """The cache block of each key of key tile `t` [BLOCK_N] int64 (0 where the key is past
    kv_len, the block table, or the split's tiles)."""
    keys = t * BLOCK_N + key_offsets
    cols = keys // BLOCK_SIZE
    valid = (keys < kv_len) & (cols < max_blocks) & (keys < tile_end * BLOCK_N)
    return tl.load(table_row + cols, mask=valid, other=0).to(tl.int64)


@triton.jit
def _load_tile(kv_cache_ptr, table_row, t, tile_end, kv_len, max_blocks, key_offsets, lora,
               lora_valid, rope, rope_valid, kv_lora_rank, stride_cb, stride_cs, cache_ty,
               BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """Key tile `t`'s cache rows: latent [BLOCK_N, LORA_P] and rotary part [BLOCK_N, ROPE_P] in
    `cache_ty`, the keys and their validity (none past tile_end: such a tile loads nothing)."""
    keys = t * BLOCK_N + key_offsets
    cols = keys // BLOCK_SIZE
    key_valid = (keys < kv_len) & (cols < max_blocks) & (keys < tile_end * BLOCK_N)
    block = tl.load(table_row + cols, mask=key_valid, other=0).to(tl.int64)
    row_ptr = kv_cache_ptr + block * stride_cb + (keys % BLOCK_SIZE) * stride_cs
    kv = tl.load(
        row_ptr[:, None] + lora[None, :], mask=key_valid[:, None] & lora_valid[None, :], other=0.0
    ).to(cache_ty)
    k_pe = tl.load(
        row_ptr[:, None] + kv_lora_rank + rope[None, :],
        mask=key_valid[:, None] & rope_valid[None, :],
        other=0.0,
    ).to(cache_ty)
    return kv, k_pe, keys, key_valid


# The lengths a step changes are not specialized on: only the constexprs pick a compiled variant.
@triton.jit(do_not_specialize=["num_reqs", "num_rows", "num_splits", "num_row_blocks"])
def mla_decode_kernel(
    q_ptr,  # [R, H, L (+ P)]: the absorbed query's latent part (q_pe may follow it)
    q_pe_ptr,  # [R, H, P]: its rotary part (a view of q_ptr's last P columns, or apart)
    kv_cache_ptr,  # [num_blocks, block_size, L + P]
    out_ptr,  # [R, H, L]
    partial_ptr,
    m_ptr,
    l_ptr,  # SPLIT only: partial acc [R, H, S, L] fp32; m, l [R, H, S] fp32
    counter_ptr,  # MERGE_IN_KERNEL only: [>= B * grid dim 0] int32, zero between launches
    block_table_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B], keys of each request including this step's rows
    cu_seqlens_q_ptr,  # [B + 1]
    kv_scales_ptr,  # an e4m3 cache's [k_scale, ...] fp32: the latent cache's one scale is k_scale
    scale_log2,  # softmax scale * log2(e)
    num_reqs,  # B (grid dim 1)
    num_rows,  # R
    num_splits,  # S (grid dim 2); the live context decides how many of them work
    min_tiles_per_split,  # a working split takes at least this many key tiles
    num_row_blocks,  # programs per request and head tile that share its query tiles out
    num_heads,
    kv_lora_rank,
    rope_dim,
    max_blocks,  # block_table columns
    stride_qr,
    stride_qh,
    stride_qpr,
    stride_qph,
    stride_or,
    stride_oh,
    stride_pr,
    stride_ph,
    stride_ps,
    stride_mr,
    stride_mh,
    stride_cb,
    stride_cs,
    stride_bt,
    HEADS_P: tl.constexpr,  # query heads per tile (a power of two)
    BLOCK_Q: tl.constexpr,  # query rows per tile
    BLOCK_M: tl.constexpr,  # tile rows, >= 16 for tl.dot: row r is query row r // HEADS_P, head r % HEADS_P
    BLOCK_N: tl.constexpr,  # keys per inner iteration (may span several cache blocks)
    LORA_P: tl.constexpr,  # kv_lora_rank rounded up to a power of two
    ROPE_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    SPLIT: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # fp32 cache: full-precision dots instead of tf32
    PREFETCH_BLOCKS: tl.constexpr,  # each tile's block ids load with the tile before's rows
    PREFETCH_KV: tl.constexpr,  # each tile's rows load before the tile before is summed
    MERGE_IN_KERNEL: tl.constexpr,  # SPLIT: the last split program to finish merges the splits
    MERGE_SPLITS: tl.constexpr,  # splits the merging program reads per step
    MERGE_DIM: tl.constexpr,  # latent columns it merges per step
    LAUNCH_DEPENDENTS: tl.constexpr,  # the merge launch that follows waits on it (merge_pdl)
):
    """Causal attention of a request's query rows, for one tile of heads, over one KV split.

    Query row j of a request with n rows sits at position seq_len - n + j and sees keys 0..that
    position. The request's key tiles go in contiguous runs to as many of the launch's splits as
    its live context fills (min_tiles_per_split each, one at least); each tile is loaded once for
    all BLOCK_Q rows x HEADS_P heads of a query tile. A request's query tiles are shared out
    round-robin among num_row_blocks programs (one for decode), each taking its tiles in turn.

    With SPLIT every split leaves m and l of each of its rows for mla_merge_kernel, and its
    unnormalised output where it saw a key (l > 0: the only partials the merge reads); a split past
    the working ones loads nothing and leaves m = -big, l = 0. Otherwise the program writes `out`.
    A row that sees no key (a padded request of seq_len 0) gets zeros, never 0/0.

    With MERGE_IN_KERNEL there is no merge launch: a lone working split writes `out` itself, idle
    splits return at once, and each working split, its partials stored, takes a ticket from its
    (request, program column) counter; the one that takes the last merges every split's partials
    of its query tiles into `out` (_merge_splits) and zeros the counter for the next launch.
    """
    if LAUNCH_DEPENDENTS:  # the merge may be scheduled now: it waits for this whole grid to finish
        tl.extra.cuda.gdc_launch_dependents()
    num_head_tiles = tl.cdiv(num_heads, HEADS_P)
    head_tile = tl.program_id(0) % num_head_tiles  # a row block's head tiles are neighbours
    row_block = tl.program_id(0) // num_head_tiles
    req = tl.program_id(1)
    split = tl.program_id(2)
    if (split == 0) & (row_block == 0):
        _zero_unowned_rows(
            out_ptr, cu_seqlens_q_ptr, req, head_tile, num_reqs, num_rows, num_heads,
            kv_lora_rank, stride_or, stride_oh, HEADS_P, LORA_P,
        )  # fmt: skip
    q_start = tl.load(cu_seqlens_q_ptr + req)
    num_q = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
    seq_len = tl.maximum(tl.load(seq_lens_ptr + req), 0)

    rows = tl.arange(0, BLOCK_M)
    head = head_tile * HEADS_P + rows % HEADS_P
    tile_row_valid = (rows // HEADS_P < BLOCK_Q) & (head < num_heads)
    lora = tl.arange(0, LORA_P)
    lora_valid = lora < kv_lora_rank
    rope = tl.arange(0, ROPE_P)
    rope_valid = rope < rope_dim
    key_offsets = tl.arange(0, BLOCK_N)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    cache_ty = kv_cache_ptr.dtype.element_ty  # the products' dtype
    # keys and values (one cache row) stay as the cache holds them: the scores and the output
    # take the cache's scale (1.0 unless it is e4m3)
    kv_scale, _ = load_kv_scales(kv_scales_ptr, cache_ty)
    scale_log2 = scale_log2 * kv_scale
    if cache_ty == tl.float8e4nv:  # kv_cache_dtype fp8: rows widened to q's dtype as they are read
        cache_ty = q_ptr.dtype.element_ty

    # This split's key tiles, out of those of the request's last row (the one that sees the most).
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    num_active = tl.maximum(tl.minimum(num_splits, tl.cdiv(num_tiles, min_tiles_per_split)), 1)
    num_q_active = tl.where(split < num_active, num_q, 0)  # an idle split loads no row
    tiles_per_split = tl.cdiv(num_tiles, num_active)
    split_begin = split * tiles_per_split
    split_end = tl.minimum(split_begin + tiles_per_split, num_tiles)
    to_out = not SPLIT
    if MERGE_IN_KERNEL:
        if split >= num_active:
            return
        to_out = num_active == 1

    for q0 in range(row_block * BLOCK_Q, num_q, num_row_blocks * BLOCK_Q):
        tok = q0 + rows // HEADS_P  # query row within the request
        row_valid = tile_row_valid & (tok < num_q)
        q_pos = seq_len - num_q + tok  # sees keys 0..q_pos
        q_row = (q_start + tok).to(tl.int64)
        q_base = q_ptr + q_row * stride_qr + head * stride_qh  # [BLOCK_M]
        q_valid = tile_row_valid & (tok < num_q_active)
        q_nope = tl.load(
            q_base[:, None] + lora[None, :],
            mask=q_valid[:, None] & lora_valid[None, :],
            other=0.0,
        ).to(cache_ty)  # [BLOCK_M, LORA_P]
        q_pe_base = q_pe_ptr + q_row * stride_qpr + head * stride_qph  # [BLOCK_M]
        q_pe = tl.load(
            q_pe_base[:, None] + rope[None, :],
            mask=q_valid[:, None] & rope_valid[None, :],
            other=0.0,
        ).to(cache_ty)  # [BLOCK_M, ROPE_P]
        # keys the tile's last row sees: later tiles of the split hold nothing for this query tile
        kv_len = seq_len - num_q + tl.minimum(q0 + BLOCK_Q, num_q)
        tile_end = tl.minimum(split_end, tl.cdiv(tl.maximum(kv_len, 0), BLOCK_N))

        m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, LORA_P], tl.float32)
        if PREFETCH_KV:  # the first tile's rows; each iteration loads the next one's
            kv_next, k_pe_next, keys_next, valid_next = _load_tile(
                kv_cache_ptr, table_row, split_begin, tile_end, kv_len, max_blocks, key_offsets,
                lora, lora_valid, rope, rope_valid, kv_lora_rank, stride_cb, stride_cs, cache_ty,
                BLOCK_N, BLOCK_SIZE,
            )  # fmt: skip
        elif PREFETCH_BLOCKS:  # the first tile's block ids; each iteration loads the next one's
            block = _tile_blocks(
                table_row, split_begin, tile_end, kv_len, max_blocks, key_offsets, BLOCK_N,
                BLOCK_SIZE,
            )  # fmt: skip
        for t in range(split_begin, tile_end):
            if PREFETCH_KV:  # this tile's rows came in during the tile before: out go the next's
                kv, k_pe, keys, key_valid = kv_next, k_pe_next, keys_next, valid_next
                kv_next, k_pe_next, keys_next, valid_next = _load_tile(
                    kv_cache_ptr, table_row, t + 1, tile_end, kv_len, max_blocks, key_offsets,
                    lora, lora_valid, rope, rope_valid, kv_lora_rank, stride_cb, stride_cs,
                    cache_ty, BLOCK_N, BLOCK_SIZE,
                )  # fmt: skip
            else:
                keys = t * BLOCK_N + key_offsets
                cols = keys // BLOCK_SIZE
                key_valid = (keys < kv_len) & (cols < max_blocks)
                if not PREFETCH_BLOCKS:
                    block = tl.load(table_row + cols, mask=key_valid, other=0).to(tl.int64)
                row_ptr = kv_cache_ptr + block * stride_cb + (keys % BLOCK_SIZE) * stride_cs
                kv = tl.load(
                    row_ptr[:, None] + lora[None, :],
                    mask=key_valid[:, None] & lora_valid[None, :],
                    other=0.0,
                ).to(cache_ty)  # [BLOCK_N, LORA_P]: the keys' latent part, and the values
                k_pe = tl.load(
                    row_ptr[:, None] + kv_lora_rank + rope[None, :],
                    mask=key_valid[:, None] & rope_valid[None, :],
                    other=0.0,
                ).to(cache_ty)  # [BLOCK_N, ROPE_P]
                if PREFETCH_BLOCKS:  # out with this tile's rows: one dependent round trip a tile
                    block = _tile_blocks(
                        table_row, t + 1, tile_end, kv_len, max_blocks, key_offsets, BLOCK_N,
                        BLOCK_SIZE,
                    )  # fmt: skip
            if IEEE_DOT:
                s = tl.dot(q_nope, tl.trans(kv), input_precision="ieee")
                s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee")
            else:
                s = tl.dot(q_pe, tl.trans(k_pe), tl.dot(q_nope, tl.trans(kv)))
            visible = row_valid[:, None] & key_valid[None, :] & (keys[None, :] <= q_pos[:, None])
            s = tl.where(visible, s * scale_log2, float("-inf"))  # [BLOCK_M, BLOCK_N], log2 units
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p.to(cache_ty), kv, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(cache_ty), kv)
            m_i = m_new

        acc = acc * kv_scale
        store_mask = row_valid[:, None] & lora_valid[None, :]
        if to_out:
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            o_ptrs = out_ptr + q_row * stride_or + head * stride_oh
            tl.store(
                o_ptrs[:, None] + lora[None, :],
                (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
                mask=store_mask,
            )
        else:
            p_ptrs = partial_ptr + q_row * stride_pr + head * stride_ph + split * stride_ps
            saw_key = store_mask & (l_i > 0.0)[:, None]
            if MERGE_IN_KERNEL:  # every row's (zeros where no key was seen): see _merge_splits
                saw_key = store_mask
            p_ty = partial_ptr.dtype.element_ty  # fp32, or bf16 (partials_bf16)
            tl.store(p_ptrs[:, None] + lora[None, :], acc.to(p_ty), mask=saw_key)
            ml_off = q_row * stride_mr + head * stride_mh + split
            tl.store(m_ptr + ml_off, m_i, mask=row_valid)
            tl.store(l_ptr + ml_off, l_i, mask=row_valid)

    if MERGE_IN_KERNEL:
        if num_active > 1:
            # Every thread's stores, then one release/acquire bump (the last-block pattern).
            tl.debug_barrier()
            counter = counter_ptr + req * tl.num_programs(0) + tl.program_id(0)
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_active - 1:
                for q0 in range(row_block * BLOCK_Q, num_q, num_row_blocks * BLOCK_Q):
                    tok = q0 + rows // HEADS_P
                    _merge_splits(
                        partial_ptr, m_ptr, l_ptr, out_ptr, (q_start + tok).to(tl.int64), head,
                        tile_row_valid & (tok < num_q), num_active, kv_lora_rank, stride_pr,
                        stride_ph, stride_ps, stride_mr, stride_mh, stride_or, stride_oh, BLOCK_M,
                        LORA_P, MERGE_SPLITS, MERGE_DIM,
                    )  # fmt: skip
                tl.store(counter, 0)

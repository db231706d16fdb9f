# The Triton kernel of a decode step's attention, and nothing else: rotary, the KV write and attention
# of one query row per sequence in one launch, a long context split over the KV with the splits merged
# in the same launch (the program that finishes last merges). The launch side is in
# decode_attention.py; the prefill / mixed kernels, and the separate split merge those use, are in
# attention_kernels.py, whose shape conventions this follows.

import triton
import triton.language as tl

from atomrt.workers.kernels.attention.attention_kernels import _NEG_BIG, load_kv_scales, to_cache

F16_SAFE = tl.constexpr(32768.0)  # half of float16's largest finite value, 65504


@triton.jit
def _decode_row(row, num_rows, kvh, ptrs, strides, lanes, HAS_ROPE: tl.constexpr):
    """Loads what the decode kernel reads of query row `row` (row 0 in its place when `row` is past
    the `num_rows` rows, for a guess the caller discards): q of the group's heads, the new key and
    value of KV head `kvh` (with their rotary partners), its position and cache slot. `ptrs`,
    `strides` and `lanes` are the kernel's, as it packs them."""
    q_ptr, k_ptr, v_ptr, positions_ptr, slot_mapping_ptr = ptrs
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh = strides
    head, row_valid, dims, dim_valid, partner = lanes
    row = tl.where(row < num_rows, row, 0).to(tl.int64)
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q_src = q_ptr + row * stride_qt + head[:, None] * stride_qh
    k_src = k_ptr + row * stride_kt + kvh * stride_kh
    q = tl.load(q_src + dims[None, :], mask=q_mask, other=0.0).to(
        tl.float32
    )  # [BLOCK_M, HEAD_DIM_P]
    k_new = tl.load(k_src + dims, mask=dim_valid, other=0.0).to(tl.float32)  # [HEAD_DIM_P]
    v_new = tl.load(v_ptr + row * stride_vt + kvh * stride_vh + dims, mask=dim_valid, other=0.0)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    if HAS_ROPE:
        q_partner = tl.load(q_src + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
        k_partner = tl.load(k_src + partner, mask=dim_valid, other=0.0).to(tl.float32)
        pos = tl.load(positions_ptr + row).to(tl.int64)
    else:
        q_partner = q
        k_partner = k_new
        pos = row
    return q, q_partner, k_new, k_partner, v_new, slot, pos


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, block, keys, kv_mask, dims, kvh, stride_kcb,
                  stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                  BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """The K and V rows [TILE_N, HEAD_DIM_P] of `keys` (in cache block `block` each) of KV head
    `kvh`, as the cache holds them; masked rows and dims read 0."""
    in_block = keys % BLOCK_SIZE
    k_off = block * stride_kcb + in_block * stride_kcs + kvh * stride_kch
    v_off = block * stride_vcb + in_block * stride_vcs + kvh * stride_vch
    k = tl.load(k_cache_ptr + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _swap_pairs(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """x [ROWS, COLS] with columns 2i and 2i + 1 swapped (its own inverse)."""
    even, odd = tl.split(tl.reshape(x, (ROWS, COLS // 2, 2)))
    return tl.reshape(tl.join(odd, even), (ROWS, COLS))


@triton.jit
def _widen_v(v, prod_ty: tl.constexpr, WIDEN_V_FIRST: tl.constexpr, TILE_N: tl.constexpr,
             HEAD_DIM_P: tl.constexpr):  # fmt: skip
    """A V tile [TILE_N, HEAD_DIM_P] in the products' dtype. tl.dot takes V's keys as its reduced
    dim, so the tile changes layout through shared memory on its way there; Triton moves an e4m3
    tile's widening after that change, which then reads shared memory a byte at a time.
    WIDEN_V_FIRST widens it first and swaps its column pairs, which keeps the widening there (the
    layout change then moves 16-bit values): the products land in column-swapped output, which the
    kernel swaps into and back out of around the key loop (DecodeLaunch.widen_v_first)."""
    v = v.to(prod_ty)
    if WIDEN_V_FIRST:
        v = _swap_pairs(v, TILE_N, HEAD_DIM_P)
    return v


@triton.jit
def _attend_tile(q_dot, k, v, key_valid, dot_scale, m_i, l_i, acc, IEEE_DOT: tl.constexpr):
    """The online softmax's step over one key tile: (m_i, l_i, acc) after k [TILE_N, D] and v."""
    if IEEE_DOT:
        s = tl.dot(q_dot, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q_dot, tl.trans(k))
    s = tl.where(key_valid[None, :], s * dot_scale, float("-inf"))  # [BLOCK_M, TILE_N], log2 units
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# The lengths a step changes are not specialized on: only the constexprs pick a compiled variant
# (kernels/attention/variants.py), which start-up warms.
@triton.jit(do_not_specialize=["num_splits", "num_rows"])
def decode_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,  # this step's rows: q [T, H, D], k/v [T, Hk, D] (k not yet rotated)
    out_ptr,  # [T, H, D]
    partial_ptr,
    m_ptr,
    l_ptr,  # SPLIT only: partial acc [T, H, S, D] fp32; m, l [T, H, S] fp32
    counter_ptr,  # SPLIT only: [>= num_seqs * Hk] int32, zero between launches (the merging program resets it)
    positions_ptr,
    cos_ptr,
    sin_ptr,  # HAS_ROPE only: positions [T] int64; cos/sin [max_position, D / 2] fp32
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, Hk, D]
    slot_mapping_ptr,  # [T] int64, -1 = nothing written
    cu_seqlens_q_ptr,
    context_lens_ptr,
    block_tables_ptr,
    kv_scales_ptr,  # [k_scale, v_scale] fp32: an e4m3 cache's (load_kv_scales)
    scale_log2,  # softmax scale * log2(e)
    num_splits,  # grid dim 2
    num_kv_heads,
    num_rows,  # T
    max_blocks,  # block_tables columns
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_mt,
    stride_mh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # tile rows (>= GROUP, >= 16): one per query head of the group
    HALF: tl.constexpr,  # head_dim / 2 (the rotary's half-split)
    HEAD_DIM_P: tl.constexpr,
    TILE_N: tl.constexpr,  # keys per inner iteration
    BLOCK_SIZE: tl.constexpr,  # cache block size
    HAS_ROPE: tl.constexpr,
    SPLIT: tl.constexpr,
    MIN_TILES_PER_SPLIT: tl.constexpr,  # a working split takes at least this many tiles
    SPLIT_CHUNK: tl.constexpr,  # splits merged per step of the merge loop
    IEEE_DOT: tl.constexpr,
    F16_PRODUCTS: tl.constexpr,  # an e4m3 cache under a 16-bit q: the products in float16
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (device_info.use_pdl)
    PREFETCH_KV: tl.constexpr,  # load each K/V tile an iteration ahead (DecodeLaunch.prefetch_kv)
    WIDEN_V_FIRST: tl.constexpr,  # an e4m3 V tile widened before its layout change (_widen_v)
    EARLY_KV: tl.constexpr = False,  # PREFETCH_KV: the first K/V tile loads before the rotary
):
    """A decode step of one sequence (at most one query row) over one KV head, for one KV split: the
    rotary embedding of q and of the new key, the new key and value into the cache, and attention over
    the context, in one launch.

    The new key is not read back from the cache: the keys before it come from the cache and split 0
    adds the new one from registers, so no program waits on the write. Working splits take the
    context's key tiles round-robin (split s: tiles s, s + A, s + 2A, ... for A working splits).
    With SPLIT and more than one working split, each leaves its partial result in the workspace and
    bumps the (sequence, KV head) counter; the one that bumps it last merges every split into `out`
    and resets the counter to zero.

    A small decode step is latency-bound, so the loads are ordered to keep the chain of dependent
    memory round trips short: the sequence's row is guessed to be `seq` (true for a decode batch;
    reloaded otherwise), so its q, k, v, position and slot load together with the metadata and the
    first tile's block-table entries; each tile's K/V load goes out with the next tile's entries.
    """
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < GROUP
    head = kvh * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < head_dim
    first = dims < HALF
    partner = tl.where(first, dims + HALF, dims - HALF)
    tile_keys = tl.arange(0, TILE_N)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Round trip 1: metadata, the block-table entries of this split's first tile, and the guessed row.
    # With USE_PDL the metadata loads before the wait on the previous kernel (which computes q, k, v):
    # the step's metadata is written before its forward starts, by copies or by kernels that finished
    # before the previous one started (device_info.use_pdl).
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_end = tl.load(cu_seqlens_q_ptr + seq + 1)
    context_len = tl.load(context_lens_ptr + seq)
    cols = (split * TILE_N + tile_keys) // BLOCK_SIZE
    block = tl.load(table_row + cols, mask=cols < max_blocks, other=0).to(tl.int64)
    cache_ty = k_cache_ptr.dtype.element_ty
    k_scale, v_scale = load_kv_scales(kv_scales_ptr, cache_ty)  # set at start-up: before the wait
    if USE_PDL:  # before any return: a kernel may not finish before the one it waits on
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ptrs = (q_ptr, k_ptr, v_ptr, positions_ptr, slot_mapping_ptr)
    strides = (stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh)
    lanes = (head, row_valid, dims, dim_valid, partner)
    q, q_partner, k_new, k_partner, v_new, slot, pos = _decode_row(
        seq, num_rows, kvh, ptrs, strides, lanes, HAS_ROPE
    )
    if q_end <= q_start:  # a padded sequence: no row
        return
    if q_start != seq:  # the guess was wrong (a sequence before this one has no row): reload
        q, q_partner, k_new, k_partner, v_new, slot, pos = _decode_row(
            q_start, num_rows, kvh, ptrs, strides, lanes, HAS_ROPE
        )
    row = q_start.to(tl.int64)
    num_old = context_len - 1  # keys already in the cache; the new one sits at position num_old
    num_tiles = tl.cdiv(num_old, TILE_N)
    # The live context decides how many of the launch's splits work (each at least
    # MIN_TILES_PER_SPLIT tiles); the rest return at once, so a short context is one program.
    num_active = tl.maximum(tl.minimum(num_splits, tl.cdiv(num_tiles, MIN_TILES_PER_SPLIT)), 1)
    if split >= num_active:
        return
    if EARLY_KV:  # the first tile's K/V round trip overlaps the rotary's (cos / sin at pos)
        keys = split * TILE_N + tile_keys
        kv_mask = (keys < num_old)[:, None] & dim_valid[None, :]
        k_cur, v_cur = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block, keys, kv_mask, dims, kvh, stride_kcb, stride_kcs,
            stride_kch, stride_vcb, stride_vcs, stride_vch, BLOCK_SIZE,
        )  # fmt: skip

    dtype = q_ptr.dtype.element_ty
    if HAS_ROPE:
        # Half-split rotary, as rope_write_kv_kernel computes it: first half x1 cos - x2 sin, second
        # half x2 cos + x1 sin, in fp32 from cos/sin rounded to q's dtype, each value rounded once.
        freq = tl.where(first, dims, dims - HALF)
        sign = tl.where(first, -1.0, 1.0)
        cos = (
            tl.load(cos_ptr + pos * HALF + freq, mask=dim_valid, other=0.0).to(dtype).to(tl.float32)
        )
        sin = (
            tl.load(sin_ptr + pos * HALF + freq, mask=dim_valid, other=0.0).to(dtype).to(tl.float32)
        )
        q = q * cos[None, :] + sign[None, :] * (q_partner * sin[None, :])
        k_new = k_new * cos + sign * (k_partner * sin)
    q = q.to(dtype)
    k_new = to_cache(k_new.to(dtype), cache_ty, k_scale)
    v_new = to_cache(v_new, cache_ty, v_scale)
    # keys and values stay as the cache holds them: k_scale scales the scores, v_scale the output
    scale_log2 = scale_log2 * k_scale
    if F16_PRODUCTS:
        # e4m3 widens to float16 in one convert on sm90 (to bfloat16 it takes several). Every e4m3
        # value is exact in float16, and so is every bfloat16 q value of 2^-14 or more: q is first
        # scaled by the power of two that brings its largest value under F16_SAFE (2^0 for the q
        # of any trained model), the scores take the power back, so they are bfloat16's scores.
        # p in [0, 1] keeps 3 more bits in float16 than in bfloat16.
        prod_ty = tl.float16
        q32 = q.to(tl.float32)
        q_amax = tl.max(tl.max(tl.abs(q32), 1), 0)
        power = tl.maximum(tl.ceil(tl.log2(q_amax / F16_SAFE)), 0.0)  # a whole number
        q_dot = (q32 * tl.exp2(-power)).to(prod_ty)
        dot_scale = scale_log2 * tl.exp2(power)
    else:
        prod_ty = dtype
        q_dot = q
        dot_scale = scale_log2
    if (split == 0) & (slot >= 0):
        slot_block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        tl.store(
            k_cache_ptr + slot_block * stride_kcb + offset * stride_kcs + kvh * stride_kch + dims,
            k_new,
            mask=dim_valid,
        )
        tl.store(
            v_cache_ptr + slot_block * stride_vcb + offset * stride_vcs + kvh * stride_vch + dims,
            v_new,
            mask=dim_valid,
        )

    # Split 0 starts from the new key (score s_new, weight 1); the others start empty.
    s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale_log2  # [BLOCK_M]
    owns_new = row_valid & (split == 0)
    m_i = tl.where(owns_new, s_new, _NEG_BIG)
    l_i = tl.where(owns_new, 1.0, 0.0)
    acc = tl.where(owns_new[:, None], v_new.to(tl.float32)[None, :], 0.0)  # [BLOCK_M, HEAD_DIM_P]

    if WIDEN_V_FIRST:  # the products of column-swapped V tiles accumulate here (_widen_v)
        acc = _swap_pairs(acc, BLOCK_M, HEAD_DIM_P)
    t = split
    num_iters = tl.cdiv(num_tiles - split, num_active)
    if PREFETCH_KV:
        # Software pipelining by hand: each iteration issues the next tile's K/V loads (and the
        # block ids of the tile after it) before it computes on the tile loaded the iteration
        # before, kept as the cache holds it and widened only there: an e4m3 cache's loads pass
        # a widening on their way to tl.dot, which may keep Triton's own pipelining off them.
        if not EARLY_KV:
            keys = t * TILE_N + tile_keys
            kv_mask = (keys < num_old)[:, None] & dim_valid[None, :]
            k_cur, v_cur = _load_kv_tile(
                k_cache_ptr, v_cache_ptr, block, keys, kv_mask, dims, kvh, stride_kcb, stride_kcs,
                stride_kch, stride_vcb, stride_vcs, stride_vch, BLOCK_SIZE,
            )  # fmt: skip
        next_keys = (t + num_active) * TILE_N + tile_keys
        block = tl.load(table_row + next_keys // BLOCK_SIZE, mask=next_keys < num_old, other=0).to(
            tl.int64
        )
        for _ in range(0, num_iters):
            key_valid = t * TILE_N + tile_keys < num_old
            t += num_active
            keys = t * TILE_N + tile_keys
            kv_mask = (keys < num_old)[:, None] & dim_valid[None, :]
            k_next, v_next = _load_kv_tile(
                k_cache_ptr, v_cache_ptr, block, keys, kv_mask, dims, kvh, stride_kcb, stride_kcs,
                stride_kch, stride_vcb, stride_vcs, stride_vch, BLOCK_SIZE,
            )  # fmt: skip
            after = (t + num_active) * TILE_N + tile_keys
            block = tl.load(table_row + after // BLOCK_SIZE, mask=after < num_old, other=0).to(
                tl.int64
            )
            v_wide = _widen_v(v_cur, prod_ty, WIDEN_V_FIRST, TILE_N, HEAD_DIM_P)
            m_i, l_i, acc = _attend_tile(
                q_dot, k_cur.to(prod_ty), v_wide, key_valid, dot_scale, m_i, l_i, acc, IEEE_DOT
            )
            k_cur, v_cur = k_next, v_next
    else:
        for _ in range(0, num_iters):
            keys = t * TILE_N + tile_keys
            key_valid = keys < num_old
            kv_mask = key_valid[:, None] & dim_valid[None, :]
            k, v = _load_kv_tile(
                k_cache_ptr, v_cache_ptr, block, keys, kv_mask, dims, kvh, stride_kcb, stride_kcs,
                stride_kch, stride_vcb, stride_vcs, stride_vch, BLOCK_SIZE,
            )  # fmt: skip  # [TILE_N, HEAD_DIM_P] each
            k = k.to(prod_ty)  # widened from an e4m3 cache
            v = _widen_v(v, prod_ty, WIDEN_V_FIRST, TILE_N, HEAD_DIM_P)
            t += num_active
            next_keys = t * TILE_N + tile_keys
            block = tl.load(
                table_row + next_keys // BLOCK_SIZE, mask=next_keys < num_old, other=0
            ).to(tl.int64)
            m_i, l_i, acc = _attend_tile(q_dot, k, v, key_valid, dot_scale, m_i, l_i, acc, IEEE_DOT)

    if WIDEN_V_FIRST:
        acc = _swap_pairs(acc, BLOCK_M, HEAD_DIM_P)
    acc = acc * v_scale
    q_mask = row_valid[:, None] & dim_valid[None, :]
    finish = num_active == 1  # this program holds the whole result
    if SPLIT:
        if num_active > 1:
            p_base = partial_ptr + row * stride_pt + head * stride_ph  # [BLOCK_M]
            ml_off = row * stride_mt + head * stride_mh  # [BLOCK_M]
            tl.store(p_base[:, None] + split * stride_ps + dims[None, :], acc, mask=q_mask)
            tl.store(m_ptr + ml_off + split, m_i, mask=row_valid)
            tl.store(l_ptr + ml_off + split, l_i, mask=row_valid)
            # Every thread's stores, then one release/acquire bump (the last-block pattern).
            tl.debug_barrier()
            counter = counter_ptr + seq * num_kv_heads + kvh
            finish = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_active - 1
            if finish:
                # The last program of this (sequence, KV head) merges the others' splits into its
                # own state, SPLIT_CHUNK at a time. ".cg" loads skip L1, which may hold stale lines.
                chunk = tl.arange(0, SPLIT_CHUNK)
                for c0 in range(0, num_active, SPLIT_CHUNK):
                    idx = c0 + chunk
                    take = (
                        row_valid[:, None] & ((idx < num_active) & (idx != split))[None, :]
                    )  # [BLOCK_M, CHUNK]
                    ml_ptrs = ml_off[:, None] + idx[None, :]
                    m_s = tl.load(m_ptr + ml_ptrs, mask=take, other=_NEG_BIG, cache_modifier=".cg")
                    l_s = tl.load(l_ptr + ml_ptrs, mask=take, other=0.0, cache_modifier=".cg")
                    a_s = tl.load(
                        p_base[:, None, None]
                        + idx[None, :, None] * stride_ps
                        + dims[None, None, :],
                        mask=take[:, :, None] & dim_valid[None, None, :],
                        other=0.0,
                        cache_modifier=".cg",
                    )  # [BLOCK_M, CHUNK, HEAD_DIM_P]
                    m_new = tl.maximum(m_i, tl.max(m_s, 1))
                    alpha = tl.exp2(m_i - m_new)
                    beta = tl.exp2(m_s - m_new[:, None])  # [BLOCK_M, CHUNK]
                    l_i = l_i * alpha + tl.sum(l_s * beta, 1)
                    acc = acc * alpha[:, None] + tl.sum(a_s * beta[:, :, None], 1)
                    m_i = m_new
                tl.store(counter, 0)
    if finish:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o_ptrs = out_ptr + row * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)

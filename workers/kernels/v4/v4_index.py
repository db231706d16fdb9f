"""DeepSeek-V4's CSA indexer over each row's live entries under graph-safe metadata (FULL), read
on the device: a launch planned from shapes gives every row room for all T = max positions // rate
entries, but its work follows the row's own count, (position + 1) // rate.

- `v4_anchored_scores`: the indexer's scores of each row's visible entries, the entries' cache
  slots computed in the kernel from the row's sequence and block table (workers/layers/v4_rows.py,
  `anchor_slots`: the arithmetic is the same), so no [n, T] slot tensor is built; a tile past the
  row's count stores nothing.
- `prefix_topk`: the k highest of each row's first lens[i] scores, in score order, -1 past a
  row's finite ones, in four forms. Three are kernels whose work follows the prefix and which send
  ties to the lower entry: "merge" (one program a row) keeps a sorted set of k and merges each
  tile of its prefix that can enter it; "select" (one program a row) finds the k-th highest by a
  radix select, then sorts the k it gathers; "chunked" selects the k highest of each chunk of the
  prefix, a program a chunk, then of those candidates, a program a row. "torch" sets each row's
  tail to -inf and takes torch's top-k over all T: its cost follows T, but no [n, T] slot tensor
  is built for it, unlike the region's path without the prefix.
- `prefix_picks`: the two in turn, a CSA layer's picks (workers/layers/v4_attention.py).

Importing this module needs no GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomrt.workers.kernels.v4.v4_kernels import index_tile_scores

_NONE = tl.constexpr(-9223372036854775807)  # below every packed (score, entry) key
TOPK_FORMS = ("merge", "select", "chunked", "torch")  # prefix_topk's
# prefix_picks' form. `bench_v4_kernels.py --csa-topk 64,4096,65536,262144 --rows 1,32` on one
# H100 (3710b43), a row's top 512 of that many live entries: merge 11 / 72 / 1117 / 3829 us,
# select 16 / 43 / 614 / 2430, chunked 31 / 58 / 118 / 217, torch (over all 262144) 95 each; at
# 32 rows chunked 32 / 59 / 166 / 440 against torch's 254. Chunked follows the prefix and keeps
# the worst case near torch's
PICK_FORM = "chunked"


@triton.jit
def _anchored_scores_kernel(
    q_ptr,  # [n, H, DI]
    w_ptr,  # [n, H] float32
    rows_ptr,  # the cache's rows
    pos_ptr,  # [n] positions
    seq_ptr,  # [n] each row's sequence (its block-table row)
    table_ptr,  # [S, B] int32 block tables
    out_ptr,  # [n, T] float32: the visible entries' scores, the rest left as they were
    row_stride,
    col,
    scale,
    T,
    num_seqs,
    table_stride,
    max_blocks,
    rate,
    anchor_stride,
    block_size,
    H: tl.constexpr,
    DI: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    count = tl.minimum((tl.load(pos_ptr + i).to(tl.int64) + 1) // rate, T)
    if t0 < count:
        w = t0 + tl.arange(0, BLOCK_T)
        valid = w < count
        end = (w.to(tl.int64) + 1) * rate - 1  # the position that ends entry w's window
        group_tokens = anchor_stride * block_size
        index = tl.minimum((end // group_tokens) * anchor_stride, max_blocks - 1)
        seq = tl.minimum(tl.load(seq_ptr + i).to(tl.int64), num_seqs - 1)
        block = tl.load(table_ptr + seq * table_stride + index, mask=valid, other=0)
        slot = tl.maximum(block.to(tl.int64), 0) * block_size + (end % group_tokens) // rate
        acc = index_tile_scores(q_ptr, w_ptr, rows_ptr, slot, valid, i, row_stride, col, scale,
                                H, DI, BLOCK_T, BLOCK_D)  # fmt: skip
        tl.store(out_ptr + i * T + w, tl.where(valid, acc, float("-inf")), mask=w < T)


def v4_anchored_scores(
    iq: torch.Tensor,  # [n, H, DI]
    iw: torch.Tensor,  # [n, H]
    rows: torch.Tensor,  # the cache's rows [slots, width]
    col: int,  # the indexer entry's first column
    positions: torch.Tensor,  # [n]
    seq: torch.Tensor,  # [n]
    block_tables: torch.Tensor,  # [S, B]
    rate: int,
    anchor_stride: int,
    block_size: int,
    t: int,
) -> torch.Tensor:
    """[n, t] float32: row i's scores of its entries w < min((p_i + 1) // rate, t) (entry w's key
    in the indexer entry columns of the slot `anchor_slots` names); the rest of the row is not
    written (`prefix_topk` reads the prefix alone)."""
    n, h, di = iq.shape
    out = torch.empty(n, t, dtype=torch.float32, device=iq.device)
    if n and t:
        block_t = min(64, triton.next_power_of_2(t))
        _anchored_scores_kernel[(n, triton.cdiv(t, block_t))](
            iq.contiguous(),
            iw.float().contiguous(),
            rows,
            positions.contiguous(),
            seq.contiguous(),
            block_tables,
            out,
            rows.stride(0),
            col,
            di**-0.5,
            t,
            block_tables.shape[0],
            block_tables.stride(0),
            block_tables.shape[1],
            rate,
            anchor_stride,
            block_size,
            H=h,
            DI=di,
            BLOCK_T=block_t,
            BLOCK_D=triton.next_power_of_2(di),
        )
    return out


@triton.jit
def _prefix_topk_kernel(scores_ptr, lens_ptr, out_ptr, t, stride_s, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    n = tl.minimum(tl.load(lens_ptr + row).to(tl.int32), t)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], _NONE, tl.int64)
    floor = tl.min(best, 0)  # the BLOCK-th best so far: a tile below it cannot enter
    for start in range(0, n, BLOCK):
        idx = start + offs
        ok = idx < n
        x = tl.load(scores_ptr + row * stride_s + idx, mask=ok, other=float("-inf"))
        bits = x.to(tl.int32, bitcast=True)
        order = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # the floats' order as signed ints
        key = (order.to(tl.int64) << 32) | (0xFFFFFFFF - idx.to(tl.int64))
        key = tl.where(ok & (x > float("-inf")), key, _NONE)
        if tl.max(key, 0) > floor:
            merged = tl.sort(tl.reshape(tl.join(best, key), [2 * BLOCK]), descending=True)
            best, _ = tl.split(tl.permute(tl.reshape(merged, [2, BLOCK]), [1, 0]))
            floor = tl.min(best, 0)
    picked = tl.where(best == _NONE, -1, 0xFFFFFFFF - (best & 0xFFFFFFFF))
    tl.store(out_ptr + row * stride_o + offs, picked)


@triton.jit
def _orders(src_ptr, idx, n, base, KEYS: tl.constexpr):
    """Elements idx of the n at src_ptr as (present, the score's order as a signed int, entry):
    float scores of entries base + idx, or (KEYS) packed keys, _NONE for none."""
    # One return after a constexpr if/else: the compiler then builds the taken branch alone (code
    # after an early return inside the if is still compiled, and a key is no float to bitcast).
    if KEYS:
        key = tl.load(src_ptr + idx, mask=idx < n, other=_NONE)
        present = key != _NONE
        order = (key >> 32).to(tl.int32)
        entry = 0xFFFFFFFF - (key & 0xFFFFFFFF)
    else:
        x = tl.load(src_ptr + idx, mask=idx < n, other=float("-inf"))
        bits = x.to(tl.int32, bitcast=True)
        present = x > float("-inf")
        order = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        entry = base + idx.to(tl.int64)
    return present, order, entry


@triton.jit
def _radix_select(
    src_ptr, n, k, out_ptr, base, BLOCK: tl.constexpr, TILE: tl.constexpr, KEYS: tl.constexpr
):
    """The k highest of the n scores at src_ptr (entries base..; or KEYS: of the n packed keys
    there), as packed (score, entry) keys written unordered (in the order read) to
    out_ptr[0:BLOCK], the rest _NONE. A radix select: four passes, each a histogram of one byte of
    the score orders that match the bytes chosen so far, find the k-th highest; a fifth gathers
    those above it and its first ties (the lowest entries, where entries come in order)."""
    offs = tl.arange(0, TILE)
    bins = tl.arange(0, 512)
    total = tl.zeros([], tl.int32)
    for start in range(0, n, TILE):  # the finite scores, which are all a row can pick
        ok, _, _ = _orders(src_ptr, start + offs, n, base, KEYS)
        total += tl.sum(ok.to(tl.int32), 0)
    need = tl.minimum(total, k)  # the rank of the key sought, from the top
    want = tl.zeros([], tl.int64)  # its bytes found so far
    high = tl.zeros([], tl.int64)  # and the bits they occupy
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([512], tl.int32)
        for start in range(0, n, TILE):
            ok, order, _ = _orders(src_ptr, start + offs, n, base, KEYS)
            u = order.to(tl.int64) + 2147483648  # the order, >= 0
            match = ok & ((u & high) == want)
            hist += tl.histogram(tl.where(match, ((u >> shift) & 255).to(tl.int32), 256), 512)
        hist = tl.where(bins < 256, hist, 0)
        above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # keys in higher bins than each
        hit = (above < need) & (above + hist >= need)  # the bin of the need-th highest
        digit = tl.max(tl.where(hit, bins, -1), 0)
        need -= tl.sum(tl.where(bins == digit, above, 0), 0)
        want = want | (tl.maximum(digit, 0).to(tl.int64) << shift)
        high = high | (255 << shift)
    # `want` is the need-th highest key (total 0: none is taken); take the keys above it and its
    # first `need` ties
    slot = tl.arange(0, BLOCK)
    tl.store(out_ptr + slot, tl.full([BLOCK], _NONE, tl.int64))
    tl.debug_barrier()
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for start in range(0, n, TILE):
        ok, order, entry = _orders(src_ptr, start + offs, n, base, KEYS)
        u = order.to(tl.int64) + 2147483648
        live = ok & (total > 0)
        tie = live & (u == want)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), 0) - 1
        take = (live & (u > want)) | (tie & (tie_rank < need))
        at = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        key = (order.to(tl.int64) << 32) | (0xFFFFFFFF - entry)
        tl.store(out_ptr + at, key, mask=take != 0)
        taken += tl.sum(take.to(tl.int32), 0)
        ties += tl.sum(tie.to(tl.int32), 0)
    tl.debug_barrier()


@triton.jit
def _prefix_select_kernel(
    scores_ptr, lens_ptr, out_ptr, t, k, stride_s, stride_o, BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):  # fmt: skip
    """`_radix_select` over the row's prefix, then one sort of the keys it gathered."""
    row = tl.program_id(0)
    n = tl.minimum(tl.load(lens_ptr + row).to(tl.int32), t)
    _radix_select(
        scores_ptr + row * stride_s, n, k, out_ptr + row * stride_o, 0, BLOCK, TILE, False
    )
    _sort_and_name(out_ptr + row * stride_o, BLOCK)


@triton.jit
def _sort_and_name(out_ptr, BLOCK: tl.constexpr):
    """The BLOCK packed keys at out_ptr in descending order, replaced by their entries (-1:
    none)."""
    slot = tl.arange(0, BLOCK)
    best = tl.sort(tl.load(out_ptr + slot), descending=True)
    picked = tl.where(best == _NONE, -1, 0xFFFFFFFF - (best & 0xFFFFFFFF))
    tl.debug_barrier()
    tl.store(out_ptr + slot, picked)


@triton.jit
def _chunk_select_kernel(
    scores_ptr, lens_ptr, cand_ptr, t, k, stride_s, chunks, CHUNK: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """The k highest of chunk c of the row's prefix, unordered, into its candidates (a chunk past
    the prefix writes nothing: the merge reads the prefix's chunks alone)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    n = tl.minimum(tl.load(lens_ptr + row).to(tl.int32), t)
    start = c * CHUNK
    if start < n:
        cand = cand_ptr + (row.to(tl.int64) * chunks + c) * BLOCK
        _radix_select(scores_ptr + row * stride_s + start, tl.minimum(n - start, CHUNK), k, cand,
                      start, BLOCK, TILE, False)  # fmt: skip


@triton.jit
def _merge_select_kernel(
    cand_ptr, lens_ptr, out_ptr, t, k, stride_o, chunks, CHUNK: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """The k highest of the row's chunks' candidates, in order, as entries."""
    row = tl.program_id(0)
    n = tl.minimum(tl.load(lens_ptr + row).to(tl.int32), t)
    used = (n + CHUNK - 1) // CHUNK * BLOCK
    cand = cand_ptr + row.to(tl.int64) * chunks * BLOCK
    _radix_select(cand, used, k, out_ptr + row * stride_o, 0, BLOCK, TILE, True)
    _sort_and_name(out_ptr + row * stride_o, BLOCK)


def prefix_topk(
    scores: torch.Tensor, lens: torch.Tensor, k: int, form: str = "merge", chunk: int = 8192
) -> torch.Tensor:
    """[n, k] int64: the entries of the k highest of each row's first `lens[i]` scores (`scores`
    [n, T]; lens past T read T), in score order, -1 past a row's finite ones. The kernels' forms
    send ties to the lower entry and work as far as the lengths, read on the device, not T.
    `form`: "merge" keeps a sorted set of k and merges each tile that can enter it (a sort of 2k a
    tile: cheap for short prefixes); "select" finds the k-th highest key by a radix select (five
    passes over the prefix, one sort); "chunked" selects the k highest of each `chunk` entries of
    the prefix, a program each (a chunk past the prefix returns at once), then of their
    candidates (two launches: a long prefix is read by as many programs as it has chunks);
    "torch" is torch's top-k over the rows with their tails at -inf (a pass over all T, then
    torch's; ties as torch breaks them)."""
    if form not in TOPK_FORMS:
        raise ValueError(f"prefix_topk: form {form!r} is not one of {TOPK_FORMS}")
    n, t = scores.shape
    block = triton.next_power_of_2(max(16, k))
    out = torch.empty(n, block, dtype=torch.int64, device=scores.device)
    if n and form == "merge":
        _prefix_topk_kernel[(n,)](
            scores, lens, out, t, scores.stride(0), out.stride(0), BLOCK=block,
            num_warps=4 if block <= 512 else 8,
        )  # fmt: skip
    elif n and form == "select":
        _prefix_select_kernel[(n,)](
            scores, lens, out, t, k, scores.stride(0), out.stride(0), BLOCK=block, TILE=1024,
            num_warps=4 if block <= 512 else 8,
        )  # fmt: skip
    elif n and form == "torch":
        width = min(k, t)
        if width:
            tail = torch.arange(t, device=scores.device) >= lens.long().unsqueeze(1)
            top = scores.masked_fill(tail, float("-inf")).topk(width, dim=-1)
            out[:, :width] = torch.where(top.values > float("-inf"), top.indices, -1)
        out[:, width:] = -1
    elif n:  # "chunked"
        chunks = triton.cdiv(t, chunk)
        cand = torch.empty(n, chunks, block, dtype=torch.int64, device=scores.device)
        meta = dict(CHUNK=chunk, BLOCK=block, TILE=1024, num_warps=4 if block <= 512 else 8)
        _chunk_select_kernel[(n, chunks)](
            scores, lens, cand, t, k, scores.stride(0), chunks, **meta
        )
        _merge_select_kernel[(n,)](cand, lens, out, t, k, out.stride(0), chunks, **meta)
    return out[:, :k]


def prefix_picks(
    iq: torch.Tensor,  # [n, H, DI]
    iw: torch.Tensor,  # [n, H]
    rows: torch.Tensor,  # the cache's rows [slots, width]
    col: int,  # the indexer entry's first column
    positions: torch.Tensor,  # [n]
    seq: torch.Tensor,  # [n]
    block_tables: torch.Tensor,  # [S, B]
    rate: int,
    anchor_stride: int,
    block_size: int,
    t: int,
    k: int,
) -> torch.Tensor:
    """[n, k] the entries (w, -1: none) of each row's k highest indexer scores among its
    min((p + 1) // rate, t) visible ones, counted on the device: `v4_anchored_scores`, then
    `prefix_topk`."""
    scores = v4_anchored_scores(
        iq, iw, rows, col, positions, seq, block_tables, rate, anchor_stride, block_size, t
    )
    return prefix_topk(scores, (positions.long() + 1) // rate, k, PICK_FORM)

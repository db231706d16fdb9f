# The head of a request graph: one launch that unpacks the step staged in PackedStep's device buffer
# (workers/runner/step_buffers.py holds the layout) into the static buffers the recording reads, and under
# async scheduling gathers each row's token from the staged ids or the previous step's sample.
# It replaces a device copy per buffer plus a gather kernel (~1 us of GPU time each).
# Importing this module needs no GPU.

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unpack_step_kernel(
    packed64_ptr,
    packed32_ptr,  # the staged step as int64 and as int32 words (one buffer)
    ids_ptr,
    positions_ptr,
    slot_mapping_ptr,  # int64 [rows]: input_ids and the row metadata
    cu_seqlens_q_ptr,
    context_lens_ptr,  # int32 [seqs + 1], [seqs]
    block_tables_ptr,  # int32 [seqs, stride_bt]: only each row's first `width` entries are written
    prev_tokens_ptr,  # ASYNC only: int64, the previous step's sampled tokens
    rows,
    seqs,
    stride_bt,
    ids_at,
    src_at,
    positions_at,
    slots_at,  # int64-word offsets of the row fields
    width_at,
    cu_at,
    context_at,
    table_at,  # int32-word offsets; table_at starts [seqs, width]
    prev_token_base,  # ASYNC: token_src values >= this name prev_tokens[src - base]
    ASYNC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program p < seqs copies block-table row p (its live `width` entries, read from the staged
    header, so the launch depends only on the bucket); program `seqs` copies the row fields,
    cu_seqlens_q and context_lens. With ASYNC a row's input id is staged id `src` (its own row, or
    0 for padding) when src < prev_token_base, else the previous step's sample src - base."""
    p = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if p < seqs:
        width = tl.load(packed32_ptr + width_at)
        src_row = packed32_ptr + table_at + p.to(tl.int64) * width
        dst_row = block_tables_ptr + p.to(tl.int64) * stride_bt
        for c0 in range(0, width, BLOCK):
            cols = c0 + offs
            m = cols < width
            tl.store(dst_row + cols, tl.load(src_row + cols, mask=m), mask=m)
    else:
        for r0 in range(0, rows, BLOCK):
            r = r0 + offs
            m = r < rows
            tl.store(positions_ptr + r, tl.load(packed64_ptr + positions_at + r, mask=m), mask=m)
            tl.store(slot_mapping_ptr + r, tl.load(packed64_ptr + slots_at + r, mask=m), mask=m)
            if ASYNC:
                src = tl.load(packed64_ptr + src_at + r, mask=m, other=0)
                staged = src < prev_token_base
                own = tl.load(packed64_ptr + ids_at + src, mask=m & staged, other=0)
                prev = tl.load(
                    prev_tokens_ptr + (src - prev_token_base),
                    mask=m & (src >= prev_token_base),
                    other=0,
                )
                ids = tl.where(staged, own, prev)
            else:
                ids = tl.load(packed64_ptr + ids_at + r, mask=m)
            tl.store(ids_ptr + r, ids, mask=m)
        for s0 in range(0, seqs + 1, BLOCK):
            s = s0 + offs
            tl.store(
                cu_seqlens_q_ptr + s,
                tl.load(packed32_ptr + cu_at + s, mask=s <= seqs),
                mask=s <= seqs,
            )
            tl.store(
                context_lens_ptr + s,
                tl.load(packed32_ptr + context_at + s, mask=s < seqs),
                mask=s < seqs,
            )

# Greedy sampling's argmax over the vocabulary.
# torch's argmax runs a generic reduction that is slow for a few rows of a large vocabulary, on the
# GPU's critical path of every greedy decode step (benchmarks/bench_argmax.py, docs/perf.md). Here a
# program streams its part of a row
# once, keeping a running maximum per lane, and reduces across lanes at the end. A few rows of a large
# vocabulary would leave most SMs idle with one program per row, so each row is split over several
# programs (`plan_splits`): each writes its part's (maximum, first index) to a per-device workspace
# and bumps the row's counter; the program that bumps it last merges the parts, writes the answer
# and resets the counter (the last-block pattern of kernels/attention_kernels.py's split merge).
# The split is faster than one program per row at every decode shape measured. The launch depends
# only on (rows, vocab): safe inside a CUDA graph.
# Importing this module needs no GPU.

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from atomrt.workers.kernels.device_info import H200_NUM_SMS, device_scratch, sm_count
from atomrt.workers.kernels.launch import launch

BLOCK = 2048  # elements per loop step (8 per thread at 8 warps)
MIN_SPLIT_STEPS = 2  # a split streams at least this many loop steps of its row
SPLIT_ROWS = 4096  # rows a split launch may have: the per-device counters
SPLIT_PARTS = 1 << 16  # (row, split) parts a split launch may have: the per-device workspace


@triton.jit
def argmax_rows_kernel(
    logits_ptr,
    out_ptr,
    part_max_ptr,
    part_idx_ptr,
    counter_ptr,
    vocab,
    stride_row,
    chunk,
    BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """out[row] = the first index of the row's maximum (torch.argmax's tie rule). Program (row, split)
    streams elements [split * chunk, (split + 1) * chunk) of the row. Each lane keeps its own maximum
    and the first index it was seen at (strictly greater replaces, so the earlier index stays on
    ties); the part's answer is the smallest index among the lanes holding its maximum, and the row's
    the smallest index among the parts holding the largest maximum. A part of only -inf answers its
    first index, so a row of -inf answers 0. NaN is never greater than anything here, so a NaN is
    skipped (torch.argmax would return it)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    base = logits_ptr + row * stride_row
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = lo + lanes  # a lane that never sees more than -inf answers its first index
    for start in tl.range(lo, hi, BLOCK, num_stages=3):
        idx = start + lanes
        x = tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
        better = x > best
        best = tl.where(better, x, best)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(best, axis=0)
    top_idx = tl.min(tl.where(best == top, best_idx, vocab), axis=0)
    if SPLITS == 1:
        tl.store(out_ptr + row, top_idx.to(tl.int64))
    else:
        part = row * SPLITS + split
        tl.store(part_max_ptr + part, top)
        tl.store(part_idx_ptr + part, top_idx)
        tl.debug_barrier()  # every thread's stores, then one release/acquire bump
        if tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            parts = row * SPLITS + tl.arange(0, SPLITS)
            m = tl.load(
                part_max_ptr + parts, cache_modifier=".cg"
            )  # ".cg": not L1, which may be stale
            i = tl.load(part_idx_ptr + parts, cache_modifier=".cg")
            row_top = tl.max(m, axis=0)
            tl.store(out_ptr + row, tl.min(tl.where(m == row_top, i, vocab), axis=0).to(tl.int64))
            tl.store(counter_ptr + row, 0)


@functools.lru_cache(maxsize=1024)
def plan_splits(rows: int, vocab: int, num_sms: int = H200_NUM_SMS) -> int:
    """Programs per row (a power of two): about two per SM in all, each streaming at least
    MIN_SPLIT_STEPS loop steps; 1 when the rows alone fill the GPU or exceed the workspace."""
    if rows == 0 or rows > SPLIT_ROWS:
        return 1
    want = min(-(-2 * num_sms // rows), max(1, vocab // (BLOCK * MIN_SPLIT_STEPS)))
    splits = 1
    while splits * 2 <= want and rows * splits * 2 <= SPLIT_PARTS:
        splits *= 2
    return splits


def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device's (part maxima fp32, part indices int32, row counters int32, zeroed), allocated on
    first use, outside any CUDA-graph capture. One device's split launches must not overlap in time
    (one stream): they share it."""
    return device_scratch(
        "argmax_rows: the split workspace",
        device,
        lambda d: (
            torch.empty(SPLIT_PARTS, dtype=torch.float32, device=d),
            torch.empty(SPLIT_PARTS, dtype=torch.int32, device=d),
            torch.zeros(SPLIT_ROWS, dtype=torch.int32, device=d),
        ),
        hint="call argmax_rows once before capturing",
    )


def argmax_rows(logits: torch.Tensor, num_splits: Optional[int] = None) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for CUDA logits [rows, vocab] (bf16, fp16 or fp32, unit stride
    along the vocabulary), as int64 [rows]. `num_splits` (a power of two) overrides `plan_splits`."""
    if logits.dim() != 2 or logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"argmax_rows: want [rows, vocab] bf16/fp16/fp32 logits, got {tuple(logits.shape)} {logits.dtype}"
        )
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("argmax_rows: an empty vocabulary has no argmax")
    if vocab >= 2**31:
        raise ValueError(f"argmax_rows: vocab {vocab} does not fit int32 indices")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        if num_splits is None:
            splits = plan_splits(rows, vocab, sm_count(logits.device))
        else:  # a caller's count; plan_splits' always fits
            splits = num_splits
            fits = splits == 1 or (rows <= SPLIT_ROWS and rows * splits <= SPLIT_PARTS)
            if splits < 1 or splits & (splits - 1) or not fits:
                raise ValueError(
                    f"argmax_rows: {splits} splits of {rows} rows: want a power of two within the "
                    f"workspace ({SPLIT_ROWS} rows, {SPLIT_PARTS} parts)"
                )
        part_max, part_idx, counters = _workspace(logits.device)
        chunk = -(-vocab // (splits * BLOCK)) * BLOCK  # whole loop steps per split
        launch(
            argmax_rows_kernel,
            (rows, splits),
            logits,
            out,
            part_max,
            part_idx,
            counters,
            vocab,
            logits.stride(0),
            chunk,
            BLOCK=BLOCK,
            SPLITS=splits,
            num_warps=8,
        )
    return out

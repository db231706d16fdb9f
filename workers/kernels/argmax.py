# Greedy sampling's argmax over the vocabulary: one program per row.
# torch's argmax runs a generic reduction that, for a few rows of a large vocabulary, takes 11.6 us
# at [1, 49152] and 27.1 us at [32, 128256] on an H200 (tests/gpu/bench_argmax.py; this kernel: 5.3
# and 12.0); a small model's decode step is ~600 us, all on the GPU's critical path. Here each
# program streams its row once, keeping a running maximum per lane, and reduces across lanes at the end.
# Importing this module needs no GPU.

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # elements per loop step (8 per thread at 8 warps)


@triton.jit
def argmax_rows_kernel(logits_ptr, out_ptr, vocab, stride_row, BLOCK: tl.constexpr):
    """out[row] = the first index of the row's maximum (torch.argmax's tie rule). Each lane keeps its
    own maximum and the first index it was seen at (strictly greater replaces, so the earlier index
    stays on ties); the row's answer is the smallest index among the lanes holding the maximum.
    NaN is never greater than anything here, so a NaN is skipped (torch.argmax would return it)."""
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    base = logits_ptr + row * stride_row
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = lanes  # a lane that never sees more than -inf answers its first index
    for start in tl.range(0, vocab, BLOCK, num_stages=3):
        idx = start + lanes
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        better = x > best
        best = tl.where(better, x, best)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_idx, vocab), axis=0).to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for CUDA logits [rows, vocab] (bf16, fp16 or fp32, unit stride
    along the vocabulary), as int64 [rows]."""
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
        argmax_rows_kernel[(rows,)](logits, out, vocab, logits.stride(0), BLOCK=BLOCK, num_warps=8)
    return out

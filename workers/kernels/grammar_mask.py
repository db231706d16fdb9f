# Structured outputs' grammar masks on the device: each constrained logits row keeps only the tokens
# its packed mask allows. The torch arithmetic (logit_additions.apply_bits) unpacks every bit to an
# int32 and copies the rows out and back, several passes over [rows, vocab]; here one program writes
# -inf over one block of one row where the mask's bit is clear, reading the row's mask words only.
# Sampling runs outside the recorded graphs; importing this module needs no GPU.

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomrt.workers.kernels.launch import launch

BLOCK = 2048  # tokens a program covers (64 mask words)


@triton.jit
def grammar_mask_kernel(
    logits_ptr,
    rows_ptr,
    mask_ptr,
    vocab,
    width,
    stride_row,
    words,
    BLOCK: tl.constexpr,
):
    """logits[rows[i], t] = -inf for each token t < vocab whose bit (t % 32 of word t // 32 of mask
    row i) is clear, or which lies past the mask's `width` tokens. Program (i, block) covers tokens
    [block * BLOCK, (block + 1) * BLOCK) of row i; allowed tokens are not touched."""
    i = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i).to(tl.int64)
    word = tl.load(mask_ptr + i.to(tl.int64) * words + idx // 32, mask=idx < width, other=0)
    keep = ((word >> (idx % 32)) & 1) != 0
    neg = tl.full([BLOCK], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_row + idx, neg, mask=(idx < vocab) & ~keep)


def apply_grammar_mask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on logits [n, vocab] (unit stride along the vocabulary): rows `rows` (int64 [m])
    keep only the tokens their packed mask allows (bitmask int32 [m, words]); tokens past the
    mask's words are masked."""
    m, words = bitmask.shape
    vocab = logits.shape[1]
    if logits.stride(1) != 1:
        raise ValueError("apply_grammar_mask: want logits of unit stride along the vocabulary")
    if rows.shape[0] != m:
        raise ValueError(f"apply_grammar_mask: {rows.shape[0]} rows, {m} mask rows")
    if not m or not vocab:
        return
    bitmask = bitmask.contiguous()
    width = min(vocab, words * 32)
    grid = (m, triton.cdiv(vocab, BLOCK))
    launch(
        grammar_mask_kernel,
        grid,
        logits,
        rows,
        bitmask,
        vocab,
        width,
        logits.stride(0),
        words,
        BLOCK=BLOCK,
    )

"""The device grammar-mask kernel (workers/kernels/grammar_mask.py), on CUDA when present, else
through Triton's interpreter, against a float64 reference that reads each token's bit from the
packed mask one at a time; and logit_additions.apply_grammar_bitmask's option to use it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_device import DEVICE

from atomrt.workers.kernels.grammar_mask import BLOCK, apply_grammar_mask
from atomrt.workers.runner import logit_additions


def _reference(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    out = logits.to(torch.float64).cpu().clone()
    words = bitmask.shape[1]
    for i, row in enumerate(rows):
        for t in range(out.shape[1]):
            w = t // 32
            if w >= words or not (int(bitmask[i, w]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


def _case(n: int, vocab: int, words: int, rows: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen)
    bits = torch.randint(0, 2**32, (len(rows), words), generator=gen, dtype=torch.int64)
    bitmask = bits.to(torch.int32).numpy()  # every bit pattern, the sign bit included
    bitmask[0, : words // 2] = -1  # whole words allowed
    if len(rows) > 1:
        bitmask[1, :] = 0  # a row that allows nothing
    return logits, bitmask


@pytest.mark.parametrize(
    "n,vocab,words,rows",
    [
        (3, 100, 4, [2, 0]),  # vocab not a multiple of 32: the last word is partial
        (5, BLOCK + 77, (BLOCK + 77 + 31) // 32, [4, 1, 3]),  # two blocks
        (4, 300, 8, [1, 2]),  # the mask covers fewer tokens than the logits: the rest masked
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_bitwise_reference(n, vocab, words, rows, dtype) -> None:
    logits, bitmask = _case(n, vocab, words, rows, seed=n + vocab)
    want = _reference(logits.to(dtype), rows, bitmask)
    got = logits.to(dtype).to(DEVICE)
    apply_grammar_mask(got, torch.tensor(rows, device=DEVICE), torch.from_numpy(bitmask).to(DEVICE))
    assert torch.equal(got.to(torch.float64).cpu(), want)


def test_the_option_routes_device_logits_through_the_kernel(monkeypatch) -> None:
    """GRAMMAR_MASK_KERNEL: logits off the CPU path (here a view of part of each row, which takes
    the torch arithmetic otherwise, as CUDA logits do) are masked by the kernel, with xgrammar's
    result."""
    logits, bitmask = _case(6, 500, 16, [5, 0, 2], seed=1)
    rows = torch.tensor([5, 0, 2])
    want = logit_additions.apply_grammar_bitmask(logits.clone(), rows, torch.from_numpy(bitmask))
    mask = torch.from_numpy(bitmask).to(DEVICE)  # the worker's tensors are the logits' device's
    calls = []
    kernel = logit_additions.apply_grammar_mask

    def noted(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(logit_additions, "apply_grammar_mask", noted)
    monkeypatch.setattr(logit_additions, "GRAMMAR_MASK_KERNEL", True)
    wide = torch.zeros(6, 1000, device=DEVICE)
    wide[:, :500] = logits  # the first half of each row: not contiguous
    got = logit_additions.apply_grammar_bitmask(wide[:, :500], rows.to(DEVICE), mask)
    assert calls and torch.equal(got.cpu(), want)


def test_the_option_leaves_cpu_logits_to_torch_without_the_interpreter(monkeypatch) -> None:
    """CPU logits the xgrammar path does not take (not contiguous) go through the torch arithmetic
    when Triton could not run on them (no interpreter): the option never hands a kernel a CPU
    tensor outside the interpreter."""
    logits, bitmask = _case(6, 500, 16, [5, 0, 2], seed=2)
    rows, mask = torch.tensor([5, 0, 2]), torch.from_numpy(bitmask)
    want = logit_additions.apply_grammar_bitmask(logits.clone(), rows, mask)
    monkeypatch.setattr(logit_additions, "GRAMMAR_MASK_KERNEL", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(logit_additions, "apply_grammar_mask", None)  # a call would raise
    wide = torch.zeros(6, 1000)
    wide[:, :500] = logits
    got = logit_additions.apply_grammar_bitmask(wide[:, :500], rows, mask)
    assert torch.equal(got, want)

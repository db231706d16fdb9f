"""The greedy argmax kernel (workers/kernels/argmax.py) through Triton's interpreter: torch.argmax's
answer, ties to the first index, for vocabularies shorter than, equal to and longer than a loop step."""

from __future__ import annotations

import pytest
import torch

from atomrt.workers.kernels.argmax import BLOCK, argmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, BLOCK), (2, 3 * BLOCK + 5), (4, 5000)])
def test_matches_torch_argmax(rows: int, vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_ties_take_the_first_index() -> None:
    """Equal maxima in one lane, in different lanes and in different loop steps: the first wins, as
    torch's; a row of -inf answers 0."""
    vocab = 2 * BLOCK + 10
    logits = torch.zeros(4, vocab)
    logits[0, [5, 9, BLOCK + 5]] = 3.0  # lanes 5 and 9, and lane 5 again one step later
    logits[1, [BLOCK + 1, 2 * BLOCK + 3]] = 2.0  # the same maximum in two steps
    logits[2, [vocab - 1, BLOCK - 1]] = 1.0
    logits[3] = float("-inf")
    got = argmax_rows(logits)
    assert got.tolist() == [5, BLOCK + 1, BLOCK - 1, 0]
    assert torch.equal(got, logits.argmax(dim=-1))


def test_strided_rows_and_bad_arguments() -> None:
    base = torch.randn(3, 300)
    assert torch.equal(argmax_rows(base[:, 50:250]), base[:, 50:250].argmax(dim=-1))
    assert argmax_rows(base[:0]).shape == (0,)
    with pytest.raises(ValueError, match="want \\[rows, vocab\\]"):
        argmax_rows(torch.zeros(5))
    with pytest.raises(ValueError, match="empty vocabulary"):
        argmax_rows(torch.zeros(2, 0))

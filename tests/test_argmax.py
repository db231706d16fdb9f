"""The greedy argmax kernel (workers/kernels/argmax.py), on CUDA when present, else through Triton's
interpreter: torch.argmax's
answer, ties to the first index, for vocabularies shorter than, equal to and longer than a loop step."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE

from atomrt.workers.kernels.argmax import BLOCK, argmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, BLOCK), (2, 3 * BLOCK + 5), (4, 5000)])
def test_matches_torch_argmax(rows: int, vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(DEVICE, dtype)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_ties_take_the_first_index() -> None:
    """Equal maxima in one lane, in different lanes and in different loop steps: the first wins, as
    torch's; a row of -inf answers 0."""
    vocab = 2 * BLOCK + 10
    logits = torch.zeros(4, vocab, device=DEVICE)
    logits[0, [5, 9, BLOCK + 5]] = 3.0  # lanes 5 and 9, and lane 5 again one step later
    logits[1, [BLOCK + 1, 2 * BLOCK + 3]] = 2.0  # the same maximum in two steps
    logits[2, [vocab - 1, BLOCK - 1]] = 1.0
    logits[3] = float("-inf")
    got = argmax_rows(logits)
    assert got.tolist() == [5, BLOCK + 1, BLOCK - 1, 0]
    assert torch.equal(got, logits.argmax(dim=-1))


def test_strided_rows_and_bad_arguments() -> None:
    base = torch.randn(3, 300, device=DEVICE)
    assert torch.equal(argmax_rows(base[:, 50:250]), base[:, 50:250].argmax(dim=-1))
    assert argmax_rows(base[:0]).shape == (0,)
    with pytest.raises(ValueError, match="want \\[rows, vocab\\]"):
        argmax_rows(torch.zeros(5, device=DEVICE))
    with pytest.raises(ValueError, match="empty vocabulary"):
        argmax_rows(torch.zeros(2, 0, device=DEVICE))


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("rows,vocab", [(1, 3 * BLOCK + 5), (3, 4 * BLOCK), (2, 5000), (1, 700)])
def test_split_rows_match_torch_argmax(rows: int, vocab: int, splits: int) -> None:
    """A row split over several programs (some of them past the vocabulary's end) gives torch's
    answer, and the last program of each row leaves its counter at zero for the next launch."""
    from atomrt.workers.kernels.argmax import _workspace

    gen = torch.Generator().manual_seed(rows * vocab + splits)
    logits = torch.randn(rows, vocab, generator=gen).to(DEVICE)
    assert torch.equal(argmax_rows(logits, num_splits=splits), logits.argmax(dim=-1))
    assert torch.count_nonzero(_workspace(logits.device)[2]) == 0, "row counters not reset"


def test_split_ties_take_the_first_index() -> None:
    """Equal maxima in different splits, in one split's two lanes, and rows of -inf: the first index."""
    vocab, splits = 4 * BLOCK, 4  # one loop step per split
    logits = torch.zeros(4, vocab, device=DEVICE)
    logits[0, [3 * BLOCK + 1, BLOCK + 7, 2 * BLOCK]] = 5.0  # splits 3, 1, 2: split 1's wins
    logits[1, [2 * BLOCK + 9, 2 * BLOCK + 4]] = 1.0  # two lanes of split 2
    logits[2] = float("-inf")
    logits[3, :] = float("-inf")
    logits[3, vocab - 1] = -1e30  # the only finite value, in the last split
    got = argmax_rows(logits, num_splits=splits)
    assert got.tolist() == [BLOCK + 7, 2 * BLOCK + 4, 0, vocab - 1]
    assert torch.equal(got, logits.argmax(dim=-1))


def test_plan_splits() -> None:
    from atomrt.workers.kernels.argmax import SPLIT_ROWS, plan_splits

    assert plan_splits(1, 49152) == 8  # 49152 / (2 loop steps of 2048) = 12 -> 8
    assert plan_splits(1, 128256) == 16  # 31 -> 16
    assert plan_splits(32, 128256) == 8  # 2 * 132 / 32 -> 8.25 -> 8
    assert plan_splits(128, 128256) == 2
    assert plan_splits(512, 128256) == 1  # the rows fill the GPU
    assert plan_splits(4, 3000) == 1  # too short to split
    assert plan_splits(SPLIT_ROWS + 1, 128256) == 1
    for rows, vocab in ((1, 49152), (7, 151936), (64, 32000)):
        s = plan_splits(rows, vocab)
        assert s & (s - 1) == 0 and rows * s <= 2 * 132 + rows


def test_bad_split_counts() -> None:
    with pytest.raises(ValueError, match="power of two"):
        argmax_rows(torch.zeros(2, 100, device=DEVICE), num_splits=3)
    with pytest.raises(ValueError, match="power of two"):
        argmax_rows(torch.zeros(2, 100, device=DEVICE), num_splits=0)

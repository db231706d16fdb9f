"""bench_v4_kernels.py --csa-topk's candidates for a long row's top-k (a graph-safe step gives every
row all T entries, a -inf tail past its context):
- `chunked_topk`, the top k of each chunk, then of those: torch's top-k values over the whole
  row (and indices that name them), whatever the chunk against k and the row's length;
- `prefix_topk`, a kernel (here through Triton's interpreter) that reads each row's length on
  the device and ranks only that prefix: the entries torch's top-k picks over the row with its
  tail at -inf, in score order, ties to the lower entry, -1 past a row's finite scores."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from kernel_device import DEVICE

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_v4_kernels", BENCH / "bench_v4_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_v4_kernels"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("k, chunk", [(16, 64), (64, 64), (64, 48), (16, 4096)])
def test_chunked_topk_gives_torch_topk_values(k: int, chunk: int) -> None:
    chunked_topk = _bench().chunked_topk
    gen = torch.Generator().manual_seed(k * chunk)
    scores = torch.randn(4, 1000, generator=gen)
    for row, live in enumerate((1000, 300, 10, 0)):  # the visible entries, then -inf
        scores[row, live:] = float("-inf")
    values, indices = chunked_topk(scores, k, chunk)
    torch.testing.assert_close(values, scores.topk(k, dim=-1).values, rtol=0, atol=0)
    torch.testing.assert_close(scores.gather(1, indices), values, rtol=0, atol=0)
    finite = values[1] > float("-inf")
    assert len(set(indices[1][finite].tolist())) == int(finite.sum()), "an entry picked twice"


@pytest.mark.parametrize("k", [16, 40])
def test_prefix_topk_picks_torch_topk_entries_of_the_prefix(k: int) -> None:
    prefix_topk = _bench().prefix_topk
    gen = torch.Generator().manual_seed(k)
    scores = torch.randn(6, 700, generator=gen)
    scores[4, 20:30] = float("-inf")  # masked entries inside a prefix count as none
    lens = torch.tensor([700, 300, 5, 0, 650, 900], dtype=torch.int32)  # 900: past T
    got = prefix_topk(scores.to(DEVICE), lens.to(DEVICE), k).cpu()
    masked = scores.clone()
    for row, n in enumerate(lens.tolist()):
        masked[row, n:] = float("-inf")
    top = masked.topk(k, dim=-1)
    want = torch.where(top.values > float("-inf"), top.indices, -1)
    assert got.shape == (6, k) and torch.equal(got, want)


def test_prefix_topk_breaks_ties_to_the_lower_entry() -> None:
    prefix_topk = _bench().prefix_topk
    scores = torch.tensor([[1.0, 3.0, 3.0, -2.0, 3.0, 0.5, -0.0, 0.0] * 8])  # 64 entries
    got = prefix_topk(scores.to(DEVICE), torch.tensor([64], device=DEVICE), 16).cpu()[0]
    order = sorted(range(64), key=lambda i: (-scores[0, i].item(), i))[:16]
    assert got.tolist() == order

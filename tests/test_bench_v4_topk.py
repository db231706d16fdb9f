"""bench_v4_kernels.py --csa-topk's candidate for a long row's top-k (a graph-safe step gives every
row all T entries, a -inf tail past its context), `chunked_topk`, the top k of each chunk, then of
those: torch's top-k values over the whole row (and indices that name them), whatever the chunk
against k and the row's length."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

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

"""The greedy argmax kernel on CUDA, bf16 at the models' vocabulary sizes: torch.argmax's answer,
including planted ties across the row (the first index wins).

Run on the GPU machine:  python -m pytest -m gpu tests/gpu/test_argmax_gpu.py
Speed against torch.argmax: python benchmarks/bench_argmax.py
"""

from __future__ import annotations

import pytest
import torch

from atomrt.workers.kernels.argmax import argmax_rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows", [1, 8, 32, 256])
@pytest.mark.parametrize("vocab", [49152, 128256, 151936])
def test_matches_torch_argmax(vocab: int, rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(vocab + rows)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen).to(dtype)
    # bf16 logits tie often; plant more: each row's maximum copied to a later and an earlier index
    top = logits.argmax(dim=-1)
    for r in range(0, rows, 3):
        logits[r, (int(top[r]) * 7 + 11) % vocab] = logits[r, top[r]]
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_in_a_cuda_graph() -> None:
    logits = torch.randn(4, 49152, device="cuda", dtype=torch.bfloat16)
    argmax_rows(logits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(logits)
    for _ in range(3):
        logits.normal_()
        graph.replay()
        assert torch.equal(out, logits.argmax(dim=-1))


@pytest.mark.parametrize("splits", [1, 2, 4, 16, 32])
def test_every_split_count(splits: int) -> None:
    """Forced split counts at Llama-3's vocabulary, with the row maximum planted in several splits;
    the row counters are back at zero after each launch."""
    from atomrt.workers.kernels.argmax import _workspace

    vocab = 128256
    logits = torch.randn(3, vocab, device="cuda", dtype=torch.bfloat16)
    logits[0, [vocab - 5, 70_000, 9]] = 30.0  # the first of three equal maxima wins
    logits[1, :] = float("-inf")
    for _ in range(2):
        assert torch.equal(argmax_rows(logits, num_splits=splits), logits.argmax(dim=-1))
        assert torch.count_nonzero(_workspace(logits.device)[2]) == 0

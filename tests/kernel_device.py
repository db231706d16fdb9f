"""Where the kernel tests build their tensors: a CUDA device when one is present (the compiled
kernels run), else the CPU, where the kernels run through Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 there). References are computed in float64, on the inputs' device or the
CPU; the GPU tier reuses some of them on CUDA tensors."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_same_roundings(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """A kernel's float32 result and torch's of the same formula: bit for bit through the
    interpreter, which rounds each operation as torch does; on CUDA within a few float32 roundings,
    since the compiled kernel fuses a * b + c into one rounding where torch rounds the product first.
    The GPU tier checks the bfloat16 results the models use bit for bit."""
    if actual.device.type == "cpu":
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=2e-6)

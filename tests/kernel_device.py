"""Where the kernel tests build their tensors: a CUDA device when one is present (the compiled
kernels run), else the CPU, where the kernels run through Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 there). References are computed in float64, on the inputs' device or the
CPU; the GPU tier reuses some of them on CUDA tensors."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

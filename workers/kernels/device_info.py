"""What the kernels' launch planning reads of the device: its SM count (cached per device).

On CPU (Triton's interpreter) a small stand-in count keeps the planned grids small.
"""

from __future__ import annotations

import functools

import torch

INTERPRETER_SMS = 4  # stands in for the SM count when the Triton interpreter runs on CPU


@functools.cache
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (INTERPRETER_SMS off CUDA)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())

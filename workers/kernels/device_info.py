"""What the kernels' launch planning reads of the device: its SM count (cached per device), and
whether the decode kernels launch with programmatic dependent launch; and the per-device scratch
buffers kernels keep between launches (`device_scratch`).

On CPU (Triton's interpreter) a small stand-in count keeps the planned grids small.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from atomrt.runtime import envs

INTERPRETER_SMS = 4  # stands in for the SM count when the Triton interpreter runs on CPU
H200_NUM_SMS = (
    132  # the planners' default SM count: the machine their tables and splits are tuned on
)


@functools.cache
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (INTERPRETER_SMS off CUDA)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sm_count(_index(device))


# False: kernels still compile their PDL code (use_pdl) but launch without the attribute, so they run
# one after another: the same arithmetic without the overlap (tests/gpu/test_pdl_gpu.py's reference).
PDL_ATTRIBUTE = True


@functools.cache
def _cuda_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (ATOMRT_PDL=1, sm90+).

    A kernel launched so may start while the kernel before it in the stream finishes. Such a kernel
    must call `gdc_wait` before it touches anything that kernel writes or reads (every store, and every
    load but those of weights, which no kernel writes during a forward), and calls
    `gdc_launch_dependents` only after that wait: then, when a kernel starts, every kernel but the one
    just before it has finished, and whatever it loads before its wait cannot be in flight."""
    if not envs.ENV.pdl or device.type != "cuda":
        return False
    return _cuda_capability(_index(device))[0] >= 9


def _index(device: torch.device) -> int:
    """A CUDA device's index; the current device for a bare "cuda"."""
    return device.index if device.index is not None else torch.cuda.current_device()


_scratch: dict[tuple[str, torch.device], Any] = {}


def device_scratch(
    name: str, device: torch.device, make: Callable[[torch.device], Any], hint: str
) -> Any:
    """`make(device)`, made once per device and kept: buffers a kernel reuses between launches
    (self-resetting counters, split workspaces). They must be made before any CUDA-graph capture,
    since a recording cannot zero new memory: made during one, this raises naming `name` and `hint`
    (how to make them earlier). One device's launches sharing them must not overlap in time."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buffers = _scratch.get((name, device))
    if buffers is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{name} would be allocated during a CUDA-graph capture; {hint}")
        buffers = _scratch[(name, device)] = make(device)
    return buffers

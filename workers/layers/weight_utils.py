"""Reading one rank's shard of a checkpoint tensor.

A "sliceable" weight is a torch.Tensor (GGUF, dummy) or a safetensors `PySafeSlice` (from
`safe_open(...).get_slice(name)`): both have a shape and support `w[tuple_of_slices]`, and the
safe slice reads only the bytes of the slice. Weight loaders narrow with these helpers, so a rank
never reads another rank's shard from disk.
"""

from __future__ import annotations

from typing import Any

import torch

Sliceable = Any  # torch.Tensor | safetensors PySafeSlice


def shape_of(weight: Sliceable) -> tuple[int, ...]:
    if isinstance(weight, torch.Tensor):
        return tuple(weight.shape)
    return tuple(weight.get_shape())


def read_narrow(weight: Sliceable, dim: int, start: int, size: int) -> torch.Tensor:
    """`weight[..., start:start+size, ...]` along `dim`, materialized as a tensor."""
    index = (slice(None),) * dim + (slice(start, start + size),)
    return weight[index]


def read_all(weight: Sliceable) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight[:]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy a loaded tensor into a parameter (slice), converting dtype/device; shapes must match."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{what}: checkpoint shape {tuple(src.shape)} does not match the model's {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: Sliceable) -> None:
    """A replicated parameter: every rank loads the whole tensor."""
    copy_checked(param.data, read_all(loaded_weight), "replicated weight")


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division for sharding over TP ranks, with an error that names what did not split evenly."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{what}: {numerator} is not divisible by tensor_parallel_size {denominator}"
        )
    return numerator // denominator

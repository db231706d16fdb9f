"""The CPU path of the linear layers and the LM head: oneDNN's GEMM on a weight reordered once.

F.linear on CPU (MKL sgemm) repacks the weight on every call; for the few rows of a decode step
that repacking is most of the work. `CPUPackedWeight` keeps a copy of a float32 weight in oneDNN's
blocked layout, made at the first eager CPU forward and remade when the weight's storage or version
changes, and `packed_linear` multiplies by it: a row's result does not depend on the other rows
of the batch. Traced (torch.compile) and non-float32 forwards keep their own path (`get` gives
None), so do weights below `PACK_MIN_WEIGHT_ELEMS` (MKL handles those on one thread, while oneDNN
spreads even a tiny GEMM over every OpenMP thread and waits for the slowest, which costs
milliseconds when processes share the cores), and a torch without oneDNN.
"""

from __future__ import annotations

from typing import Optional

import torch

# The batch size the blocked layout is chosen for; every batch size can use it (decode batches of
# a few to a few dozen rows are the ones the reorder pays for).
PACK_ROWS_HINT = 16
# Smaller weights stay on F.linear; every projection of SmolLM2-135M is above it.
PACK_MIN_WEIGHT_ELEMS = 1 << 18
_HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)


class CPUPackedWeight:
    """A float32 weight [N, K] in oneDNN's blocked layout, for one layer (its `cpu_packed`)."""

    def __init__(self, min_weight_elems: int = PACK_MIN_WEIGHT_ELEMS) -> None:
        self.min_weight_elems = min_weight_elems
        self._key: Optional[tuple[int, int, tuple[int, ...]]] = None
        self._packed: Optional[torch.Tensor] = None

    def get(self, weight: torch.Tensor, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The packed `weight` when `x @ weight^T` runs eagerly on CPU in float32, else None."""
        if (
            torch.compiler.is_compiling()
            or not _HAS_ONEDNN
            or x.device.type != "cpu"
            or x.dtype != torch.float32
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
            or weight.numel() < self.min_weight_elems
        ):
            return None
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
            self._key = key
        return self._packed

    def reset(self) -> None:
        """Forget the packed copy (the weight was rewritten in place: loading does not bump its version)."""
        self._key, self._packed = None, None


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) -> [..., N] with `packed` from `CPUPackedWeight.get`."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # [num_tokens, K]
    y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # [num_tokens, N]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def reset_packed_weights(model: torch.nn.Module) -> None:
    """Forget every layer's packed copy: called after weights are (re)loaded into `model`."""
    for module in model.modules():
        packed = getattr(module, "cpu_packed", None)
        if isinstance(packed, CPUPackedWeight):
            packed.reset()

"""`PackedStep`: a request-graph step's inputs in one buffer, sent to the GPU in one copy.

A FULL decode step fills six static buffers (`forward_vars`); each host-to-device copy costs host
time (a launch, and an event on the pinned staging buffer) before the graph can start. Instead the step's rows are laid out back to back in one pinned buffer, copied in one
transfer to a device buffer at a fixed address, and unpacked into the static buffers by device
copies recorded at the head of every request graph (`unpack`). Layout for a bucket of `seqs`
sequences and `rows` token rows: int64 input_ids, positions, slot_mapping [rows]; then int32
cu_seqlens_q [seqs + 1], context_lens [seqs], block_tables [seqs, max_blocks].
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# name, dtype, length ("rows", "seqs" or "seqs+1"), padding value (None: the step's token count)
_METADATA = (
    ("positions", torch.int64, "rows", 0),
    ("slot_mapping", torch.int64, "rows", -1),
    ("cu_seqlens_q", torch.int32, "seqs+1", None),
    ("context_lens", torch.int32, "seqs", 0),
    ("block_tables", torch.int32, "seqs", -1),
)
FIELDS = (("input_ids", torch.int64, "rows", 0),) + _METADATA
# Async scheduling: the rows' ids land in the token pool, and `token_src` says where each row's is
# (StepInputs.token_src); the graph gathers input_ids after unpacking (ModelRunner.unpack_step).
ASYNC_FIELDS = (("staged_ids", torch.int64, "rows", 0), ("token_src", torch.int64, "rows", 0)) + _METADATA


def write_padded(host: np.ndarray, values: np.ndarray, length: int, pad: Any) -> None:
    """host[:length] = values, then `pad` (rows of a 2-D array alike: columns past values' width too)."""
    n = values.shape[0]
    if host.ndim == 2:
        width = values.shape[1] if n else 0
        host[:n, :width] = values
        host[:n, width:] = pad
    else:
        host[:n] = values
    host[n:length] = pad


class PackedStep:
    def __init__(
        self, max_seqs: int, max_rows: int, max_blocks: int, device: torch.device, fields: tuple = FIELDS
    ) -> None:
        self.max_blocks = max_blocks
        self.fields = fields
        nbytes = sum(nbytes for *_, nbytes in self._layout(max_seqs, max_rows))
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # (seqs, rows) -> (bytes used, [(name, host numpy view, device view, length, padding)])
        self._buckets: dict[tuple[int, int], tuple[int, list[tuple[str, np.ndarray, torch.Tensor, int, Any]]]] = {}

    def _layout(self, seqs: int, rows: int) -> list[tuple[str, torch.dtype, tuple[int, ...], Any, int]]:
        """(name, dtype, shape, padding, bytes) per field, in buffer order."""
        out = []
        for name, dtype, length, pad in self.fields:
            count = {"rows": rows, "seqs": seqs, "seqs+1": seqs + 1}[length]
            shape = (count, self.max_blocks) if name == "block_tables" else (count,)
            out.append((name, dtype, shape, pad, int(np.prod(shape)) * dtype.itemsize))
        return out

    def _bucket(self, seqs: int, rows: int) -> tuple[int, list[tuple[str, np.ndarray, torch.Tensor, int, Any]]]:
        bucket = self._buckets.get((seqs, rows))
        if bucket is None:
            views, offset = [], 0
            for name, dtype, shape, pad, size in self._layout(seqs, rows):
                if offset + size > self.host.numel():
                    raise ValueError(f"PackedStep: a step of {seqs} sequences x {rows} rows exceeds the buffer")
                host = self.host[offset : offset + size].view(dtype).view(shape).numpy()
                dev = self.device[offset : offset + size].view(dtype).view(shape)
                views.append((name, host, dev, shape[0], pad))
                offset += size
            bucket = self._buckets[(seqs, rows)] = (offset, views)
        return bucket

    def stage(self, inputs: Any, seqs: int, rows: int) -> None:
        """Write a step's `StepInputs`, padded to (seqs, rows), and start its one copy to the device."""
        nbytes, views = self._bucket(seqs, rows)
        n = inputs.num_tokens
        for name, host, _, length, pad in views:
            write_padded(host, _field(inputs, name), length, n if pad is None else pad)
        self.device[:nbytes].copy_(self.host[:nbytes], non_blocking=True)

    def unpack(self, forward_vars: dict[str, torch.Tensor], seqs: int, rows: int) -> None:
        """Copy the staged step into the static buffers (device to device; recorded in request graphs)."""
        for name, _, dev, length, _ in self._bucket(seqs, rows)[1]:
            forward_vars[name][:length].copy_(dev)


def _field(inputs: Any, name: str) -> np.ndarray:
    return inputs.input_ids if name == "staged_ids" else getattr(inputs, name)

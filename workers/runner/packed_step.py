"""`PackedStep`: a request-graph step's inputs in one buffer, sent to the GPU in one copy.

A FULL decode step fills six static buffers (`forward_vars`); each host-to-device copy costs host
time (a launch, and an event on the pinned staging buffer) before the graph can start. Instead the
step's rows are laid out back to back in one pinned buffer, copied in one transfer to a device
buffer at a fixed address, and unpacked into the static buffers by one kernel recorded at the head
of every request graph (`unpack`, kernels/unpack_step.py).

Layout for a bucket of `seqs` sequences and `rows` token rows, in the order of the buffer:
- int64 [rows] each: the input ids (async scheduling: the staged ids, then `token_src`), positions,
  slot_mapping;
- int32: the block tables' live width W (the widest table of the step), cu_seqlens_q [seqs + 1],
  context_lens [seqs], block_tables [seqs, W].
Only W columns travel: with a long max_model_len a full-width table would cost a copy of up to
max_blocks entries per sequence every step (1 MiB for 32 sequences at 131072 tokens). The static
table's columns past W keep stale entries, which no kernel reads: attention loads a table entry
only for keys inside the sequence's context, and those lie within W.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from atomrt.workers.kernels.unpack_step import unpack_step_kernel

UNPACK_BLOCK = 1024  # entries a program moves per loop step


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


@dataclass(frozen=True)
class _Layout:
    """Word offsets of one bucket's fields: int64 words for the row fields, int32 words for the rest."""

    ids_at: int
    src_at: int  # async scheduling only (else equal to ids_at and unused)
    positions_at: int
    slots_at: int
    width_at: int
    cu_at: int
    context_at: int
    table_at: int


class PackedStep:
    def __init__(
        self, max_seqs: int, max_rows: int, max_blocks: int, device: torch.device,
        prev_token_base: Optional[int] = None,
    ) -> None:
        """`prev_token_base` (async scheduling): `token_src` values from it on name the previous
        step's samples (`forward_vars["prev_tokens"]`), values below it the step's own staged ids."""
        self.max_seqs, self.max_rows, self.max_blocks = max_seqs, max_rows, max_blocks
        self.prev_token_base = prev_token_base
        self._layouts: dict[tuple[int, int], _Layout] = {}
        last = self._layout(max_seqs, max_rows)
        nbytes = 8 * -(-(last.table_at + max_seqs * max_blocks) // 2)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._host64, self._host32 = self.host.numpy().view(np.int64), self.host.numpy().view(np.int32)
        self._device64, self._device32 = self.device.view(torch.int64), self.device.view(torch.int32)

    def _layout(self, seqs: int, rows: int) -> _Layout:
        layout = self._layouts.get((seqs, rows))
        if layout is None:
            ids_at = 0
            src_at = rows if self.prev_token_base is not None else ids_at  # token_src follows the ids
            positions_at = src_at + rows
            slots_at = positions_at + rows
            width_at = 2 * (slots_at + rows)  # the int32 words start where the int64 ones end
            cu_at = width_at + 1
            context_at = cu_at + seqs + 1
            table_at = context_at + seqs
            layout = _Layout(ids_at, src_at, positions_at, slots_at, width_at, cu_at, context_at, table_at)
            self._layouts[(seqs, rows)] = layout
        return layout

    def stage(self, inputs: Any, seqs: int, rows: int) -> None:
        """Write a step's `StepInputs`, padded to (seqs, rows), and start its one copy to the device."""
        if seqs > self.max_seqs or rows > self.max_rows:
            raise ValueError(f"PackedStep: a step of {seqs} sequences x {rows} rows exceeds the buffer "
                             f"({self.max_seqs} x {self.max_rows})")
        table = inputs.block_tables  # int32 [num_seqs, W]
        width = table.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"PackedStep: block tables of {width} blocks exceed max_blocks {self.max_blocks}")
        lay, h64, h32, n = self._layout(seqs, rows), self._host64, self._host32, inputs.num_tokens
        write_padded(h64[lay.ids_at : lay.ids_at + rows], inputs.input_ids, rows, 0)
        if self.prev_token_base is not None:
            write_padded(h64[lay.src_at : lay.src_at + rows], inputs.token_src, rows, 0)
        write_padded(h64[lay.positions_at : lay.positions_at + rows], inputs.positions, rows, 0)
        write_padded(h64[lay.slots_at : lay.slots_at + rows], inputs.slot_mapping, rows, -1)
        h32[lay.width_at] = width
        write_padded(h32[lay.cu_at : lay.cu_at + seqs + 1], inputs.cu_seqlens_q, seqs + 1, n)
        write_padded(h32[lay.context_at : lay.context_at + seqs], inputs.context_lens, seqs, 0)
        write_padded(h32[lay.table_at : lay.table_at + seqs * width].reshape(seqs, width), table, seqs, -1)
        nbytes = 4 * (lay.table_at + seqs * width)
        self.device[:nbytes].copy_(self.host[:nbytes], non_blocking=True)

    def unpack(self, forward_vars: dict[str, torch.Tensor], seqs: int, rows: int) -> None:
        """Unpack the staged step into the static buffers, and (async scheduling) gather the rows'
        input ids: one launch whose grid depends only on the bucket (recorded in request graphs)."""
        lay, fv = self._layout(seqs, rows), forward_vars
        is_async = self.prev_token_base is not None
        tables = fv["block_tables"]
        unpack_step_kernel[(seqs + 1,)](
            self._device64, self._device32,
            fv["input_ids"], fv["positions"], fv["slot_mapping"], fv["cu_seqlens_q"], fv["context_lens"], tables,
            fv["prev_tokens"] if is_async else fv["input_ids"],
            rows, seqs, tables.stride(0),
            lay.ids_at, lay.src_at, lay.positions_at, lay.slots_at,
            lay.width_at, lay.cu_at, lay.context_at, lay.table_at,
            self.prev_token_base or 0,
            ASYNC=is_async, BLOCK=UNPACK_BLOCK, num_warps=4,
        )

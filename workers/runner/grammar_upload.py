"""`GrammarUpload`: a step's structured-output masks (host arrays from the driver) to the device.

A copy from pageable host memory is staged by the CUDA driver; one of a megabyte (64 rows of
Llama-3's vocabulary) was feared to hold the host until the stream has run the work queued before
it. With `PINNED_GRAMMAR_MASKS` the masks are copied into pinned buffers first (a host memcpy)
and go to the device without waiting on the stream. Two buffers take turns; each is written again
only once the copy out of it, recorded by an event, has run. benchmarks/bench_grammar_apply.py
--upload times both behind a busy stream: on an H100 the driver's staging held the host less
than the pinned path's memcpy, so the pageable copy is the default.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

# Off: on an H100 behind 5 ms of queued work (bench_grammar_apply.py --upload) the pinned path held
# the host 104 / 254 us at 16 / 64 rows of Llama 3's vocabulary, the pageable copy 42 / 133 us.
PINNED_GRAMMAR_MASKS = False
SLOTS = 2


class _Slot:
    def __init__(self) -> None:
        self.host = torch.empty(0, dtype=torch.int32)  # pinned, grown to the largest mask
        self.rows = torch.empty(0, dtype=torch.int64)  # pinned
        self.done: Optional[torch.cuda.Event] = None  # the copy out of it has run


class GrammarUpload:
    """The rows and masks of one step as device tensors (`__call__`)."""

    def __init__(self, device: torch.device, pinned: Optional[bool] = None) -> None:
        self.device = device
        use = PINNED_GRAMMAR_MASKS if pinned is None else pinned
        self.pinned = use and device.type == "cuda"
        self._slots = [_Slot() for _ in range(SLOTS)] if self.pinned else []
        self._turn = 0

    def __call__(self, rows: np.ndarray, bitmask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """rows int [m], bitmask int32 [m, words] on the host -> (int64 [m], int32 [m, words]) on
        the device, copied in stream order."""
        if not self.pinned:
            return (
                torch.as_tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True),
                torch.as_tensor(bitmask, dtype=torch.int32).to(self.device, non_blocking=True),
            )
        slot = self._slots[self._turn]
        self._turn = (self._turn + 1) % len(self._slots)
        if slot.done is not None:
            slot.done.synchronize()  # run long since: the step it was for has sampled
        m, words = bitmask.shape
        if slot.host.numel() < m * words:
            slot.host = torch.empty(m * words, dtype=torch.int32, pin_memory=True)
        if slot.rows.numel() < m:
            slot.rows = torch.empty(max(m, 64), dtype=torch.int64, pin_memory=True)
        host = slot.host[: m * words].view(m, words)
        host.numpy()[...] = bitmask  # numpy's copy: the array may be a read-only message view
        host_rows = slot.rows[:m]
        host_rows.numpy()[...] = rows
        out = (
            host_rows.to(self.device, non_blocking=True),
            host.to(self.device, non_blocking=True),
        )
        if slot.done is None:
            slot.done = torch.cuda.Event()
        slot.done.record()
        return out

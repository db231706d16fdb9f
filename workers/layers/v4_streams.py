"""DeepSeek-V4's compressor side stream: the fork in `v4_attn_compress_launch` and the join in
`v4_attention`, ahead of the layer's eager region (workers/layers/v4_attention.py).

A compressed layer's compressors (their projections, the cache writes and the pooling) need no
query: they run on a side stream while the current stream computes the query and the window key.

    fork:  event on the current stream; the side stream waits on it; the compressors on the side
           stream; a second event on the side stream; the tensors the side stream reads or writes
           that the caller allocated (its input rows, `rows`, the positions) are kept here
    join:  the current stream waits on the side stream's event; the kept tensors are let go

Fork and join are called in one layer's attention with no eager region between them, so a token
graph records both in one segment: CUDA graph capture takes the side stream into the capture at
its wait on the capturing stream's event and needs it joined back before the capture ends. The
kept tensors outlive the side stream's use of them: they are released after the current stream
waits on it, so the caching allocator hands their memory to later work of the current stream only
behind the compressors. What the side stream allocates itself it also frees there (stream-ordered).

One `V4SideStreams` per model (made with it), shared by its layers; the CUDA stream and the two
events are made on first use and reused every step. Off CUDA fork and join only keep the order's
bookkeeping (a fork joined before the next), so the CPU runs the same code in one stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch


class CudaStreams:
    """The stream operations the fork and join use, on CUDA."""

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)


class V4SideStreams:
    """One model's compressor side stream (this module's docstring). `streams` replaces
    `CudaStreams` for every device (its ordering is tested on the CPU that way); by default CUDA
    devices fork and other devices do not."""

    def __init__(self, streams: Optional[Any] = None) -> None:
        self._streams = streams
        self._made: dict[Any, tuple[Any, Any, Any]] = {}  # device -> (side stream, fork, done)
        # (layer index, the side stream's done event or None, the kept tensors) of an open fork
        self._pending: Optional[tuple[int, Any, tuple]] = None

    def _api(self, device: torch.device) -> Optional[Any]:
        if self._streams is not None:
            return self._streams
        return CudaStreams() if device.type == "cuda" else None

    def _made_for(self, api: Any, device: torch.device) -> tuple[Any, Any, Any]:
        key = str(device)
        if key not in self._made:
            self._made[key] = (api.new_stream(device), api.new_event(), api.new_event())
        return self._made[key]

    @property
    def pending_layer(self) -> Optional[int]:
        """The layer whose fork is not joined yet (None: none)."""
        return None if self._pending is None else self._pending[0]

    @contextlib.contextmanager
    def fork(self, layer_idx: int, device: torch.device, keep: tuple) -> Iterator[None]:
        """Run the body on the side stream, ordered after the current stream's work so far;
        `keep`: the caller's tensors the body uses, held until `join(layer_idx)`."""
        if self._pending is not None:
            stale, self._pending = self._pending[0], None  # a later step starts clean
            raise RuntimeError(
                f"v4 compressor fork of layer {layer_idx} while layer {stale}'s is not joined"
            )
        api = self._api(device)
        if api is None:
            yield
            self._pending = (layer_idx, None, keep)
            return
        side, forked, done = self._made_for(api, device)
        forked.record(api.current(device))
        side.wait_event(forked)
        with api.use(side):
            yield
            done.record(side)
        self._pending = (layer_idx, done, keep)

    def join(self, layer_idx: int, device: torch.device) -> None:
        """The current stream waits on layer `layer_idx`'s fork (nothing when it has none open:
        a sliding layer); the kept tensors are released after the wait."""
        if self._pending is None:
            return
        pending_layer, done, _ = self._pending
        if pending_layer != layer_idx:
            self._pending = None
            raise RuntimeError(
                f"v4 attention of layer {layer_idx} while layer {pending_layer}'s compressor "
                "fork is not joined"
            )
        if done is not None:
            self._api(device).current(device).wait_event(done)
        self._pending = None

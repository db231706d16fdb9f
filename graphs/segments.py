"""The shared CUDA-graph memory pool and the segment backends that capture into it.

- `graph_pool()`: the one CUDA-graph memory pool of the process; every recording uses it
  (graphs/region_graph.py: the pool-sharing invariant). `graph_pool_bytes()`: what it holds.
- `SegmentBackend`: what a recording needs to capture, replay and join segments; `CudaGraphBackend`
  is the real one (`torch.cuda.CUDAGraph` per segment, on one side stream), and the CPU tests drive
  recordings with fakes that only log calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional, Protocol

import torch

_pool: Any = None  # the process's graph pool handle, made on first use
_pool_keeper: Any = None  # a tiny graph recorded into the pool, keeping its id valid
_stream: Any = None  # the capture stream, made on first use


def graph_pool() -> Any:
    """The process's one CUDA-graph memory pool (`torch.cuda.graph_pool_handle()`, made lazily).

    Made outside any capture (the first recording's session makes it). A tiny keeper graph is
    recorded into it at once and held for the life of the process: the allocators (device and host)
    retire a pool when the last graph recorded into it dies, and recording into a retired pool id
    fails an internal assertion. The keeper keeps the id valid however recordings come and go.
    """
    global _pool, _pool_keeper
    if _pool is None:
        handle = torch.cuda.graph_pool_handle()
        keeper = torch.cuda.CUDAGraph()
        stream = _capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            keeper.capture_begin(pool=handle)
            torch.zeros(1, device=torch.cuda.current_device())
            keeper.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        _pool, _pool_keeper = handle, keeper
    return _pool


def _capture_stream() -> torch.cuda.Stream:
    """The side stream every recording captures on (capture cannot run on the default stream)."""
    global _stream
    if _stream is None:
        _stream = torch.cuda.Stream()
    return _stream


def graph_pool_bytes() -> Optional[int]:
    """Bytes the allocator holds reserved for `graph_pool()` on this device; None before the pool exists."""
    if _pool is None:
        return None
    pool_id = tuple(_pool)
    return sum(
        seg["total_size"]
        for seg in torch.cuda.memory_snapshot()
        if tuple(seg.get("segment_pool_id", ())) == pool_id
    )


# --------------------------------------------------------------------------- segment backends


class SegmentBackend(Protocol):
    """Captures and replays graph segments. One recording: `session()` around `begin`/`end` pairs.
    `begin(keep=True)`: the segment may later be joined with others by `compose` (a handle that
    `launch` runs as one, the parts in order); `part=True`: it runs only as part of such a join."""

    def session(self) -> Any: ...  # context manager around one whole recording
    def begin(self, keep: bool = False, part: bool = False) -> None: ...
    def end(self) -> Any: ...  # returns the segment handle given to `replay`
    def abort(self) -> None: ...  # end an open capture after an error, discarding it
    def replay(self, segment: Any) -> None: ...
    def compose(self, segments: list[Any]) -> Any: ...
    def launch(self, composite: Any) -> None: ...


class CudaGraphBackend:
    """The real backend: each segment a `torch.cuda.CUDAGraph` captured into `graph_pool()`.

    It does what `torch.cuda.graph(g, pool=graph_pool(), capture_error_mode=...)` does, split in two
    so the capture can pause at an eager region: one side stream for the whole recording,
    `capture_begin(pool, capture_error_mode)` / `capture_end()` per segment. It skips that context
    manager's per-capture `empty_cache()`, which would only churn the default pool between segments.
    """

    def __init__(self, capture_error_mode: Optional[str] = None) -> None:
        if capture_error_mode is None:
            # "thread_local": a CUDA call of another thread (the NCCL watchdog's event polls) does
            # not invalidate the capture; the capturing thread is still checked.
            from atomrt.distributed.nccl_watchdog import graph_capture_kwargs

            capture_error_mode = graph_capture_kwargs()["capture_error_mode"]
        self.capture_error_mode = capture_error_mode
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._instantiate = False

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """One recording: wait out pending NCCL work, capture on the side stream, synchronize."""
        graph_pool()  # made before any capture opens
        # A collective recorded into a graph joins its NCCL stream into the capture; a watchdog
        # poll of a pending eager collective on that stream would invalidate the capture.
        from atomrt.distributed.nccl_watchdog import drain_nccl_works

        drain_nccl_works()
        torch.cuda.synchronize()
        stream = _capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def begin(self, keep: bool = False, part: bool = False) -> None:
        """`keep`: keep the captured graph for `compose`; `part`: it is only ever run as part of
        a composite, never replayed alone (so it is not instantiated)."""
        assert self._graph is None, "a segment is already being captured"
        graph = torch.cuda.CUDAGraph(keep_graph=keep)
        graph.capture_begin(pool=graph_pool(), capture_error_mode=self.capture_error_mode)
        self._graph = graph  # only once capturing: abort() ends what is open
        self._instantiate = keep and not part

    def end(self) -> torch.cuda.CUDAGraph:
        graph, self._graph = self._graph, None
        assert graph is not None, "no segment is being captured"
        graph.capture_end()
        if self._instantiate:
            graph.instantiate()  # capture_end does not instantiate a kept graph
        return graph

    def abort(self) -> None:
        if self._graph is not None:
            self.end()  # an invalidated capture raises here, chained to the original error

    def replay(self, segment: torch.cuda.CUDAGraph) -> None:
        segment.replay()

    def compose(self, segments: list[torch.cuda.CUDAGraph]) -> tuple[Any, int]:
        """The kept segments as one `CompositeGraph` (graphs/composite.py), on this device."""
        from atomrt.graphs.composite import CompositeGraph

        device = torch.cuda.current_device()
        stream = torch._C._cuda_getCurrentRawStream(device)
        return CompositeGraph([g.raw_cuda_graph() for g in segments], stream), device

    def launch(self, composite: tuple[Any, int]) -> None:
        graph, device = composite
        graph.launch(torch._C._cuda_getCurrentRawStream(device))

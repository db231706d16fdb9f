"""`CompositeGraph`: recorded CUDA graphs joined in order into one executable graph, one launch.

A TokenGraph recording whose eager regions were also recorded for a request bucket (region
request graphs, graphs/region_graph.py) replays a decode step of that bucket as its segments and
those region graphs in order. Each would be a graph launch of its own, a few microseconds of host
time apiece; joined as child-graph nodes of one graph (`cuGraphAddChildGraphNode`, each depending
on the one before) they are one launch. The child graphs are cloned into the composite: it reads
and writes the addresses they were recorded with, in the shared pool, and allocates nothing.

The CUDA driver API is reached through ctypes (libcuda, which every CUDA process has loaded); a
`cudaGraph_t` of the runtime API is the driver's `CUgraph`. Importing this module needs no GPU.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any


class CudaDriverError(RuntimeError):
    pass


@functools.cache
def _libcuda() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    handle, p_handle = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
    signatures = {
        "cuGraphCreate": [p_handle, ctypes.c_uint],
        "cuGraphAddChildGraphNode": [
            p_handle,
            handle,
            p_handle,
            ctypes.c_size_t,
            handle,
        ],
        "cuGraphInstantiateWithFlags": [p_handle, handle, ctypes.c_ulonglong],
        "cuGraphUpload": [handle, handle],
        "cuGraphLaunch": [handle, handle],
        "cuGraphExecDestroy": [handle],
        "cuGraphDestroy": [handle],
        "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _libcuda().cuGetErrorString(result, ctypes.byref(text))
        reason = text.value.decode() if text.value else "unknown error"
        raise CudaDriverError(f"{what} failed: CUDA driver error {result} ({reason})")


class CompositeGraph:
    """`graphs` (raw `cudaGraph_t` handles, e.g. `torch.cuda.CUDAGraph(keep_graph=True)
    .raw_cuda_graph()`) as one executable graph that runs them in the given order."""

    def __init__(self, graphs: Sequence[int], stream: int) -> None:
        if not graphs:
            raise ValueError("a composite graph needs at least one graph")
        lib = _libcuda()
        self._graph = ctypes.c_void_p()
        self._exec = ctypes.c_void_p()
        _check(lib.cuGraphCreate(ctypes.byref(self._graph), 0), "cuGraphCreate")
        try:
            previous = None
            for child in graphs:
                node = ctypes.c_void_p()
                deps = (ctypes.c_void_p * 1)(previous) if previous is not None else None
                _check(
                    lib.cuGraphAddChildGraphNode(
                        ctypes.byref(node),
                        self._graph,
                        deps,
                        0 if previous is None else 1,
                        ctypes.c_void_p(child),
                    ),
                    "cuGraphAddChildGraphNode",
                )
                previous = node
            _check(
                lib.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), self._graph, 0),
                "cuGraphInstantiateWithFlags",
            )
            # The first launch of an executable graph uploads it; do it now, outside any step.
            _check(lib.cuGraphUpload(self._exec, ctypes.c_void_p(stream)), "cuGraphUpload")
        except BaseException:
            self.close()
            raise
        self.num_graphs = len(graphs)
        self._launch = lib.cuGraphLaunch
        self._exec_handle = self._exec.value

    def launch(self, stream: int) -> None:
        """Run every graph, in order, on `stream` (a raw `cudaStream_t`)."""
        result = self._launch(self._exec_handle, stream)
        if result != 0:
            _check(result, "cuGraphLaunch")

    def close(self) -> None:
        lib = _libcuda()
        if self._exec.value:
            lib.cuGraphExecDestroy(self._exec)
            self._exec = ctypes.c_void_p()
        if self._graph.value:
            lib.cuGraphDestroy(self._graph)
            self._graph = ctypes.c_void_p()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass  # interpreter shutdown: the driver may be gone

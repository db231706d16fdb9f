"""The compile cache's front: `CompilerManager` compiles a piece or loads it from the cache, keyed
by `(runtime_shape, graph_index, backend_name)`, and `compilation_counter` counts this process's
compile work. Both are importable from atomrt.compile.backends, where the guide places them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.fx

from atomrt.compile.cache import (
    INDEX_FILE_NAME,
    LOCK_FILE_NAME,
    CorruptCacheEntry,
    FileLock,
    read_index,
    write_index,
)
from atomrt.compile.compiler_interface import (
    CompilerInterface,
    EagerAdaptor,
    graph_fingerprint,
    make_compiler,
    piece_signature,
)

# its log lines keep the name of the module the guide places it in
logger = logging.getLogger("atomrt.compile.backends")


@dataclass
class CompilationCounter:
    """Counts of compile work in this process, for tests and start-up logs."""

    num_graphs_seen: int = 0  # Dynamo graphs handed to the backend
    num_piecewise_graphs_seen: int = 0  # pieces after splitting, splitting pieces included
    num_piecewise_capturable_graphs_seen: int = 0  # pieces compiled (non-splitting)
    num_inductor_compiles: int = 0  # compilations actually performed by Inductor
    num_cache_loads: int = 0  # artifacts loaded from the on-disk cache
    num_trace_loads: int = 0  # models built from a kept Dynamo trace (compile/trace_cache.py)
    num_shared_pieces: int = 0  # pieces served by another piece's compiled callable (same code)
    num_cache_misses: int = 0  # lookups that found nothing usable
    num_corrupt_entries: int = 0  # entries found damaged, logged and recompiled
    # Wall time of compile work: each decorated model's first call (Dynamo, compiles, loads)
    # plus the lazy per-size compiles or loads after it.
    compile_seconds: float = 0.0

    def snapshot(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, type(f.default)())


compilation_counter = CompilationCounter()


class PieceNotCached(RuntimeError):
    """A piece the compile cache lacks while the manager may only load (`loads_only`)."""


# ---- compile-or-load ------------------------------------------------------------------------


class CompilerManager:
    """Compile-or-load of pieces through a `CompilerInterface`, with an on-disk index."""

    def __init__(self, compilation_config: Any):
        self.compilation_config = compilation_config
        self.compiler: CompilerInterface = make_compiler(compilation_config)
        self.cache: dict[tuple, dict] = {}
        self.cache_dir: Optional[Path] = None
        self.disable_cache = True  # until initialize_cache
        self.read_only = False  # load from the cache, never write it (compile/cache.py)
        self.compile_seconds = 0.0
        # Load or share pieces, never compile them: set while a model is built from a kept trace
        # (compile/trace_cache.py), whose fake inputs are not Dynamo's and would compile pieces the
        # cache cannot save; its caller traces instead.
        self.loads_only = False
        # compiled callables by (runtime shape, piece_signature): a piece computing what an
        # earlier one computes (a decoder's middle layers) reuses its callable
        self._shared: dict[tuple[Optional[int], str], Callable] = {}

    def compute_hash(self, device: torch.device) -> str:
        return self.compiler.compute_hash(device)

    def initialize_cache(
        self, cache_dir: Path, disable_cache: bool = False, prefix: str = ""
    ) -> None:
        self.cache_dir = cache_dir
        self.disable_cache = disable_cache or isinstance(self.compiler, EagerAdaptor)
        self.compiler.initialize_cache(str(cache_dir), self.disable_cache, prefix)
        # A read-only cache's compiler saves nothing: what it compiles lives in memory only.
        self.read_only = self.compiler.read_only
        if self.read_only:
            logger.info("compile cache %s is read-only: pieces are only loaded from it", cache_dir)
        else:
            cache_dir.mkdir(parents=True, exist_ok=True)
        self.cache = self._read_index()

    @property
    def index_path(self) -> Path:
        assert self.cache_dir is not None, "initialize_cache first"
        return self.cache_dir / INDEX_FILE_NAME

    def _read_index(self) -> dict:
        try:
            return read_index(self.index_path)
        except CorruptCacheEntry as e:
            compilation_counter.num_corrupt_entries += 1
            logger.warning("%s; starting a new index", e)
            return {}

    def save_to_file(self) -> None:
        write_index(self.index_path, self.cache)

    def load(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        graph_index: int,
        runtime_shape: Optional[int],
    ) -> Optional[Callable]:
        """The cached callable, or None (missing, for another graph, or damaged: logged)."""
        key = (runtime_shape, graph_index, self.compiler.name)
        entry = self.cache.get(key)
        if entry is None:
            return None
        if entry.get("graph_hash") != graph_fingerprint(graph, example_inputs):
            if self.loads_only:  # the caller traces and meets this entry again: logged there
                raise PieceNotCached(f"piece {graph_index} was compiled for a different graph")
            logger.warning(
                "compile cache: entry %s was compiled for a different graph; recompiling", key
            )
            return None
        try:
            compiled = self.compiler.load(
                entry["handle"], graph, example_inputs, graph_index, runtime_shape
            )
        except CorruptCacheEntry as e:
            if self.loads_only:  # the caller traces and meets this entry again: counted there
                raise PieceNotCached(f"piece {graph_index}: {e}") from e
            compilation_counter.num_corrupt_entries += 1
            logger.warning("compile cache: %s; recompiling", e)
            del self.cache[key]
            return None
        compilation_counter.num_cache_loads += 1
        logger.debug("compile cache: loaded piece %d for shape %s", graph_index, runtime_shape)
        return compiled

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        additional_inductor_config: dict[str, Any],
        graph_index: int = 0,
        num_graphs: int = 1,
        runtime_shape: Optional[int] = None,
    ) -> Callable:
        """The callable of a piece with the same signature compiled or loaded before in this
        process; else load the piece from the cache, or compile it and record it (under the
        directory lock)."""
        start = time.perf_counter()
        signature = piece_signature(graph, example_inputs)
        try:
            shared = self._shared.get((runtime_shape, signature)) if signature else None
            if shared is not None:
                compilation_counter.num_shared_pieces += 1
                return shared
            piece = (graph, example_inputs, additional_inductor_config, graph_index)
            compiled = self._compile_or_load((*piece, num_graphs, runtime_shape))
            if signature is not None:
                self._shared[(runtime_shape, signature)] = compiled
            return compiled
        finally:
            if runtime_shape is not None:  # lazy, after the first call (which the decorator times)
                compilation_counter.compile_seconds += time.perf_counter() - start

    def _compile_or_load(self, piece: tuple) -> Callable:
        """`piece`: `_compile`'s arguments."""
        graph, example_inputs, _, graph_index, _, runtime_shape = piece
        if self.disable_cache:
            return self._compile(*piece)
        assert self.cache_dir is not None
        if self.read_only:  # no writer can race us through this view: no lock
            compiled = self._load_or_count_miss(graph, example_inputs, graph_index, runtime_shape)
            if compiled is None:
                logger.warning(
                    "compile cache %s is read-only and lacks piece %d for %s: compiling it in "
                    "memory, unsaved (fill the cache with `atomrt prewarm` and this config)",
                    self.cache_dir,
                    graph_index,
                    "the general shape" if runtime_shape is None else f"shape {runtime_shape}",
                )
                compiled = self._compile(*piece)
            return compiled
        with FileLock(self.cache_dir / LOCK_FILE_NAME):
            self.cache = self._read_index()  # another process may have added entries
            compiled = self._load_or_count_miss(graph, example_inputs, graph_index, runtime_shape)
            return self._compile(*piece) if compiled is None else compiled

    def _load_or_count_miss(
        self, graph, example_inputs, graph_index: int, runtime_shape: Optional[int]
    ) -> Optional[Callable]:
        """The cached callable, or None after counting the miss."""
        compiled = self.load(graph, example_inputs, graph_index, runtime_shape)
        if compiled is None:
            self._count_miss(graph_index, runtime_shape)
        return compiled

    def _count_miss(self, graph_index: int, runtime_shape: Optional[int]) -> None:
        if self.loads_only:  # the caller traces and meets this miss again: counted there
            raise PieceNotCached(
                f"the compile cache has no piece {graph_index} for {runtime_shape or 'general'}"
            )
        compilation_counter.num_cache_misses += 1

    def _compile(
        self, graph, example_inputs, config, graph_index, num_graphs, runtime_shape
    ) -> Callable:
        key = (runtime_shape, graph_index, self.compiler.name)
        if self.loads_only and not isinstance(self.compiler, EagerAdaptor):
            raise PieceNotCached(
                f"the compile cache has no piece {graph_index} for {runtime_shape}"
            )
        start = time.perf_counter()
        compiled, handle = self.compiler.compile(
            graph,
            example_inputs,
            config,
            runtime_shape,
            key=f"artifact_shape_{runtime_shape}_subgraph_{graph_index}",
        )
        elapsed = time.perf_counter() - start
        self.compile_seconds += elapsed
        if not isinstance(self.compiler, EagerAdaptor):
            compilation_counter.num_inductor_compiles += 1
            shape = "general shape" if runtime_shape is None else f"shape {runtime_shape}"
            logger.info(
                "Inductor compiled piece %d/%d for %s in %.2f s",
                graph_index + 1,
                num_graphs,
                shape,
                elapsed,
            )
        if handle is not None and not self.disable_cache and not self.read_only:
            self.cache[key] = {
                "handle": handle,
                "graph_hash": graph_fingerprint(graph, example_inputs),
            }
            self.save_to_file()
        return compiled

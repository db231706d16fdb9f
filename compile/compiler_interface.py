"""Compiler adaptors: one interface, three implementations, picked by `make_compiler()`.

- `InductorStandaloneAdaptor` (torch >= 2.8, the one used here): `torch._inductor.standalone_compile`,
  artifacts saved "unpacked" into the cache directory and loaded with `CompiledArtifact.load`.
- `InductorAdaptor` (torch < 2.8): `compile_fx` in process; see its docstring for what it caches.
- `EagerAdaptor` (`use_inductor=False`): runs the FX graph as is; nothing to cache.

A handle is what `compile()` returns for the index and `load()` takes back; it must be plain data
(the index is a pprint-ed Python literal).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.fx

from atomrt.compile.cache import (
    CorruptCacheEntry,
    compiler_factors,
    is_read_only,
    verify_ready_marker,
    write_ready_marker,
)

logger = logging.getLogger("atomrt.compile.compiler")

RuntimeShape = Optional[int]  # None: the general (dynamic) shape


def _graph_returns_tuple(graph: torch.fx.GraphModule) -> bool:
    from torch._inductor.compile_fx import graph_returns_tuple

    return graph_returns_tuple(graph)


def _first_device(example_inputs: list[Any]) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


class CompilerInterface:
    """What the compiler manager needs from a compiler."""

    name: str = "interface"

    def initialize_cache(
        self, cache_dir: str, disable_cache: bool = False, prefix: str = ""
    ) -> None:
        """Where artifacts go; `disable_cache` means compile every time and save nothing. A
        read-only cache (`compile/cache.py`) is loaded from and never written."""
        self.cache_dir = Path(cache_dir)
        self.disable_cache = disable_cache
        self.read_only = not disable_cache and is_read_only(self.cache_dir)
        self.prefix = prefix

    def compute_hash(self, device: torch.device) -> str:
        """Hash of the compiler's own state that changes the artifacts (versions, device)."""
        blob = json.dumps({"name": self.name, **compiler_factors(device)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        runtime_shape: RuntimeShape = None,
        key: Optional[str] = None,
    ) -> tuple[Callable, Optional[Any]]:
        """Compile `graph`; return the callable and a handle for `load()` (None: not cacheable)."""
        raise NotImplementedError

    def load(
        self,
        handle: Any,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        graph_index: int,
        runtime_shape: RuntimeShape = None,
    ) -> Callable:
        """Load what `compile()` saved under `handle`; raise `CorruptCacheEntry` if it is damaged."""
        raise NotImplementedError


class EagerAdaptor(CompilerInterface):
    """No compiler: the piece runs as traced (`use_inductor=False`)."""

    name = "eager"

    def compile(self, graph, example_inputs, compiler_config, runtime_shape=None, key=None):
        return graph, None

    def load(self, handle, graph, example_inputs, graph_index, runtime_shape=None):
        raise CorruptCacheEntry("the eager adaptor caches nothing")


class InductorStandaloneAdaptor(CompilerInterface):
    """Inductor through `standalone_compile` (torch >= 2.8); handle = (artifact directory name,)."""

    name = "inductor_standalone"

    def compile(self, graph, example_inputs, compiler_config, runtime_shape=None, key=None):
        from torch._inductor import standalone_compile
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        patches = dict(compiler_config)
        if isinstance(runtime_shape, int):
            patches.update(max_autotune=True, coordinate_descent_tuning=True)
        # The general shape reuses Dynamo's symbolic shapes (we run inside the backend call); a
        # concrete size specialises on the real example inputs.
        dynamic_shapes = (
            "from_example_inputs" if isinstance(runtime_shape, int) else "from_tracing_context"
        )
        caching = not self.disable_cache and not self.read_only and key is not None
        # Compile inside a private Inductor cache directory, so the native objects built for this
        # piece can be saved beside it (see _copy_native_objects).
        staging = self.cache_dir / f".staging_{key}_{os.getpid()}" if caching else None
        with temporary_cache_dir(str(staging)) if staging else nullcontext():
            artifact = standalone_compile(
                graph,
                example_inputs,
                dynamic_shapes=dynamic_shapes,
                options={"config_patches": patches},
            )
        if not caching:
            return artifact, None
        path = self.cache_dir / key
        try:
            artifact.save(path=str(path), format="unpacked")
            _copy_native_objects(staging, path)
        except RuntimeError as e:  # e.g. something in the graph Inductor cannot serialise
            logger.warning(
                "compile cache: artifact %s could not be saved (%s); it will be recompiled next time",
                key,
                e,
            )
            shutil.rmtree(path, ignore_errors=True)
            return artifact, None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        write_ready_marker(path)
        return artifact, (key,)

    def load(self, handle, graph, example_inputs, graph_index, runtime_shape=None):
        from torch._inductor import CompiledArtifact

        (key,) = handle
        path = self.cache_dir / key
        if self.read_only:
            # Loading takes file locks beside the native objects: load a private copy.
            path = _scratch_copy(path, f"{self.prefix}_{os.path.basename(self.cache_dir)}_{key}")
        verify_ready_marker(path)
        try:
            artifact = CompiledArtifact.load(path=str(path), format="unpacked")
        except Exception as e:  # any failure inside Inductor's loader means a bad entry
            raise CorruptCacheEntry(
                f"artifact {path} failed to load: {type(e).__name__}: {e}"
            ) from e
        if _graph_returns_tuple(graph):
            return artifact
        # A loaded artifact always returns the flat output list; the traced piece returned one value.
        return lambda *args: artifact(*args)[0]


_scratch_root: Optional[str] = None


def _scratch_copy(artifact_dir: Path, name: str) -> Path:
    """A copy of a read-only cache's artifact in this process's scratch directory (removed at
    exit): Inductor's loader writes lock files next to the native objects it loads."""
    global _scratch_root
    if _scratch_root is None:
        _scratch_root = tempfile.mkdtemp(prefix="atomrt-compile-scratch-")
        atexit.register(shutil.rmtree, _scratch_root, True)
    copy = Path(_scratch_root) / name
    if not copy.exists():
        try:
            shutil.copytree(artifact_dir, copy)
        except OSError as e:
            shutil.rmtree(copy, ignore_errors=True)
            raise CorruptCacheEntry(f"artifact {artifact_dir} could not be read: {e}") from e
    return copy


def _copy_native_objects(built_root: Path, artifact_dir: Path) -> None:
    """Copy the C++ kernels (source and shared object) built while compiling into the artifact.

    An unpacked artifact holds the output code but not its native builds; without them the loading
    process runs the C++ compiler again (seconds per piece on CPU). Inductor names them by content
    hash under its cache directory, the same relative path in both places.
    """
    for built in list(built_root.rglob("*.so")) + list(built_root.rglob("*.cpp")):
        rel = built.relative_to(built_root)
        if rel.parts[0] in ("fxgraph", "aotautograd", "locks") or (artifact_dir / rel).exists():
            continue
        (artifact_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, artifact_dir / rel)


class AlwaysHitShapeEnv:
    """A shape environment whose guards always hold.

    Inductor's FX graph cache checks a cached graph's shape guards against the ambient
    ShapeEnv; outside Dynamo's tracing there is none, so `InductorAdaptor` supplies this one.
    """

    def __init__(self) -> None:
        self.guards: list[Any] = []

    def evaluate_guards_expression(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def get_pruned_guards(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []

    def produce_guards_expression(self, *args: Any, **kwargs: Any) -> str:
        return ""


@contextmanager
def _always_hit_shape_env() -> Iterator[None]:
    """The one patch of torch internals in atomrt (the guide's InductorAdaptor): while Inductor
    looks up its FX graph cache outside Dynamo, give it a ShapeEnv whose guards always pass."""
    from unittest import mock

    from torch._inductor.codecache import FxGraphCache

    with mock.patch.object(FxGraphCache, "_get_shape_env", lambda: AlwaysHitShapeEnv()):
        yield


class InductorAdaptor(CompilerInterface):
    """Inductor through `compile_fx` (torch < 2.8).

    It relies on Inductor's own FX graph cache (pointed at our cache directory) to make a second
    compile of the same graph a cache hit; `AlwaysHitShapeEnv` lets that lookup succeed outside
    Dynamo. The handle records only the key. Not exercised on torch >= 2.8 (the package's floor).
    """

    name = "inductor"

    def compile(self, graph, example_inputs, compiler_config, runtime_shape=None, key=None):
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        patches = dict(compiler_config)
        patches["fx_graph_cache"] = True
        if isinstance(runtime_shape, int):
            patches.update(max_autotune=True, coordinate_descent_tuning=True)
        with inductor_config.patch(patches), _always_hit_shape_env():
            compiled = compile_fx(graph, example_inputs)
        return compiled, None if self.disable_cache or key is None else (key,)

    def load(self, handle, graph, example_inputs, graph_index, runtime_shape=None):
        compiled, _ = self.compile(graph, example_inputs, {}, runtime_shape, key=None)
        return compiled


def make_compiler(compilation_config: Any) -> CompilerInterface:
    """`EagerAdaptor` without Inductor; otherwise the standalone adaptor where torch has it."""
    if not compilation_config.use_inductor:
        return EagerAdaptor()
    if hasattr(torch._inductor, "standalone_compile") or _torch_at_least((2, 8)):
        return InductorStandaloneAdaptor()
    return InductorAdaptor()


def _torch_at_least(version: tuple[int, int]) -> bool:
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) >= version


def graph_fingerprint(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    """What the piece computes: its code and its inputs' dtypes and static sizes ("s" marks a
    symbolic dim). A second line of defence behind the directory hash: an index entry whose
    fingerprint differs is recompiled, never loaded."""

    def describe(x: Any) -> Union[str, list]:
        if isinstance(x, torch.Tensor):
            return [str(x.dtype), [d if isinstance(d, int) else "s" for d in x.shape]]
        return "int" if isinstance(x, (int, torch.SymInt)) else type(x).__name__

    blob = graph.code + json.dumps([describe(x) for x in example_inputs])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def piece_signature(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Optional[str]:
    """What a piece computes, up to the names of its inputs: its nodes in order (op, target, and
    arguments as node positions or literals) and its inputs' dtypes, devices, sizes and strides
    (a symbolic size by its expression).
    Two pieces of one model with the same signature compute the same function of their inputs (a
    decoder's middle layers, whose weights are inputs), so one compiled callable serves both.
    None for a piece that reads module attributes (`get_attr`, `call_module`): their values are
    not in the signature, so such a piece is never shared."""
    position: dict[torch.fx.Node, int] = {}
    lines = []
    for i, node in enumerate(graph.graph.nodes):
        if node.op in ("get_attr", "call_module"):
            return None
        position[node] = i
        target = "" if node.op in ("placeholder", "output") else str(node.target)
        args = torch.fx.node.map_arg(node.args, lambda n: f"%{position[n]}")
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: f"%{position[n]}")
        lines.append(f"{node.op}|{target}|{args!r}|{kwargs!r}")

    def dims(xs: Any) -> list:  # a symbolic dim by its expression: equal dims stay equal
        return [d if isinstance(d, int) else str(d) for d in xs]

    def describe(x: Any) -> Union[str, list]:
        if isinstance(x, torch.Tensor):
            return [str(x.dtype), str(x.device), dims(x.shape), dims(x.stride())]
        if isinstance(x, torch.SymInt):
            return f"symint {x}"
        return "int" if isinstance(x, int) else type(x).__name__

    blob = "\n".join(lines) + json.dumps([describe(x) for x in example_inputs])
    return hashlib.sha256(blob.encode()).hexdigest()

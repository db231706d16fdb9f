"""The Dynamo backend for levels 2 and 3: split, compile each piece (or load it), stitch.

`PiecewiseCompileBackend` (the guide's `VllmBackend`) receives Dynamo's FX graph, hashes what
changes the compiled code, splits the graph at `splitting_ops` with the pure `split_graph()`,
compiles every non-splitting piece for the general shape through `CompilerManager`
(compiler_manager.py: compile or load, keyed by `(runtime_shape, graph_index, backend_name)`), and
returns the stitching graph.
Level 2 is the same with no splitting ops and no per-size compiles: one piece, Inductor once.

`compilation_counter` (compiler_manager.py) is the one module-level counter of compile work (tests
read it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from atomrt.compile.cache import (
    CacheHash,
    cache_dir_for,
    cache_root,
    compute_cache_hash,
    model_source_files,
)

# the compile cache's front lives in compiler_manager.py; these names are also this module's, where
# the guide places them
from atomrt.compile.compiler_manager import (  # noqa: F401
    CompilationCounter,
    CompilerManager,
    compilation_counter,
)
from atomrt.compile.piecewise_backend import PiecewiseBackend
from atomrt.runtime.config import CompilationLevel, Config, CUDAGraphMode

logger = logging.getLogger("atomrt.compile.backends")

# ---- splitting ------------------------------------------------------------------------------


@dataclass
class SplitItem:
    submod_name: str
    graph_id: int
    is_splitting_graph: bool
    graph: torch.fx.GraphModule


def resolve_splitting_ops(names: list[str]) -> set:
    """Map "namespace.op" (or "namespace.op.overload") to torch.ops objects; unknown names are
    skipped (no graph can call an op that is not registered)."""
    resolved: set = set()
    for name in names:
        parts = name.split(".")
        if len(parts) not in (2, 3):
            raise ValueError(
                f"compilation_config.splitting_ops: {name!r} is not 'namespace.op[.overload]'"
            )
        try:
            op = getattr(getattr(torch.ops, parts[0]), parts[1])
            resolved.add(getattr(op, parts[2]) if len(parts) == 3 else op)
        except AttributeError:
            logger.debug("splitting op %s is not registered; nothing splits there", name)
    return resolved


def _is_splitting_node(node: torch.fx.Node, ops: set) -> bool:
    """Dynamo records a call through the packet (`torch.ops.ns.op`) or through an overload; a
    configured packet matches all its overloads, a configured overload matches itself and calls
    through its packet."""
    if node.op != "call_function":
        return False
    target = node.target
    if target in ops:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket in ops
    return any(getattr(op, "overloadpacket", None) is target for op in ops)


def split_graph(
    graph: torch.fx.GraphModule, splitting_ops: list[str]
) -> tuple[torch.fx.GraphModule, list[SplitItem]]:
    """Split `graph` so every call of a splitting op is a piece of its own.

    Returns the stitching module (its children are the pieces, called in order) and one
    `SplitItem` per piece, ordered by graph id. The input graph is not modified.
    """
    ops = resolve_splitting_ops(splitting_ops)
    subgraph_of: dict[torch.fx.Node, int] = {}
    splitting_ids: set[int] = set()
    current = 0
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_splitting_node(node, ops):
            current += 1
            subgraph_of[node] = current
            splitting_ids.add(current)
            current += 1
        else:
            subgraph_of[node] = current
    split_gm = split_module(graph, None, lambda node: subgraph_of[node], keep_original_order=True)
    items = []
    for name, module in split_gm.named_children():
        graph_id = int(name.removeprefix("submod_"))
        items.append(SplitItem(name, graph_id, graph_id in splitting_ids, module))
    items.sort(key=lambda item: item.graph_id)
    return split_gm, items


# ---- compile each piece with fake inputs ----------------------------------------------------


def _symbolic_dim0(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > 0 and isinstance(x.shape[0], torch.SymInt)


class PiecewiseCompileInterpreter(torch.fx.Interpreter):
    """Run the split graph on fake inputs; compile each named piece as the run reaches it and
    replace it in the stitching module by a `PiecewiseBackend`."""

    def __init__(
        self,
        module: torch.fx.GraphModule,
        compile_submod_names: list[str],
        backend: PiecewiseCompileBackend,
    ):
        super().__init__(module)
        from torch._guards import detect_fake_mode

        self.fake_mode = detect_fake_mode()
        assert self.fake_mode is not None, (
            "PiecewiseCompileInterpreter runs inside a Dynamo backend call"
        )
        self.compile_submod_names = compile_submod_names
        self.backend = backend

    def run(self, *args: Any) -> Any:
        from torch._dispatch.python import enable_python_dispatcher

        fake_args = [
            self.fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args
        ]
        with self.fake_mode, enable_python_dispatcher():
            return super().run(*fake_args)

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        assert isinstance(target, str)
        output = super().call_module(target, args, kwargs)
        if target not in self.compile_submod_names:
            return output
        index = self.compile_submod_names.index(target)
        submod = self.fetch_attr(target)
        sym_shape_indices = [i for i, x in enumerate(args) if isinstance(x, torch.SymInt)]
        if not sym_shape_indices:
            sym_shape_indices = [i for i, x in enumerate(args) if _symbolic_dim0(x)][:1]
        backend = self.backend
        general = backend.compiler_manager.compile(
            submod,
            list(args),
            backend.inductor_config,
            graph_index=index,
            num_graphs=len(self.compile_submod_names),
            runtime_shape=None,
        )
        piece = PiecewiseBackend(
            submod,
            backend.compile_sizes,
            backend.inductor_config,
            index,
            len(self.compile_submod_names),
            sym_shape_indices,
            general,
            backend.compiler_manager,
        )
        # The stitching module calls `self.<target>(...)`: an instance attribute wins over the
        # child module of that name, which we drop so the piece is not held twice.
        del self.module._modules[target]
        self.module.__dict__[target] = piece
        return output


# ---- the backend ----------------------------------------------------------------------------


class CopyInputsToStaticBuffers:
    """Copy the token-dimension inputs into static buffers before each call (CUDA graph address
    stability). Buffers hold max(first call, max capture size) rows; a larger call is passed
    through uncopied (no graph is captured at that size)."""

    def __init__(
        self,
        fn: Callable,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        max_capture_size: int,
    ):
        self.fn = fn
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        self.indices = [
            i
            for i, n in enumerate(placeholders)
            if _symbolic_dim0(n.meta.get("example_value"))
            and isinstance(example_inputs[i], torch.Tensor)
        ]
        self.buffers = []
        for i in self.indices:
            x = example_inputs[i]
            rows = max(x.shape[0], max_capture_size)
            self.buffers.append(torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device))

    def __call__(self, *args: Any) -> Any:
        args = list(args)
        for i, buffer in zip(self.indices, self.buffers):
            x = args[i]
            if x.shape[0] <= buffer.shape[0]:
                static = buffer[: x.shape[0]]
                static.copy_(x)
                args[i] = static
        return self.fn(*args)


def current_rank() -> int:
    """This process's rank for the cache path (0 without torch.distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class PiecewiseCompileBackend:
    """The `torch.compile` backend of levels 2 and 3 (the guide's `VllmBackend`)."""

    def __init__(
        self, config: Config, prefix: str = "backbone", compile_start: Optional[float] = None
    ):
        cc = config.compilation_config
        self.config = config
        self.prefix = prefix
        self.compile_start = compile_start  # set by the decorator when it starts the first call
        self.compiler_manager = CompilerManager(cc)
        piecewise = cc.level == CompilationLevel.PIECEWISE
        self.splitting_ops = list(cc.splitting_ops or []) if piecewise else []
        self.compile_sizes = [int(s) for s in cc.compile_sizes or []] if piecewise else []
        self.inductor_config = dict(cc.inductor_compile_config)
        self.cache_hash: Optional[CacheHash] = None
        self.cache_dir: Optional[Path] = None
        self.split_gm: Optional[torch.fx.GraphModule] = None
        self.piecewise_graphs: list[SplitItem] = []
        self.traced: Optional[tuple] = None  # Dynamo's (graph, example inputs, source files)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        """Dynamo's call: the graph it traced and the call's inputs (tensors and sizes)."""
        if self.compile_start is not None:
            logger.info(
                "Dynamo traced %s in %.2f s", self.prefix, time.perf_counter() - self.compile_start
            )
        files = model_source_files(torch._dynamo.utils.get_traced_code() or [])
        self.traced = (graph, example_inputs, files)  # for the trace cache; dropped once kept
        return self.build(graph, example_inputs, files)

    def build(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        source_files: list[str],
        loads_only: bool = False,
    ) -> Callable:
        """Split, compile or load each piece, stitch: after Dynamo's trace or from the trace
        cache's rebuilt graph (compile/trace_cache.py). `source_files`: the model files traced;
        `loads_only`: raise PieceNotCached rather than compile a piece."""
        self.compiler_manager.loads_only = loads_only
        try:
            return self._build(graph, example_inputs, source_files)
        finally:
            self.compiler_manager.loads_only = False

    def _build(
        self, graph: torch.fx.GraphModule, example_inputs: list[Any], source_files: list[str]
    ) -> Callable:
        start = time.perf_counter()
        compilation_counter.num_graphs_seen += 1
        self._init_cache(example_inputs, source_files)
        split_gm, items = split_graph(graph, self.splitting_ops)
        self.split_gm, self.piecewise_graphs = split_gm, items
        names = [item.submod_name for item in items if not item.is_splitting_graph]
        compilation_counter.num_piecewise_graphs_seen += len(items)
        compilation_counter.num_piecewise_capturable_graphs_seen += len(names)
        self._dump(graph, split_gm)
        before = compilation_counter.snapshot()
        PiecewiseCompileInterpreter(split_gm, names, self).run(*example_inputs)
        done = compilation_counter.snapshot()
        loads = done["num_cache_loads"] - before["num_cache_loads"]
        shared = done["num_shared_pieces"] - before["num_shared_pieces"]
        logger.info(
            "%s: %d pieces (%d compiled, %d loaded from cache, %d sharing an earlier piece's "
            "code) in %.2f s, Inductor %.2f s",
            self.prefix,
            len(names),
            len(names) - loads - shared,
            loads,
            shared,
            time.perf_counter() - start,
            self.compiler_manager.compile_seconds,
        )
        cc = self.config.compilation_config
        self.compiled_callable: Callable = split_gm
        if (
            cc.cudagraph_copy_inputs
            and cc.level == CompilationLevel.PIECEWISE
            and cc.cudagraph_mode != CUDAGraphMode.NONE
        ):
            self.compiled_callable = CopyInputsToStaticBuffers(
                split_gm, graph, example_inputs, cc.max_capture_size
            )
        return self.compiled_callable

    def _init_cache(self, example_inputs: list[Any], files: list[str]) -> None:
        device = next(
            (x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu")
        )
        self.cache_hash = compute_cache_hash(
            self.config.compute_hash(), files, self.compiler_manager.compute_hash(device)
        )
        logger.info(
            "compile cache hash %s from %s; traced files %s",
            self.cache_hash.hash,
            self.cache_hash.factors,
            files,
        )
        root = cache_root(self.config.compilation_config.cache_dir)
        self.cache_dir = cache_dir_for(root, self.cache_hash.hash, current_rank(), self.prefix)
        self.compiler_manager.initialize_cache(self.cache_dir, prefix=self.prefix)

    def _dump(self, graph: torch.fx.GraphModule, split_gm: torch.fx.GraphModule) -> None:
        """computation_graph.py into the cache directory; with debug_dump_path, the traced graph too."""
        stitching = split_gm.print_readable(print_output=False)
        assert self.cache_dir is not None
        if not self.compiler_manager.read_only:
            _write_atomic(self.cache_dir / "computation_graph.py", stitching)
        dump = self.config.compilation_config.debug_dump_path
        if dump:
            rank_dir = Path(dump) / f"rank_{current_rank()}"
            rank_dir.mkdir(parents=True, exist_ok=True)
            _write_atomic(
                rank_dir / f"traced_graph_{self.prefix}.py",
                graph.print_readable(print_output=False),
            )
            _write_atomic(rank_dir / "computation_graph.py", stitching)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# The guide's name.
VllmBackend = PiecewiseCompileBackend

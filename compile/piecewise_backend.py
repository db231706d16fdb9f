"""One compiled piece of the split graph: a general-shape callable plus lazy per-size ones.

The piece runs its general (dynamic-shape) compilation for the first call and for every token
count outside `compile_sizes`; a count in `compile_sizes` is compiled on first sight for that
exact size (max_autotune, coordinate_descent_tuning) through the compiler manager, then reused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.fx

if TYPE_CHECKING:
    from atomrt.compile.backends import CompilerManager

logger = logging.getLogger("atomrt.compile.piecewise")


@dataclass
class ConcreteSizeEntry:
    """The state of one size in `compile_sizes` for one piece."""

    runtime_shape: int
    need_to_compile: bool = True
    compiled: bool = False
    runnable: Optional[Callable] = None


class PiecewiseBackend:
    """Callable that stands in for one non-splitting submodule of the split graph."""

    def __init__(
        self,
        graph: torch.fx.GraphModule,
        compile_sizes: list[int],
        inductor_config: dict[str, Any],
        graph_index: int,
        num_graphs: int,
        sym_shape_indices: list[int],
        compiled_graph_for_general_shape: Callable,
        compiler_manager: CompilerManager,
    ):
        self.graph = graph
        self.inductor_config = inductor_config
        self.graph_index = graph_index
        self.num_graphs = num_graphs
        self.is_first_graph = graph_index == 0
        self.is_last_graph = graph_index == num_graphs - 1
        # Where the token count is found at run time: an int argument (Dynamo's size symbol) if
        # the piece takes one, else dim 0 of the first tensor argument with a symbolic dim 0.
        self.sym_shape_indices = sym_shape_indices
        self.compiled_graph_for_general_shape = compiled_graph_for_general_shape
        self.compiler_manager = compiler_manager
        self.concrete_size_entries: dict[int, ConcreteSizeEntry] = {
            int(s): ConcreteSizeEntry(runtime_shape=int(s)) for s in compile_sizes
        }
        self.first_run_finished = False

    def runtime_shape(self, args: tuple) -> Optional[int]:
        for i in self.sym_shape_indices:
            x = args[i]
            return int(x.shape[0]) if isinstance(x, torch.Tensor) else int(x)
        return None

    def __call__(self, *args: Any) -> Any:
        if not self.first_run_finished:
            self.first_run_finished = True
            return self.compiled_graph_for_general_shape(*args)
        entry = self.concrete_size_entries.get(self.runtime_shape(args))
        if entry is None:
            return self.compiled_graph_for_general_shape(*args)
        if not entry.compiled:
            entry.runnable = self.compiler_manager.compile(
                self.graph,
                list(args),
                self.inductor_config,
                graph_index=self.graph_index,
                num_graphs=self.num_graphs,
                runtime_shape=entry.runtime_shape,
            )
            entry.compiled = True
        return entry.runnable(*args)

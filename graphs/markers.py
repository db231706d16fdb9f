"""The markers a model's code carries for region graphs (graphs/region_graph.py): `@eager_region`
on a function whose launch depends on host data (it breaks a TokenGraph recording), and
`@token_graph` on the module whose calls record and replay a TokenGraph; with the helpers that find
a model's units and the token buckets they recorded."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

import torch

from atomrt.graphs import region_graph
from atomrt.graphs.region_graph import (
    Phase,
    SegmentBackend,
    TokenGraph,
    _tensors,
)
from atomrt.runtime.forward_context import get_forward_context


def eager_region(
    fn: Optional[Callable[..., Any]] = None,
    *,
    bind: Optional[Callable[..., Callable[[], None]]] = None,
    request_fixed: bool = False,
) -> Any:
    """Mark a function whose launch depends on host data; it breaks a TokenGraph recording.
    `@eager_region` or `@eager_region(bind=binder)`.

    Outside a recording it just calls `fn`. While a TokenGraph records (the unit's `__call__` under
    `tr_graph == "record"`, or a drafter's `TokenGraph.record`), the call ends the current segment,
    runs eagerly, is kept for replay (tensor arguments by address, other arguments as given -- so
    they must not change between steps), and the next segment begins. `fn` reads the step's
    metadata from the forward context, writes its result into an output argument and returns None
    (or that argument). Under a ReqGraph recording (FULL, `tr_graph` None) it is recorded inline:
    its graph-safe launch must not read host data.

    `bind(*args, **kwargs)`, given the kept arguments once, returns a callable of no arguments
    that every replay runs instead of `fn(*args, **kwargs)`, doing exactly what that call would: a
    region may keep there what its arguments fix (its launches past their planning).

    `request_fixed`: under graph-safe attention metadata (a request bucket's, as FULL records it)
    the region's launch depends on no host data. A recording of a decode bucket then records that
    launch too, as a graph of its own, and a decode step of the bucket replays the recording as
    one launch (graphs/region_graph.py, `RegionRequest`). A recording with one region not so marked
    replays segment by segment.
    """

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            active = region_graph._active
            if active is None or not active.breaks:
                return fn(*args, **kwargs)
            return region_graph._break_at(fn, args, kwargs, bind, request_fixed)

        wrapper.__atomrt_eager_region__ = True  # type: ignore[attr-defined]
        return wrapper

    return mark if fn is None else mark(fn)


_UNIT_GRAPH = "_atomrt_token_graph"  # instance attribute holding a unit's TokenGraph
_UNIT_PER_PHASE = "__atomrt_token_graph_per_phase__"  # class attribute set by @token_graph


def token_graph(cls: Optional[type] = None, *, per_phase: bool = False) -> Any:
    """Class decorator marking a model's recording unit (an `nn.Module`); `@token_graph` or `@token_graph(per_phase=True)`.

    The unit's `__call__` reads `ForwardContext.tr_graph`:
      * None: runs the unit as before (eager, or compiled when `@support_torch_compile` is under it);
      * "record": records a TokenGraph for the call's row count (the first tensor argument's
        length) and phase (`context.is_prefill`), and returns the recorded output;
      * "replay": replays the recording for `context.running_tokens` rows and returns its output;
        the arguments are only checked to be the static buffers the recording read.
    Place it outermost (above `@support_torch_compile`): it wraps the class's `__call__` as found.
    A marked unit called inside another unit's recording runs inline.
    """

    def mark(unit_cls: type) -> type:
        if not (isinstance(unit_cls, type) and issubclass(unit_cls, torch.nn.Module)):
            raise TypeError(f"@token_graph marks an nn.Module class, got {unit_cls!r}")
        # A subclass of a marked unit re-marks it: wrap the original call, not the base's wrapper.
        inner_call = getattr(unit_cls.__call__, "__atomrt_unit_inner__", unit_cls.__call__)

        def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            ctx = get_forward_context()
            if ctx.tr_graph is None or region_graph._active is not None:
                return inner_call(self, *args, **kwargs)
            phase: Phase = "prefill" if ctx.context.is_prefill else "decode"
            graph = token_graph_of(self)
            if ctx.tr_graph == "replay":
                return graph.replay(
                    ctx.context.running_tokens, phase, *args, req_key=ctx.tr_req_key, **kwargs
                )
            if ctx.tr_graph == "record":
                num_tokens = _num_rows(args, kwargs)
                assert ctx.context.running_tokens in (0, num_tokens), (
                    f"context.running_tokens={ctx.context.running_tokens} but the unit was called with {num_tokens} rows"
                )
                request = ctx.tr_request if phase == "decode" else None
                return graph.record(
                    num_tokens,
                    phase,
                    functools.partial(inner_call, self),
                    *args,
                    request=request,
                    **kwargs,
                )
            raise ValueError(
                f"ForwardContext.tr_graph must be None, 'record' or 'replay', got {ctx.tr_graph!r}"
            )

        __call__.__doc__ = inner_call.__doc__
        __call__.__atomrt_unit_inner__ = inner_call  # type: ignore[attr-defined]
        unit_cls.__call__ = __call__
        setattr(unit_cls, _UNIT_PER_PHASE, per_phase)
        return unit_cls

    return mark if cls is None else mark(cls)


def is_token_graph_unit(module: torch.nn.Module) -> bool:
    return getattr(type(module), _UNIT_PER_PHASE, None) is not None


def token_graph_of(unit: torch.nn.Module, backend: Optional[SegmentBackend] = None) -> TokenGraph:
    """The TokenGraph a `@token_graph` unit owns, made on first use (with `backend`, default CUDA)."""
    if not is_token_graph_unit(unit):
        raise TypeError(f"{type(unit).__qualname__} is not marked @token_graph")
    graph = unit.__dict__.get(_UNIT_GRAPH)
    if graph is None:
        graph = TokenGraph(per_phase=getattr(type(unit), _UNIT_PER_PHASE), backend=backend)
        unit.__dict__[_UNIT_GRAPH] = graph
    else:
        assert backend is None or graph.backend is backend, (
            "the unit's TokenGraph already has another backend"
        )
    return graph


def token_graph_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The `@token_graph` units in `model` (itself included), outermost first."""
    return [m for m in model.modules() if is_token_graph_unit(m)]


def captured_token_sizes(model: torch.nn.Module, phase: Phase) -> list[int]:
    """Token buckets every unit of `model` recorded for `phase` (what a step of that phase may pad to)."""
    graphs = [unit.__dict__.get(_UNIT_GRAPH) for unit in token_graph_units(model)]
    if not graphs or any(g is None for g in graphs):
        return []
    sizes = set(graphs[0].captured_sizes(phase))
    for graph in graphs[1:]:
        sizes &= set(graph.captured_sizes(phase))
    return sorted(sizes)


def _num_rows(args: tuple, kwargs: dict) -> int:
    for t in _tensors((args, kwargs)):
        return int(t.shape[0])
    raise TypeError(
        "a @token_graph unit takes its token rows (e.g. input_ids) as a tensor argument"
    )

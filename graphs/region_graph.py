# Hot path (replay): only what a step runs per graph replay lives here -- segment replays, the
# eager regions between them, an input-address check. Recording code runs once, at capture.
"""Region graphs: CUDA-graph recordings of the model's forward, in one shared memory pool.

- `graph_pool()`: the one CUDA-graph memory pool of the process; every recording uses it.
- `ReqGraph` (FULL): one whole-forward CUDA graph per request bucket `(running_bs, draft_num)`.
- `TokenGraph` (TR_HYBRID): one recording per token bucket (and phase, for a per-phase unit).
  A recording is a list of CUDA-graph segments with an eager call between two segments: the
  recording breaks wherever the forward calls an `@eager_region` function (an op whose launch
  depends on host data, e.g. attention planned from the step's sequence lengths). At replay the
  eager call runs with the live step's forward context and writes its result into its `output`
  argument, at the address the next segment was recorded reading.
- Request graphs inside a token graph: a decode bucket's recording may also record each eager
  region's launch for its request bucket (`RegionRequest`, regions marked `request_fixed`), each
  as a graph of its own; segments and region graphs are then joined into one executable graph
  (graphs/composite.py) that a decode step of that request bucket replays in one launch.
- The markers a model's code carries live in graphs/markers.py: `@token_graph` (the recording
  unit, whose `__call__` records a TokenGraph when `ForwardContext.tr_graph == "record"`, replays
  it when it is "replay", and runs its forward otherwise) and `@eager_region`.

Memory invariant (pool sharing). Recordings never overlap in use: a recording's output is consumed
before any other recording replays, and all replays run on one stream. So the pool only has to be
as large as the largest recording, not the sum, and buckets are recorded largest first. For that,
nothing a recording keeps for replay may own pool memory once its recording ends:
  * the eager calls' tensor arguments and the recording's outputs are kept as NON-OWNING aliases
    (`non_owning_alias`: a storage built on the raw address with
    `torch._C._construct_storage_from_data_pointer`, which frees nothing when it dies -- the same
    mechanism torch._inductor's cudagraph trees use for their outputs; present in torch >= 2.1);
  * the recording's inputs are the runner's static buffers (allocated outside the pool, owned by the
    runner); a recording keeps only their addresses, to check them at replay.
The owning tensors die when the recorded forward returns; their blocks go back to the pool's free
list, and the next (smaller) recording reuses them. Replaying a recording rewrites every pool address
it reads before reading it (a segment writes what the next eager call reads; the eager call writes
what the next segment reads), so another recording's use of the same addresses in between is harmless.
Eager calls at replay allocate their temporaries outside the pool (no capture is open then), so they
cannot clobber a recording's live values. Consequence for callers: a replay's output is valid only
until the next replay of any recording -- consume (or copy) it first.

The recording being made is the one piece of module state besides the pool: `_active` is set by
`_record` and reset in `finally`, so an `@eager_region` call deep in the model can find it
(`ForwardContext` has no field for it). It is capture-time state, never read on a replay step.

Segment capture goes through a small backend class (`CudaGraphBackend` by default, in
graphs/segments.py with the pool) so that the CPU tests can drive the segment / eager sequencing
with a fake backend that only logs calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional

import torch

from atomrt.graphs.segments import (  # noqa: F401  (re-exported: the guide names them here)
    CudaGraphBackend,
    SegmentBackend,
    graph_pool,
    graph_pool_bytes,
)
from atomrt.runtime.forward_context import get_forward_context, use_forward_context

logger = logging.getLogger(__name__)

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, Phase] = ("prefill", "decode")

_active: Optional[_Recording] = None  # the recording being made (capture time only)


def recording() -> bool:
    """Whether the running forward is being recorded (a token graph's or a drafter's recording, or
    any CUDA graph capture): what it launches must not depend on the step's lengths."""
    if _active is not None:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# --------------------------------------------------------------------------- non-owning aliases


def non_owning_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor at `t`'s address, shape and strides that does not keep `t`'s memory alive."""
    if t.numel() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    storage = torch._C._construct_storage_from_data_pointer(
        t.data_ptr(), t.device, extent * t.element_size()
    )
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply `fn` to the tensors of a (nested) tuple / list / dict; other leaves stay."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _addresses(args: tuple, kwargs: dict) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(data_ptr, shape) of every tensor argument: what a replay checks its inputs against."""
    return tuple((t.data_ptr(), tuple(t.shape)) for t in _tensors((args, kwargs)))


# --------------------------------------------------------------------------- recordings


@dataclass
class _EagerCall:
    """One eager region of a recording: the function and its arguments, tensors as non-owning
    aliases; `bound`, what the region's binder (`eager_region(bind=...)`) made of them, runs in
    its place."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    bound: Optional[Callable[[], None]] = None

    def run(self) -> None:
        if self.bound is not None:
            self.bound()
        else:
            self.fn(*self.args, **self.kwargs)


@dataclass
class RegionRequest:
    """What a TokenGraph recording of a decode bucket also records: its eager regions' launches
    for request bucket `key`, each as a graph of its own, recorded with `attn_metadata` (graph-safe:
    the bucket fixes the launch) in the forward context. Joined with the segments, they replay a
    decode step of that bucket as one launch (`TokenGraph.replay(..., req_key=key)`).

    With `before` and / or `after`, the join is the whole step instead: `before()` recorded ahead
    of the first segment (e.g. unpacking the staged step), `after(output)` behind the last (e.g.
    the LM head and argmax of the recorded output, which it returns); `TokenGraph.launch_step`
    runs it and returns what `after` returned (non-owning aliases)."""

    key: tuple[int, int]
    attn_metadata: Any
    before: Optional[Callable[[], None]] = None
    after: Optional[Callable[[Any], Any]] = None

    @property
    def whole_step(self) -> bool:
        return self.before is not None or self.after is not None


@dataclass
class _Recording:
    """Segments with one eager call between each two, the recorded output, the input addresses.
    With a `RegionRequest`: the eager regions' graphs for its bucket too, and the join of segments
    and region graphs by request bucket (`composites`; `steps`: a whole-step join's outputs)."""

    backend: SegmentBackend
    breaks: bool  # may eager regions break it (TokenGraph) or are they recorded inline (ReqGraph)
    segments: list[Any] = field(default_factory=list)
    eager_calls: list[_EagerCall] = field(default_factory=list)
    inputs: tuple = ()
    output: Any = None
    request: Optional[RegionRequest] = None  # capture time: the region graphs being recorded
    region_graphs: list[Any] = field(default_factory=list)
    before_after: tuple[Any, Any] = (None, None)  # a whole-step request's parts
    composites: dict[tuple[int, int], Any] = field(default_factory=dict)
    steps: dict[tuple[int, int], Any] = field(default_factory=dict)

    def replay(self, req_key: Optional[tuple[int, int]] = None) -> Any:
        if req_key is not None and req_key not in self.steps:
            composite = self.composites.get(req_key)
            if composite is not None:
                self.backend.launch(composite)
                return self.output
        for i, segment in enumerate(self.segments):
            self.backend.replay(segment)
            if i < len(self.eager_calls):
                self.eager_calls[i].run()
        return self.output

    def launch_step(self, req_key: tuple[int, int]) -> Any:
        self.backend.launch(self.composites[req_key])
        return self.steps[req_key]

    def compose(self, after_output: Any) -> None:
        """After the recording: join segments and region graphs, if every region has one."""
        request, self.request = self.request, None
        if request is None or not (self.eager_calls or request.whole_step):
            return
        if len(self.region_graphs) != len(self.eager_calls):
            self.region_graphs = []  # a region whose launch no request bucket fixes
            return
        before, after = self.before_after
        parts: list[Any] = [before] if before is not None else []
        for i, segment in enumerate(self.segments):
            parts.append(segment)
            if i < len(self.region_graphs):
                parts.append(self.region_graphs[i])
        if after is not None:
            parts.append(after)
        try:
            self.composites[request.key] = self.backend.compose(parts)
        except Exception as e:  # the recording still replays segment by segment
            logger.warning(
                "request bucket %s: its segments and region graphs could not be joined into one "
                "graph (%s); its decode steps replay them one by one",
                request.key,
                e,
            )
            return
        if request.whole_step:
            self.steps[request.key] = _map_tensors(after_output, non_owning_alias)


def _record(
    backend: SegmentBackend,
    breaks: bool,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    request: Optional[RegionRequest] = None,
) -> _Recording:
    """Record `fn(*args, **kwargs)`; the output is kept as non-owning aliases (see the module docstring)."""
    global _active
    assert _active is None, "recordings do not nest"
    rec = _Recording(backend=backend, breaks=breaks, inputs=_addresses(args, kwargs))
    rec.request = request if breaks else None
    keep = rec.request is not None
    after_output = None
    with backend.session():
        try:
            before = after = None
            if keep and rec.request.before is not None:
                before, _ = _record_part(backend, rec.request.before)
            _active = rec
            try:
                backend.begin(keep=keep)
                out = fn(*args, **kwargs)
                rec.segments.append(backend.end())
            finally:
                _active = None
            if keep and rec.request.after is not None:
                # `out` still owns its memory here: what `after` allocates cannot overlap it
                after, after_output = _record_part(backend, lambda: rec.request.after(out))
            rec.before_after = (before, after)
        except BaseException:
            backend.abort()
            raise
    rec.output = _map_tensors(out, non_owning_alias)
    rec.compose(after_output)
    return rec


def _record_part(backend: SegmentBackend, fn: Callable[[], Any]) -> tuple[Any, Any]:
    """(graph, result) of `fn()` recorded as a part of a join (never replayed alone)."""
    backend.begin(keep=True, part=True)
    result = fn()
    return backend.end(), result


def _break_at(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    bind: Optional[Callable[..., Callable[[], None]]] = None,
    request_fixed: bool = False,
) -> Any:
    """Inside a TokenGraph recording: end the segment, run `fn` eagerly, keep the call (bound by
    `bind` when given), record its request-bucket launch when the recording asks for one and the
    region has it (`request_fixed`), begin the next."""
    rec = _active
    assert rec is not None
    rec.segments.append(rec.backend.end())
    result = fn(*args, **kwargs)
    arg_ptrs = {t.data_ptr() for t in _tensors((args, kwargs))}
    if result is not None and not (
        isinstance(result, torch.Tensor) and result.data_ptr() in arg_ptrs
    ):
        raise TypeError(
            f"eager region {fn.__qualname__} returned a new value; an eager region must write its result "
            "into an output argument allocated by the caller and return None (or that argument)"
        )
    call = _EagerCall(
        fn=fn,
        args=_map_tensors(args, non_owning_alias),
        kwargs=_map_tensors(kwargs, non_owning_alias),
    )
    if bind is not None:
        call.bound = bind(*call.args, **call.kwargs)
    rec.eager_calls.append(call)
    if rec.request is not None and request_fixed:
        rec.region_graphs.append(_record_region(rec, fn, args, kwargs))
    rec.backend.begin(keep=rec.request is not None)
    return result


def _record_region(rec: _Recording, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Record one eager region's launch for the recording's request bucket, as a graph of its own:
    `fn` runs under the request's (graph-safe) attention metadata, reading and writing the
    addresses the segments around it were recorded with."""
    assert rec.request is not None
    ctx = get_forward_context()
    previous = use_forward_context(replace(ctx, attn_metadata=rec.request.attn_metadata))
    try:
        return _record_part(rec.backend, lambda: fn(*args, **kwargs))[0]
    finally:
        use_forward_context(previous)


# --------------------------------------------------------------------------- token and request graphs


class TokenGraph:
    """TR_HYBRID recordings of one unit: one per token bucket (and phase, when `per_phase`).

    A recording serves prefill and decode steps of its token count alike (unless `per_phase`), but
    `captured_sizes(phase)` reports only the buckets that phase's record pass asked for: those are
    the buckets a step of that phase may pad to.
    """

    def __init__(self, per_phase: bool = False, backend: Optional[SegmentBackend] = None) -> None:
        self.per_phase = per_phase
        self.backend: SegmentBackend = backend if backend is not None else CudaGraphBackend()
        self._recordings: dict[tuple[int, Optional[Phase]], _Recording] = {}
        self._asked: dict[Phase, set[int]] = {p: set() for p in PHASES}

    def _key(self, num_tokens: int, phase: Phase) -> tuple[int, Optional[Phase]]:
        assert phase in PHASES, f"phase must be 'prefill' or 'decode', got {phase!r}"
        return (int(num_tokens), phase if self.per_phase else None)

    def record(
        self,
        num_tokens: int,
        phase: Phase,
        fn: Callable[..., Any],
        *args: Any,
        request: Optional[RegionRequest] = None,
        **kwargs: Any,
    ) -> Any:
        """Record `fn(*args, **kwargs)` for `num_tokens` rows; returns its output (non-owning aliases).

        The tensor arguments must be the runner's static buffers (sliced to `num_tokens` rows): a
        replay reads them at these addresses. A bucket already recorded for the other phase is not
        recorded again: it is replayed, and now also counts as this phase's bucket. With `request`
        (a decode bucket), the eager regions' launches for that request bucket are recorded too
        (`RegionRequest`), and a replay given its key runs the recording as one launch.
        """
        key = self._key(num_tokens, phase)
        self._asked[phase].add(int(num_tokens))
        if key in self._recordings:
            return self.replay(num_tokens, phase, *args, **kwargs)
        rec = _record(self.backend, True, fn, args, kwargs, request)
        self._recordings[key] = rec
        return rec.output

    def replay(
        self,
        num_tokens: int,
        phase: Phase,
        *args: Any,
        req_key: Optional[tuple[int, int]] = None,
        **kwargs: Any,
    ) -> Any:
        """Replay the recording for `num_tokens` rows; the forward context holds the live step's metadata.

        Arguments, if given, are only checked: they must be the static buffers the recording read.
        With `req_key`, a request bucket whose region graphs the recording holds, the segments and
        those graphs run as one launch (the step's metadata staged as that bucket's, graph-safe);
        otherwise segment by segment, the eager regions between them.
        The output is valid until the next replay of any recording (they share one pool).
        """
        rec = self._recordings.get(self._key(num_tokens, phase))
        if rec is None:
            raise KeyError(
                f"no token graph recorded for {num_tokens} rows ({phase}); recorded: {sorted(self._recordings)}. "
                "ForwardMode.decide should have chosen eager for this step"
            )
        if args or kwargs:
            assert _addresses(args, kwargs) == rec.inputs, (
                "a token graph replays only on the static input buffers it was recorded with "
                f"(recorded {rec.inputs}, got {_addresses(args, kwargs)})"
            )
        return rec.replay(req_key)

    def req_keys(self) -> list[tuple[int, int]]:
        """Request buckets whose decode steps replay a recording as one launch (`RegionRequest`)."""
        return sorted(
            {k for rec in self._recordings.values() for k in rec.composites if k not in rec.steps}
        )

    def step_keys(self) -> list[tuple[int, int]]:
        """Request buckets whose whole decode step is one launch (`launch_step`)."""
        return sorted({k for rec in self._recordings.values() for k in rec.steps})

    def launch_step(self, num_tokens: int, phase: Phase, req_key: tuple[int, int]) -> Any:
        """Run the whole-step join recorded for `req_key` at `num_tokens` rows (a RegionRequest
        with `before` / `after`); returns what `after` returned, valid until the next replay."""
        rec = self._recordings.get(self._key(num_tokens, phase))
        if rec is None or req_key not in rec.steps:
            raise KeyError(
                f"no whole-step join recorded for request bucket {req_key} at {num_tokens} rows "
                f"({phase})"
            )
        return rec.launch_step(req_key)

    def recording_io(self, num_tokens: int, phase: Phase) -> tuple[tuple, Any]:
        """(input addresses, output) of the recording for `num_tokens` rows."""
        rec = self._recordings[self._key(num_tokens, phase)]
        return rec.inputs, rec.output

    def captured_sizes(self, phase: Phase) -> list[int]:
        """Token buckets a step of `phase` may replay, ascending."""
        return sorted(n for n in self._asked[phase] if self._key(n, phase) in self._recordings)

    def num_segments(self, num_tokens: int, phase: Phase) -> int:
        return len(self._recordings[self._key(num_tokens, phase)].segments)

    def __contains__(self, key: tuple[int, Phase]) -> bool:
        num_tokens, phase = key
        return self._key(num_tokens, phase) in self._recordings

    def __len__(self) -> int:
        return len(self._recordings)


class ReqGraph:
    """FULL recordings: one whole-forward CUDA graph per request bucket `(running_bs, draft_num)`.

    Eager regions are recorded inline (their graph-safe launch reads metadata from the runner's static
    device buffers). The forward's inputs are whatever `fn` closes over: the runner's static buffers.
    """

    def __init__(self, backend: Optional[SegmentBackend] = None) -> None:
        self.backend: SegmentBackend = backend if backend is not None else CudaGraphBackend()
        self._recordings: dict[tuple[int, int], _Recording] = {}

    def record(self, key: tuple[int, int], fn: Callable[[], Any]) -> Any:
        """Record `fn()` for request bucket `key`; returns its output (non-owning aliases)."""
        key = (int(key[0]), int(key[1]))
        assert key not in self._recordings, f"request bucket {key} is already recorded"
        rec = _record(self.backend, False, fn, (), {})
        self._recordings[key] = rec
        return rec.output

    def replay(self, key: tuple[int, int]) -> Any:
        """Replay bucket `key`; the output is valid until the next replay of any recording."""
        rec = self._recordings.get((key[0], key[1]))
        if rec is None:
            raise KeyError(
                f"no request graph recorded for bucket {tuple(key)}; recorded: {self.keys()}"
            )
        return rec.replay()

    def keys(self) -> list[tuple[int, int]]:
        return sorted(self._recordings)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and len(key) == 2 and (key[0], key[1]) in self._recordings

    def __len__(self) -> int:
        return len(self._recordings)

# Launches of a Triton kernel past its Python dispatch, for launches repeated every step outside a
# CUDA graph (the eager regions of TR_HYBRID, eager mode):
#   LaunchMemo - the first launch of each specialization goes through `kernel[grid](...)`; the
#                compiled kernel it returns is kept under a key of what Triton specializes on
#                (dtypes, 16-byte alignment of every pointer, the scalars' values, the constexprs
#                and launch options), and later launches with that key call its launcher directly
#   launch       - `kernel[grid](...)`, for plain launches (attention, rotary and KV write, norms,
#                skinny GEMM, argmax), kept by a LaunchMemo per kernel where the call fits one
#   compile_ahead - a context in which those launches (and a LaunchMemo's first ones) compile their
#                kernel in a pool of threads and launch nothing: start-up plans every variant once
#                this way, so that Triton compiles them side by side, not one after the other, and
#                loads each onto the device there too (its module and launcher, which Triton
#                otherwise builds at the first launch, on the launching thread)
# Triton's dispatch binds and specializes every argument on every call (tens of microseconds for a
# kernel of fifty arguments); a kept launch reads each tensor's address and launches.
# Importing this module needs no GPU.

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

MAX_KEPT = (
    1024  # launches kept per kernel; past it the memo starts again (a key per bucket is usual)
)
# compile_ahead's loads onto the device: False queues each in the pool right after its compile (a
# thread that takes it waits there while that compile runs); True loads them all once every compile
# is done, so no thread of the pool waits on another's compile. A start-up plan only a GPU can time
# (benchmarks/startup_compiles.py --loads-after-compiles).
LOADS_AFTER_COMPILES = False


@dataclass
class _Ahead:
    """The state of one `compile_ahead`: its pool, and the launches asked for so far (each
    compiles once)."""

    pool: ThreadPoolExecutor
    asked: set = field(default_factory=set)
    loads: list = field(default_factory=list)  # futures of the loads onto the device
    after: list = field(default_factory=list)  # LOADS_AFTER_COMPILES: (compile future, device)


def triton_interpreted() -> bool:
    """Triton's interpreter runs the kernels (TRITON_INTERPRET=1: CPU tensors, numpy semantics)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(t: torch.Tensor) -> bool:
    """A Triton kernel can take `t`: a CUDA tensor, or any under Triton's interpreter."""
    return t.is_cuda or triton_interpreted()


_AHEAD: ContextVar[Optional[_Ahead]] = ContextVar("atomrt_compile_ahead", default=None)


@contextmanager
def compile_ahead(threads: Optional[int] = None) -> Iterator[bool]:
    """Within it, `launch` and LaunchMemo compile the kernel a launch needs on one of `threads`
    threads (default: up to 8, one per core) and launch nothing; leaving it waits for every
    compile (a failed one raises there). Yields whether it does so: not under the Triton
    interpreter, nor with a Triton that lacks `AsyncCompileMode` (launches then run as usual, and
    the caller skips its compile-only pass). Triton releases the GIL through parts of a compile
    (LLVM's code generation, ptxas), so the threads overlap those parts. Everything else in the
    forward still runs, on what the skipped launches left in their outputs (any bytes, NaN among
    them): code that indexes with a value computed from such an output must keep it in range
    whatever the bytes (the MoE routing's picks: workers/kernels/moe/routing.py)."""
    import triton

    mode = getattr(triton, "AsyncCompileMode", None)
    if mode is None or triton_interpreted():
        yield False
        return
    if threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, min(8, cores or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool:
        state = _Ahead(pool)
        with mode(pool):
            token = _AHEAD.set(state)
            try:
                yield True
            finally:
                _AHEAD.reset(token)
        for load in state.loads:  # the pool runs them in order after their compiles
            load.result()
        list(pool.map(lambda pending: _load(*pending), state.after))  # every compile is done


def _compile_only(kernel: Any, key: Hashable, grid: Any, args: tuple, kwargs: dict) -> None:
    """Under `compile_ahead`: submit the compile of `kernel` for these arguments once per key,
    then its load onto the arguments' device."""
    state = _AHEAD.get()
    if (kernel, key) in state.asked:
        return
    state.asked.add((kernel, key))
    pending = kernel.warmup(*args, grid=grid, **kwargs)
    future = getattr(pending, "future", None)  # Triton's FutureKernel while it compiles
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if future is not None and device is not None and device.type == "cuda":
        if LOADS_AFTER_COMPILES:
            state.after.append((future, device))
        else:  # queued after its compile, so a thread that takes it finds the compile started
            state.loads.append(state.pool.submit(_load, future, device))


def _load(compiled: Any, device: torch.device) -> None:
    """Load a compiled kernel onto `device` (Triton's `_init_handles`: the module and the launcher)
    on this thread, which the first launch would do on the launching one. A failure is left to
    that launch, which raises it as it would have (out of resources, say)."""
    try:
        kernel = compiled.result()
        init = getattr(kernel, "_init_handles", None)
        if init is not None:
            with torch.cuda.device(device):
                init()
    except Exception as e:  # noqa: BLE001 - the launch repeats it and raises there
        logger.debug("compile_ahead: loading a kernel failed here (%s); its launch will", e)


def _arg_key(args: tuple, kwargs: dict) -> tuple:
    """What Triton may specialize a launch on, or more: tensors by dtype and 16-byte alignment,
    everything else by value."""
    return tuple(
        (a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor) else a
        for a in (*args, *sorted(kwargs.items()))
    )


def launch(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, through the kernel's LaunchMemo where its call fits one
    (`_memo_split`); under `compile_ahead`, the kernel's compile only."""
    if _AHEAD.get() is not None:
        _compile_only(kernel, _arg_key(args, kwargs), grid, args, kwargs)
        return
    split = _memo_split(kernel, grid, args)
    if split is None:
        kernel[grid](*args, **kwargs)
        return
    memo = _MEMOS.get(kernel)
    if memo is None:
        memo = _MEMOS[kernel] = LaunchMemo(kernel)
    memo(
        (*grid, 1, 1)[:3],
        args[:split],
        args[split:],
        tuple(kwargs.items()),
    )


_MEMOS: dict[Any, LaunchMemo] = {}  # `launch`'s, by kernel
_FITS: dict[tuple[Any, int], bool] = {}  # (kernel, positional arguments): its signature fits


def _memo_split(kernel: Any, grid: Any, args: tuple) -> Optional[int]:
    """How many of `args` are tensors (the rest scalars) when this launch can go through a
    LaunchMemo, else None: a grid of one to three ints, every tensor before every scalar, no None
    (Triton specializes on it), and a kernel whose constexprs are exactly the parameters after the
    positional ones (passed by name or left at their defaults)."""
    if type(grid) is not tuple or not 1 <= len(grid) <= 3:
        return None
    split = 0
    for a in args:
        if not isinstance(a, torch.Tensor):
            break
        split += 1
    for a in args[split:]:
        if a is None or isinstance(a, torch.Tensor):
            return None
    if split == 0:
        return None
    fits = _FITS.get((kernel, len(args)))
    if fits is None:
        names = getattr(kernel, "arg_names", None)
        at = getattr(kernel, "constexprs", None)
        fits = (
            names is not None and at is not None and list(at) == list(range(len(args), len(names)))
        )
        _FITS[(kernel, len(args))] = fits
    return split if fits else None


@functools.cache
def _runtime_knobs() -> Any:
    from triton import knobs

    return knobs.runtime


def _launch_hooks() -> tuple[Any, Any]:
    """Triton's launch hooks (profilers set them), as its own dispatch passes them on; None for a
    hook chain with nothing in it (Triton's default), so that a launch builds no metadata for it."""
    runtime = _runtime_knobs()
    return _live(runtime.launch_enter_hook), _live(runtime.launch_exit_hook)


def _live(hook: Any) -> Any:
    calls = getattr(hook, "calls", None)  # a triton.knobs.HookChain
    return None if calls is not None and not calls else hook


def _raw_stream(device_index: int) -> int:
    """The current CUDA stream's handle, read as Triton's own dispatch reads it."""
    return torch._C._cuda_getCurrentRawStream(device_index)


Grid = tuple[int, int, int]
Tensors = tuple[torch.Tensor, ...]
Constexprs = tuple[tuple[str, Any], ...]  # (name, value): constexpr arguments and launch options


def _run(compiled: Any, grid: Grid, stream: int, args: tuple) -> None:
    """Launch a compiled kernel as Triton's own dispatch does, with its launch hooks."""
    enter_hook, exit_hook = _launch_hooks()
    metadata = None if enter_hook is None else compiled.launch_metadata(grid, stream, *args)
    compiled.run(
        grid[0],
        grid[1],
        grid[2],
        stream,
        compiled.function,
        compiled.packed_metadata,
        metadata,
        enter_hook,
        exit_hook,
        *args,
    )


class LaunchMemo:
    """Launches of one Triton kernel whose arguments are `tensors`, then `scalars`, then the
    constexprs, in the kernel's signature order. `constexprs` holds the constexpr arguments and
    the launch options (num_warps, num_stages, launch_pdl) as a tuple of (name, value) pairs.

    Under the Triton interpreter (or any launch that returns no compiled kernel) every call goes
    through the kernel's own dispatch. `hits` and `misses` count the two paths."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self._kept: dict[tuple, tuple[Any, tuple]] = {}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _key(tensors: tuple, addresses: list[int], scalars: tuple, constexprs: tuple) -> tuple:
        return (
            tensors[0].get_device(),
            tuple([t.dtype for t in tensors]),
            tuple([a & 15 for a in addresses]),
            scalars,
            constexprs,
        )

    def __call__(
        self, grid: Grid, tensors: Tensors, scalars: tuple, constexprs: Constexprs
    ) -> None:
        addresses = [t.data_ptr() for t in tensors]
        key = self._key(tensors, addresses, scalars, constexprs)
        kept = self._kept.get(key)
        if _AHEAD.get() is not None:
            if kept is None:
                _compile_only(self.kernel, key, grid, (*tensors, *scalars), dict(constexprs))
            return
        if kept is None:
            self._launch_first(key, grid, tensors, scalars, constexprs)
            return
        compiled, constexpr_values = kept
        _run(compiled, grid, _raw_stream(key[0]), (*addresses, *scalars, *constexpr_values))
        self.hits += 1

    def bound(
        self,
        grid: Grid,
        tensors: Tensors,
        scalars: tuple,
        constexprs: Constexprs,
        keep: Tensors = (),
    ) -> Optional[Callable[[int], None]]:
        """The launch `self(grid, tensors, scalars, constexprs)` made once already, as a callable
        of the stream that repeats it with every argument fixed, the tensors by address; None
        while no compiled kernel is kept for it (the interpreter). The caller repeats it only for
        tensors at those same addresses; `keep` are tensors of its own (workspaces) that the
        callable keeps alive."""
        addresses = [t.data_ptr() for t in tensors]
        kept = self._kept.get(self._key(tensors, addresses, scalars, constexprs))
        if kept is None:
            return None
        compiled, constexpr_values = kept
        args = (*addresses, *scalars, *constexpr_values)

        def launch(stream: int) -> None:
            _run(compiled, grid, stream, args)
            self.hits += 1

        launch.keep = keep  # type: ignore[attr-defined]  # alive while the launch is kept
        return launch

    def _launch_first(self, key: tuple, grid, tensors, scalars, constexprs) -> None:
        self.misses += 1
        compiled = self.kernel[grid](*tensors, *scalars, **dict(constexprs))
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return  # the interpreter: nothing to keep
        names = self.kernel.arg_names
        named = dict(constexprs)
        defaults = self.kernel.signature.parameters
        first_constexpr = len(tensors) + len(scalars)
        constexpr_at = getattr(
            self.kernel, "constexprs", None
        )  # their indices, where Triton has it
        if constexpr_at is not None and list(constexpr_at) != list(
            range(first_constexpr, len(names))
        ):
            raise RuntimeError(
                f"LaunchMemo: {self.kernel.__name__} takes {len(tensors)} tensors and "
                f"{len(scalars)} scalars, then constexprs only: its signature {names} does not"
            )
        constexpr_values = tuple(
            named[n] if n in named else defaults[n].default for n in names[first_constexpr:]
        )
        if len(self._kept) >= MAX_KEPT:
            self._kept.clear()
        self._kept[key] = (compiled, constexpr_values)

"""Compile every piece at start-up (levels 2-3): the general shape, then every size in
`compilation_config.compile_sizes`, largest first.

A size listed there is otherwise compiled the first time a step has exactly that many rows, which
stalls that step (and every rank in step with it) mid-serving. Done here, at start-up, a prewarm
job (`atomrt prewarm`) leaves a cache from which a later start of the same config loads every piece
and compiles nothing. The forwards are the KV sizing's dummy prefills (no KV cache); every rank runs
the same sizes in the same order, so tensor-parallel collectives match.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from atomrt.compile import compilation_counter
from atomrt.runtime.config import CompilationLevel
from atomrt.workers.runner.kv_sizing import dummy_forward

if TYPE_CHECKING:
    from atomrt.workers.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileReport:
    """What one rank compiled and loaded from the compile cache while it started (plain data)."""

    rank: int
    cache_dirs: tuple[str, ...]  # one per compiled module (rank_<i>/<prefix>); () below level 2
    read_only: bool  # the cache was only loaded from (compile/cache.py)
    compile_sizes: tuple[int, ...]  # compiled (or loaded) for their exact size at start-up
    skipped_sizes: tuple[
        int, ...
    ]  # above max_num_batched_tokens and every capture size: no step has them
    inductor_compiles: int
    cache_loads: int
    cache_misses: int
    compile_seconds: float
    trace_loads: int = 0  # models built from Dynamo's kept trace (compile/trace_cache.py)


def prefetch_triton_key(device: torch.device) -> Optional[threading.Thread]:
    """On CUDA, start computing Triton's key of its own installation (`triton_key`: a hash of its
    sources and of libtriton, a second or so of a slow host, once per process) on a daemon thread,
    while the model loads: Inductor's cache lookups (KV sizing) and the first kernel compile ask
    for it on the main thread otherwise. Hashing and file reads release the GIL. Returns the
    thread (None off CUDA, where the interpreter compiles nothing)."""
    if device.type != "cuda":
        return None
    from triton.runtime.cache import triton_key

    thread = threading.Thread(target=triton_key, name="triton-key", daemon=True)
    thread.start()
    return thread


def compile_all_sizes(runner: ModelRunner) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Run the forwards that compile (or load) every piece; returns (sizes run, sizes skipped)."""
    cc = runner.config.compilation_config
    if runner.config.enforce_eager or cc.level < CompilationLevel.DYNAMO_ONCE:
        return (), ()
    sizes = sorted({int(s) for s in cc.compile_sizes or []}, reverse=True)
    if cc.level != CompilationLevel.PIECEWISE:
        sizes = []  # level 2 compiles the general shape only
    fits = tuple(s for s in sizes if s <= runner.shape.max_num_tokens)
    skipped = tuple(s for s in sizes if s > runner.shape.max_num_tokens)
    start = time.perf_counter()
    with torch.inference_mode():
        if any(m.compile_backend.split_gm is None for m in compiled_modules(runner.model)):
            # The first compiled call is the general shape, and it needs >= 2 rows.
            dummy_forward(runner, max(2, fits[0] if fits else 2))
        for size in fits:  # a size's first sight after the general shape compiles it
            dummy_forward(runner, size)
    if fits:
        logger.info(
            "rank %d: compile sizes %s compiled or loaded in %.2f s",
            runner.rank,
            list(fits),
            time.perf_counter() - start,
        )
    if skipped:
        logger.warning(
            "rank %d: compilation_config.compile_sizes %s exceed every step's row count (%d): "
            "not compiled",
            runner.rank,
            list(skipped),
            runner.shape.max_num_tokens,
        )
    return fits, skipped


def compiled_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The `@support_torch_compile` modules of `model` that compile (level >= 2)."""
    return [
        m
        for m in model.modules()
        if getattr(m, "compile_backend", None) is not None and not m.do_not_compile
    ]


def compile_report(
    runner: ModelRunner, counts_at_start: dict, sizes: tuple[int, ...], skipped: tuple[int, ...]
) -> CompileReport:
    """This rank's compile work since `counts_at_start` (a `compilation_counter.snapshot()`)."""
    now = compilation_counter.snapshot()
    backends = [
        m.compile_backend
        for m in compiled_modules(runner.model)
        if m.compile_backend.cache_dir is not None
    ]
    return CompileReport(
        rank=runner.rank,
        cache_dirs=tuple(str(b.cache_dir) for b in backends),
        read_only=any(b.compiler_manager.read_only for b in backends),
        compile_sizes=sizes,
        skipped_sizes=skipped,
        inductor_compiles=now["num_inductor_compiles"] - counts_at_start["num_inductor_compiles"],
        cache_loads=now["num_cache_loads"] - counts_at_start["num_cache_loads"],
        cache_misses=now["num_cache_misses"] - counts_at_start["num_cache_misses"],
        compile_seconds=round(now["compile_seconds"] - counts_at_start["compile_seconds"], 3),
        trace_loads=now["num_trace_loads"] - counts_at_start["num_trace_loads"],
    )

"""Where a start-up's Triton compiles go: builds an engine in this process and times every
`triton.compile` (atomrt's kernels and Inductor's), with the thread it ran on and the milliseconds
since the process started, then each eager attention warm-up batch and the first requests.

    TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \\
        python benchmarks/startup_compiles.py --cache-dir $(mktemp -d) [--model M] [--mode FULL]
Prints `COMPILE <ms> <s> <thread> <hit|miss> <kernel> <constexprs>` per compile, `BATCH <ms>
(rows, keys) <s>` per warm-up batch (each pass of the ten, synchronized), the engine's phases, the
compile seconds summed per kernel, and one `STAGE` line per start-up stage that compiles or loads
Triton kernels (the eager warm-up's compile-ahead pass and its real pass, capture's compile-ahead
pass and its recordings, the rest): its wall seconds (an outer stage's includes its inner ones'),
its forwards (count, seconds), its Triton compiles (cache misses and hits: count, seconds on
whichever thread ran them, counted in the stage running when they end), the kernels it loaded onto
the device (Triton's `_init_handles`: count, seconds) and `twice`, the compiles of a specialization
this process had compiled already. Fresh cache directories make the start
cold; run it again with the same ones for a warm start. Needs a CUDA GPU.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402
from collections import defaultdict  # noqa: E402

import triton  # noqa: E402
import triton.compiler  # noqa: E402
import triton.compiler.compiler as triton_compiler  # noqa: E402
from triton import knobs  # noqa: E402

_compile = triton_compiler.compile
totals: dict[str, list] = {}
STAGE = ["before warm-up"]  # the start-up stage now running (set by the wrappers in main)
# per stage: wall, forwards, forward_s, misses, miss_s, hits, hit_s, loads, load_s, twice
stages: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
_seen: set[str] = set()  # the specializations (Triton's hashes) compiled or loaded so far
_hit = threading.local()  # what the compile listener said of the last compile on this thread
_lock = threading.Lock()


def _listen(*, cache_hit: bool, **_: object) -> None:
    _hit.value = cache_hit


if hasattr(getattr(knobs, "compilation", None), "listener"):
    knobs.compilation.listener = _listen


def _timed_compile(src, *args, **kwargs):
    _hit.value = None
    start = time.perf_counter()
    compiled = None
    try:
        compiled = _compile(src, *args, **kwargs)
        return compiled
    finally:
        took = time.perf_counter() - start
        name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")
        constants = getattr(src, "constants", {})
        detail = " ".join(f"{k}={v}" for k, v in sorted(constants.items(), key=str))[:160]
        thread = threading.current_thread().name[:14]
        hit = {True: "hit", False: "miss"}.get(_hit.value, "?")
        print(
            f"COMPILE {1000 * (start - T0):8.0f} {took:6.3f} {thread:14s} {hit:4s} {name} {detail}"
        )
        key = getattr(compiled, "hash", None)
        with _lock:
            entry = totals.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += took
            stage = stages[STAGE[0]]
            stage["hits" if _hit.value else "misses"] += 1
            stage["hit_s" if _hit.value else "miss_s"] += took
            if key is not None:
                stage["twice"] += key in _seen
                _seen.add(key)


_init_handles = triton_compiler.CompiledKernel._init_handles


def _timed_init_handles(self):
    """Triton's load of a compiled kernel onto the device (module and launcher), timed once."""
    if getattr(self, "module", None) is not None:
        return _init_handles(self)
    start = time.perf_counter()
    try:
        return _init_handles(self)
    finally:
        with _lock:
            stage = stages[STAGE[0]]
            stage["loads"] += 1
            stage["load_s"] += time.perf_counter() - start


# JITFunction binds `compile` at its first run; Inductor calls `triton.compile`
triton_compiler.compile = triton.compiler.compile = triton.compile = _timed_compile
triton_compiler.CompiledKernel._init_handles = _timed_init_handles


def _in_stage(name: str, fn, count_forward: bool = False):
    """`fn` run as start-up stage `name` (its wall time added there; a forward counted)."""

    def run(*args, **kwargs):
        outer, STAGE[0] = STAGE[0], name
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            stages[name]["forward_s" if count_forward else "wall"] += took
            stages[name]["forwards"] += count_forward
            STAGE[0] = outer

    return run


def print_stages() -> None:
    """One STAGE line per stage: wall s, forwards (n, s), misses and hits (n, s), loads (n, s)."""
    for name, st in stages.items():
        print(
            f"STAGE {name:24s} wall {st['wall']:6.2f} s  forwards {st['forwards']:3.0f} "
            f"{st['forward_s']:6.2f} s  misses {st['misses']:3.0f} {st['miss_s']:6.2f} s  "
            f"hits {st['hits']:3.0f} {st['hit_s']:6.2f} s  loads {st['loads']:3.0f} "
            f"{st['load_s']:6.2f} s  twice {st['twice']:3.0f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="SmolLM2-135M")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--mode", default=None, help="CUDA-graph mode (default: the level's)")
    ap.add_argument("--cache-dir", required=True, help="atomrt's compile cache directory")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f %(name)s: %(message)s")

    import torch

    import atomrt.workers.kernels.launch as launch
    import atomrt.workers.runner.kernel_warmup as kernel_warmup
    import atomrt.workers.worker as worker
    from atomrt.runtime.config import CompilationConfig, CUDAGraphMode
    from atomrt.runtime.entrypoints.llm import LLM
    from atomrt.runtime.sampling_params import SamplingParams
    from atomrt.workers.runner.graph_runner import GraphRunner

    run_batches = kernel_warmup.run_batches

    def timed_batches(runner, batches):
        name = "eager ahead" if launch._AHEAD.get() is not None else "eager"
        for batch in batches:
            start = time.perf_counter()
            _in_stage(name, run_batches, count_forward=True)(runner, [batch])
            torch.cuda.synchronize()
            took = time.perf_counter() - start
            print(f"BATCH {1000 * (start - T0):8.0f} {name:11s} {batch} {took:.3f}")

    kernel_warmup.run_batches = timed_batches
    worker.warm_eager_kernels = _in_stage("eager warm-up", kernel_warmup.warm_eager_kernels)
    GraphRunner._compile_ahead = _in_stage("capture ahead", GraphRunner._compile_ahead)
    GraphRunner.capture = _in_stage("capture", GraphRunner.capture)
    warm_up = GraphRunner._warm_up

    def counted_warm_up(self, runner, bucket):
        return _in_stage(STAGE[0], warm_up, count_forward=True)(self, runner, bucket)

    GraphRunner._warm_up = counted_warm_up
    print(f"IMPORTED {1000 * (time.perf_counter() - T0):.0f} ms")
    mode = {"cudagraph_mode": CUDAGraphMode[a.mode]} if a.mode else {}
    llm = LLM(
        model=a.model,
        load_format=a.load_format,
        compilation_config=CompilationConfig(level=a.level, cache_dir=a.cache_dir, **mode),
    )
    print(f"BUILT {1000 * (time.perf_counter() - T0):.0f} ms")
    STAGE[0] = "requests"
    for n in (32, 100, 700):
        start = time.perf_counter()
        llm.generate([[1] * n], SamplingParams(max_tokens=2), use_tqdm=False)
        print(f"REQUEST {n} tokens {time.perf_counter() - start:.3f} s")
    print("PHASES", [(name, round(s, 2)) for name, s in llm.engine.info.startup_phases])
    for name, (count, seconds) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"TOTAL {name:48s} {count:3d} compiles {seconds:7.2f} s")
    print_stages()
    llm.shutdown()


if __name__ == "__main__":
    main()

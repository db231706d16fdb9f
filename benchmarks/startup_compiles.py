"""Where a start-up's Triton compiles go: builds an engine in this process and times every
`triton.compile` (atomrt's kernels and Inductor's), with the thread it ran on and the milliseconds
since the process started, then each eager attention warm-up batch and the first requests.

    TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \\
        python benchmarks/startup_compiles.py --cache-dir $(mktemp -d) [--model M] [--mode FULL]
Prints `COMPILE <ms> <s> <thread> <kernel> <constexprs>` per compile, `BATCH <ms> (rows, keys) <s>`
per warm-up batch (each pass of the ten, synchronized), the engine's phases, and the compile
seconds summed per kernel. Fresh cache directories make the start cold; run it again with the
same ones for a warm start. Needs a CUDA GPU.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402

import triton  # noqa: E402
import triton.compiler  # noqa: E402
import triton.compiler.compiler as triton_compiler  # noqa: E402

_compile = triton_compiler.compile
totals: dict[str, list] = {}


def _timed_compile(src, *args, **kwargs):
    start = time.perf_counter()
    try:
        return _compile(src, *args, **kwargs)
    finally:
        took = time.perf_counter() - start
        name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")
        constants = getattr(src, "constants", {})
        detail = " ".join(f"{k}={v}" for k, v in sorted(constants.items(), key=str))[:160]
        thread = threading.current_thread().name[:14]
        print(f"COMPILE {1000 * (start - T0):8.0f} {took:6.3f} {thread:14s} {name} {detail}")
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += took


# JITFunction binds `compile` at its first run; Inductor calls `triton.compile`
triton_compiler.compile = triton.compiler.compile = triton.compile = _timed_compile


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

    import atomrt.workers.runner.kernel_warmup as kernel_warmup
    from atomrt.runtime.config import CompilationConfig, CUDAGraphMode
    from atomrt.runtime.entrypoints.llm import LLM
    from atomrt.runtime.sampling_params import SamplingParams

    run_batches = kernel_warmup.run_batches

    def timed_batches(runner, batches):
        for batch in batches:
            start = time.perf_counter()
            run_batches(runner, [batch])
            torch.cuda.synchronize()
            took = time.perf_counter() - start
            print(f"BATCH {1000 * (start - T0):8.0f} {batch} {took:.3f}")

    kernel_warmup.run_batches = timed_batches
    print(f"IMPORTED {1000 * (time.perf_counter() - T0):.0f} ms")
    mode = {"cudagraph_mode": CUDAGraphMode[a.mode]} if a.mode else {}
    llm = LLM(
        model=a.model,
        load_format=a.load_format,
        compilation_config=CompilationConfig(level=a.level, cache_dir=a.cache_dir, **mode),
    )
    print(f"BUILT {1000 * (time.perf_counter() - T0):.0f} ms")
    for n in (32, 100, 700):
        start = time.perf_counter()
        llm.generate([[1] * n], SamplingParams(max_tokens=2), use_tqdm=False)
        print(f"REQUEST {n} tokens {time.perf_counter() - start:.3f} s")
    print("PHASES", [(name, round(s, 2)) for name, s in llm.engine.info.startup_phases])
    for name, (count, seconds) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"TOTAL {name:48s} {count:3d} compiles {seconds:7.2f} s")
    llm.shutdown()


if __name__ == "__main__":
    main()

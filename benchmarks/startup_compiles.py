"""Where a start-up's Triton compiles go: builds an engine in this process and times every
`triton.compile` (atomrt's kernels and Inductor's), with the thread it ran on and the milliseconds
since the process started, then each eager attention warm-up batch and the first requests.

    TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \\
        python benchmarks/startup_compiles.py --cache-dir $(mktemp -d) [--model M] [--mode FULL]
        [--loads-after-compiles]
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

    python benchmarks/startup_compiles.py --offline [--threads 8]
needs none: it compiles, for sm_90 (Triton's compiler and ptxas, no GPU), the attention variants
the eager warm-up compiles for SmolLM2-135M's shape, each in a fresh process: on an empty Triton
cache one after another (`OFFLINE cold`), then on the same cache (`OFFLINE warm`: Triton's cache-hit
path, the first hit with the process's one-time keys), then on another empty cache in a pool of
threads (`OFFLINE pool`, as `compile_ahead` does). One line per compile, one per run.
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
            kind = {True: "hit", False: "miss"}.get(_hit.value, "unsaid")  # no listener: unsaid
            stage[{"hit": "hits", "miss": "misses", "unsaid": "unsaids"}[kind]] += 1
            stage[kind + "_s"] += took
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
            + (
                f"  hit or miss unsaid {st['unsaids']:3.0f} {st['unsaid_s']:6.2f} s"
                if st["unsaids"]
                else ""
            )
        )


# SmolLM2-135M's attention: KV heads, query heads per KV head, head dim; an H100's SMs; the
# engine's default rows per step and max_model_len
OFFLINE_SHAPE = dict(num_kv_heads=3, group=3, head_dim=64, num_sms=132, rows=8192, max_len=8192)
_POINTERS = (
    dict.fromkeys(
        ("partial_ptr", "m_ptr", "l_ptr", "cos_ptr", "sin_ptr", "kv_scales_ptr", "acc_ptr"), "*fp32"
    )
    | dict.fromkeys(
        ("counter_ptr", "cu_seqlens_q_ptr", "context_lens_ptr", "block_tables_ptr"), "*i32"
    )
    | dict.fromkeys(("positions_ptr", "slot_mapping_ptr"), "*i64")
)


def _source(fn, constexprs: dict):
    """An ASTSource of `fn` as a launch specializes it: pointers, strides and head_dim
    16-divisible; other pointers bf16; `scale_log2` fp32, other scalars i32."""
    from triton.compiler import ASTSource

    sig = {
        p.name: "constexpr"
        if p.is_constexpr
        else _POINTERS.get(p.name, "*bf16")
        if p.name.endswith("_ptr")
        else "fp32"
        if p.name == "scale_log2"
        else "i32"
        for p in fn.params
    }
    div = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if sig[name].startswith("*") or name.startswith("stride_") or name == "head_dim"
    }
    return ASTSource(fn, sig, constexprs, div)


def offline_sources() -> list[tuple[str, object, dict]]:
    """(name, ASTSource, options) of every attention variant the eager warm-up batches compile
    for OFFLINE_SHAPE (variants.py's batches, planned as the launches plan them)."""
    from atomrt.workers.kernels.attention import decode_attention as dec
    from atomrt.workers.kernels.attention import paged_attention as paged
    from atomrt.workers.kernels.attention.attention_kernels import (
        paged_attention_kernel,
        reduce_splits_kernel,
    )
    from atomrt.workers.kernels.attention.decode_kernels import decode_attention_kernel
    from atomrt.workers.kernels.attention.variants import warmup_lengths

    s = OFFLINE_SHAPE
    kv, group, head_dim, sms = s["num_kv_heads"], s["group"], s["head_dim"], s["num_sms"]
    out = {}
    for rows, keys in warmup_lengths(kv, group, head_dim, sms, s["rows"], s["max_len"]):
        if rows == 1:
            plan = dec.plan_decode(1, keys, kv, group, head_dim, sms)
            cx = dict(dec._decode_constexprs(plan, group, head_dim, 16, True, False, False, False))
            cx.pop("launch_pdl")
            opts = {"num_warps": cx.pop("num_warps"), "num_stages": cx.pop("num_stages")}
            name = f"decode tile_n={plan.tile_n} split={plan.num_splits > 1}"
            out[name] = (decode_attention_kernel, cx, opts)
            continue
        plan = paged.plan_attention(1, rows, keys, kv, group, head_dim, sms)
        cx = dict(
            GROUP=plan.group, GROUP_P=plan.group_p, BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m,
            HEAD_DIM_P=plan.head_dim_p, TILE_N=plan.tile_n, BLOCK_SIZE=16,
            SPLIT=plan.num_splits > 1, IEEE_DOT=False,
        )  # fmt: skip
        opts = {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
        name = f"paged block_m={plan.block_m} split={plan.num_splits > 1}"
        out[name] = (paged_attention_kernel, cx, opts)
        if plan.num_splits > 1:
            reduce = dict(
                SPLITS_P=triton.next_power_of_2(paged.MAX_SPLITS), HEAD_DIM_P=plan.head_dim_p
            )
            out["reduce"] = (reduce_splits_kernel, reduce, {"num_warps": 4})
    return [(name, _source(fn, cx), opts) for name, (fn, cx, opts) in out.items()]


def offline_child(run: str, threads: int) -> None:
    """One offline run in this process: every source compiled in turn, or on `threads` threads."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    sources = offline_sources()

    def one(item) -> float:
        name, src, opts = item
        start = time.perf_counter()
        triton.compile(src, target=target, options=opts)
        took = time.perf_counter() - start
        hit = {True: "hit", False: "miss"}.get(getattr(_hit, "value", None), "?")
        print(f"OFFLINE {run:5s} {took:7.3f} s  {hit:4s} {name}", flush=True)
        return took

    start = time.perf_counter()
    if run == "pool":
        with ThreadPoolExecutor(threads) as pool:
            spent = sum(pool.map(one, sources))
    else:
        spent = sum(one(item) for item in sources)
    wall = time.perf_counter() - start
    print(
        f"OFFLINE {run:5s} {len(sources)} compiles: wall {wall:.3f} s, summed {spent:.3f} s "
        f"({1000 * wall / len(sources):.1f} ms per compile)",
        flush=True,
    )


def offline(threads: int) -> None:
    """The three offline runs, each a fresh process, on fresh Triton caches."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="atomrt-offline-") as tmp:
        for run, cache in (("cold", "a"), ("warm", "a"), ("pool", "b")):
            env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, cache))
            env.pop("TRITON_INTERPRET", None)
            cmd = [sys.executable, __file__, "--offline-run", run, "--threads", str(threads)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            print("\n".join(ln for ln in proc.stdout.splitlines() if ln.startswith("OFFLINE")))
            if proc.returncode:
                raise SystemExit(f"offline {run} failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="SmolLM2-135M")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--mode", default=None, help="CUDA-graph mode (default: the level's)")
    ap.add_argument("--cache-dir", help="atomrt's compile cache directory (required but offline)")
    ap.add_argument("--offline", action="store_true", help="compile for sm_90 here, no GPU")
    ap.add_argument(
        "--loads-after-compiles",
        action="store_true",
        help="compile_ahead loads its kernels once every compile is done (launch.py's option)",
    )
    ap.add_argument("--threads", type=int, default=8, help="offline: the pool's threads")
    ap.add_argument("--offline-run", choices=("cold", "warm", "pool"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.offline_run:
        offline_child(a.offline_run, a.threads)
        return
    if a.offline:
        offline(a.threads)
        return
    if not a.cache_dir:
        ap.error("--cache-dir is required (but with --offline)")
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f %(name)s: %(message)s")

    import torch

    import atomrt.workers.kernels.launch as launch
    import atomrt.workers.runner.kernel_warmup as kernel_warmup
    import atomrt.workers.worker as worker
    from atomrt.runtime.config import CompilationConfig, CUDAGraphMode
    from atomrt.runtime.entrypoints.llm import LLM
    from atomrt.runtime.sampling_params import SamplingParams
    from atomrt.workers.runner.graph_runner import GraphRunner

    launch.LOADS_AFTER_COMPILES = a.loads_after_compiles
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

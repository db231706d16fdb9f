"""Every environment variable atomrt reads, declared once, typed, and read once at start-up.

Code reads `ENV.<name>` from the snapshot `read_env()` returns; nothing else calls os.environ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# What a driver hands on to its Ray actors when it is set (an mp child inherits the environment
# anyway; a Ray actor gets the job's, not the driver's). ATOMRT_HOST_IP names one node: it stays.
FORWARDED_TO_WORKERS = (
    "ATOMRT_CACHE_ROOT",
    "ATOMRT_LOG_LEVEL",
    "ATOMRT_PDL",
    "ATOMRT_ALLOW_LONG_MAX_MODEL_LEN",
    "ATOMRT_COMPILE_CACHE_READ_ONLY",
    "ATOMRT_TRACE_CACHE",
    "ATOMRT_FP8_NORM_PROLOGUE",
)
# What a bench record's command line names when it is set: the variables that change what a run
# measures (runtime/bench/records.py).
RECORDED_BY_BENCHES = (
    "ATOMRT_PDL",
    "ATOMRT_TRACE_CACHE",
    "ATOMRT_COMPILE_CACHE_READ_ONLY",
    "ATOMRT_FP8_NORM_PROLOGUE",
    "ATOMRT_SERVE_UVLOOP",
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
)


@dataclass(frozen=True)
class Env:
    cache_root: Path  # ATOMRT_CACHE_ROOT: root of compile caches (default ~/.cache/atomrt)
    log_level: str  # ATOMRT_LOG_LEVEL: logging level for the "atomrt" loggers (default INFO)
    ray_address: str  # RAY_ADDRESS: an existing Ray cluster to join ("" = start a local one)
    host_ip: str  # ATOMRT_HOST_IP: this node's address for tcp:// transport ("" = detect)
    pdl: bool  # ATOMRT_PDL: programmatic dependent launch for the decode kernels on sm90+ (default 0)
    # ATOMRT_ALLOW_LONG_MAX_MODEL_LEN: accept model_config.max_model_len above the model's context
    # (with a warning; positions past it were never trained). Default 0: an error.
    allow_long_max_model_len: bool
    api_key: str  # ATOMRT_API_KEY: the key `atomrt serve` requires (as --api-key); "" = none
    # ATOMRT_COMPILE_CACHE_READ_ONLY: load compiled pieces from the cache, never write to it (serving
    # pods on a cache a prewarm job filled). A cache directory that is not writable is read-only
    # anyway. Default 0.
    compile_cache_read_only: bool
    # ATOMRT_TRACE_CACHE: keep Dynamo's trace of a model beside the compile cache and build the
    # model from it in later processes instead of tracing again (compile/trace_cache.py). Default 1.
    trace_cache: bool = True
    # The variables of FORWARDED_TO_WORKERS set in this process, as (name, value) pairs.
    forwarded: tuple[tuple[str, str], ...] = ()
    # ATOMRT_BENCH_COMMIT: the commit a bench record names when the measured tree has no git (a
    # copy of a checkout); "" = ask git.
    bench_commit: str = ""
    # The variables of RECORDED_BY_BENCHES set in this process, as (name, value) pairs.
    recorded_by_benches: tuple[tuple[str, str], ...] = ()
    # ATOMRT_FP8_NORM_PROLOGUE: an FP8 projection after a residual add and RMSNorm (qkv, gate_up)
    # takes them into its decode GEMM's launch (w8a8_skinny_add_norm) instead of a kernel before
    # it. Default 1: Llama-3.1-8B FP8 decode at bs 1 on an H100, 4.232 against 4.495 ms a step.
    fp8_norm_prologue: bool = True
    # ATOMRT_SERVE_UVLOOP: `atomrt serve`'s event loop is uvloop's (installed with
    # uvicorn[standard]) instead of asyncio's. Default 0 until measured faster on a GPU host.
    serve_uvloop: bool = False


def read_env() -> Env:
    return Env(
        cache_root=Path(
            os.environ.get("ATOMRT_CACHE_ROOT", "") or Path.home() / ".cache" / "atomrt"
        ),
        log_level=os.environ.get("ATOMRT_LOG_LEVEL", "INFO").upper(),
        ray_address=os.environ.get("RAY_ADDRESS", ""),
        host_ip=os.environ.get("ATOMRT_HOST_IP", ""),
        pdl=os.environ.get("ATOMRT_PDL", "0") == "1",
        allow_long_max_model_len=os.environ.get("ATOMRT_ALLOW_LONG_MAX_MODEL_LEN", "0") == "1",
        api_key=os.environ.get("ATOMRT_API_KEY", ""),
        compile_cache_read_only=os.environ.get("ATOMRT_COMPILE_CACHE_READ_ONLY", "0") == "1",
        trace_cache=os.environ.get("ATOMRT_TRACE_CACHE", "1") == "1",
        forwarded=tuple((k, os.environ[k]) for k in FORWARDED_TO_WORKERS if k in os.environ),
        bench_commit=os.environ.get("ATOMRT_BENCH_COMMIT", "").strip(),
        recorded_by_benches=tuple(
            (k, os.environ[k]) for k in RECORDED_BY_BENCHES if k in os.environ
        ),
        fp8_norm_prologue=os.environ.get("ATOMRT_FP8_NORM_PROLOGUE", "1") == "1",
        serve_uvloop=os.environ.get("ATOMRT_SERVE_UVLOOP", "0") == "1",
    )


ENV = read_env()

"""benchmarks/kernel_stats.py compiles the decode attention kernel for sm_90 on this CPU-only
machine (Triton's compiler and its wheel's ptxas) and reads registers and occupancy from the
cubin: the e4m3 cache's default plan (64-key tiles, V widened first) keeps two programs per SM or
more, as the bfloat16 cache's does; with V widened first, 128-key e4m3 tiles at 8 warps keep two
as well (widened after its layout change, V took ~140 registers a thread there: one program)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(*flags: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernel_stats.py"), "decode", "--quick", *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_default_plans_keep_two_programs_per_sm() -> None:
    rows = {dtype: _rows("--kv-cache-dtype", dtype) for dtype in ("auto", "fp8")}
    for dtype, found in rows.items():
        (default,) = [r for r in found if r["default"]]
        assert default["programs_per_sm"] >= 2, (dtype, default)
        assert default["stack"] == 0 and default["loop_spill_loads"] == 0, (dtype, default)
        assert 0 < default["loop_instructions_per_key"] < 20
    (t128,) = [r for r in rows["fp8"] if r["tile_n"] == 128]  # in the bfloat16 cache's tiles
    assert t128["widen_v_first"] and t128["programs_per_sm"] >= 2, t128

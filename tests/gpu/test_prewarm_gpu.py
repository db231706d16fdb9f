"""GPU tier: `atomrt prewarm` at level 3 with request graphs fills the compile cache (the general
shape, a compile size beyond the capture ladder, and the graphs' buckets recorded), and a second,
read-only start of the same config loads every piece and compiles nothing. Dummy weights of
SmolLM2-135M's shape.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_prewarm_gpu.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

FLAGS = [
    "--model",
    "SmolLM2-135M",
    "--load-format",
    "dummy",
    "--device",
    "cuda",
    "--level",
    "3",
    "--cudagraph-mode",
    "FULL",
    "--max-num-seqs",
    "16",
    "--set",
    "compilation_config.cuda_graph_sizes=[16]",  # capture [1..8, 16]
    "--set",
    "compilation_config.compile_sizes=[512]",  # beyond the ladder: compiled at start-up
]
# 30 attention calls split the backbone into 31 pieces: the first, 29 of one code, the last
DISTINCT = 3


def _prewarm(cache: Path, read_only: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, ATOMRT_COMPILE_CACHE_READ_ONLY="1" if read_only else "0")
    cmd = [sys.executable, "-m", "atomrt.runtime.entrypoints.cli", "prewarm", *FLAGS]
    cmd += ["--set", f"compilation_config.cache_dir={cache}"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)


def test_prewarm_then_a_read_only_start_compiles_nothing(tmp_path: Path):
    cache = tmp_path / "cache"
    cold = _prewarm(cache, read_only=False)
    assert cold.returncode == 0, cold.stderr[-4000:]
    (record_path,) = cache.glob("*/prewarm.json")
    record = json.loads(record_path.read_text())
    assert record["compile_sizes"] == [512] and record["capture_sizes"] == [*range(1, 9), 16]
    assert [bs for bs, _ in record["captured"]["request_graph_keys"]] == [*range(1, 9), 16]
    assert record["inductor_compiles"] == 2 * DISTINCT and record["cache_loads"] == 0
    warm = _prewarm(cache, read_only=True)
    assert warm.returncode == 0, warm.stdout[-2000:] + warm.stderr[-4000:]
    assert f"0 Inductor compiles and {2 * DISTINCT} cache loads" in warm.stdout
    assert "holds every piece" in warm.stdout

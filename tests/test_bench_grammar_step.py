"""benchmarks/bench_grammar_step.py: it runs on CPU against the engine as it is, and its
constrained rows really are constrained (their masks are filled each step, and the time from the
masks to the next plan is measured), with its options too."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "flags",
    [[], ["--per-row-accept", "--fill-on-thread", "off", "--parallel-fill-rows", "2"]],
    ids=["default", "options"],
)
def test_grammar_step_bench_fills_masks_only_for_constrained_rows(flags):
    argv = ["--bs", "4", "--grammar-rows", "0,4", "--steps", "3", *flags]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_grammar_step.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    pattern = (
        r"bs=4 grammar rows=(\d+) async: driver (\d+) us/step, of which mask fill (\d+); "
        r"masks to next plan (\d+) us;"
    )
    found = {int(m[1]): (int(m[3]), int(m[4])) for m in re.finditer(pattern, proc.stdout)}
    assert set(found) == {0, 4}, proc.stdout
    assert found[0] == (0, 0), proc.stdout  # no masks: nothing filled, no gap measured
    assert found[4][0] > 0 and found[4][1] > 0, proc.stdout

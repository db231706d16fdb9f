"""`atomrt bench startup --toy`: two child processes, cold then warm (slow: two compiles' worth)."""

from __future__ import annotations

import json

import pytest
from records_harness import check_records

from atomrt.runtime.bench.startup import main
from atomrt.runtime.bench.targets import env_variant


@pytest.mark.slow
def test_bench_startup_toy(tmp_path, capsys):
    out = tmp_path / "startup.json"
    assert main(["--toy", "--out", str(out), "--record", str(tmp_path / "records")]) == 0
    *_, line, saved = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("startup toy level 3: compile cold") and "warm/cold" in line
    assert saved.startswith("record: ")
    result = json.loads(out.read_text())
    # 2 pieces of one code (a linear, relu and residual each): one compile per shape (general,
    # size 4), shared by both
    assert result["cold_inductor_compiles"] == 2
    assert result["warm_inductor_compiles"] == 0 and result["warm_cache_loads"] == 2
    assert result["warm_trace_loads"] == 1  # the warm child ran no Dynamo
    assert result["warm_compile_s"] < result["cold_compile_s"]
    assert result["ratio"] == pytest.approx(
        result["warm_compile_s"] / result["cold_compile_s"], abs=0.01
    )
    # the record: the compile ratio against its target, and each child's seconds
    (record,) = check_records(tmp_path / "records", "startup")
    ratio, cold, warm = record.figures
    assert (ratio.target, ratio.case, ratio.value) == (
        "startup-compile",
        ", ".join(["toy, level 3", *env_variant()]),
        result["ratio"],
    )
    assert ratio.threshold.value == 0.25 and ratio.met == (result["ratio"] <= 0.25)
    assert ratio.extra["cold"].value == result["cold_compile_s"]
    assert [(f.target, f.value) for f in (cold, warm)] == [
        ("startup-time", result["cold_startup_s"]),
        ("startup-time", result["warm_startup_s"]),
    ]
    assert record.machine.gpu_count == 0  # the toy compiles on the CPU


def test_uncached_modules_are_counted(tmp_path, monkeypatch):
    """A module imported from a folder Python may not write bytecode to is counted; one whose
    bytecode landed is not."""
    import importlib
    import sys

    from atomrt.runtime.bench.startup import bytecode_notes, uncached_modules

    (tmp_path / "startup_probe_cached.py").write_text("X = 1\n")
    (tmp_path / "startup_probe_uncached.py").write_text("Y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    before = uncached_modules()
    importlib.import_module("startup_probe_cached")
    assert uncached_modules() == before
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    importlib.import_module("startup_probe_uncached")
    assert uncached_modules() == before + 1
    assert "compiled 3 modules from source" in bytecode_notes(3)[-1]
    assert "PYTHONDONTWRITEBYTECODE is set" in bytecode_notes(3, dont_write=True)[-1]
    assert "PYTHONPYCACHEPREFIX gives one" in bytecode_notes(3, dont_write=False)[-1]
    assert bytecode_notes(0) == (
        [f"bytecode cached under {sys.pycache_prefix}"] if sys.pycache_prefix else []
    )

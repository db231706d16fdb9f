"""`atomrt bench startup --toy`: two child processes, cold then warm (slow: two compiles' worth)."""

from __future__ import annotations

import json

import pytest

from atomrt.runtime.bench.startup import main


@pytest.mark.slow
def test_bench_startup_toy(tmp_path, capsys):
    out = tmp_path / "startup.json"
    assert main(["--toy", "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("startup toy level 3: compile cold") and "warm/cold" in line
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

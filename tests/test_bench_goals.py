"""The performance goals are data (benchmarks/goals.json): the file validates against its declared
JSON Schema (through jsonschema), every goal judges a target some bench records, and the lookup
matches a row's axes as the benches ask."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from atomrt.runtime.bench import goals
from atomrt.runtime.bench.records import Threshold

ROOT = Path(__file__).parent.parent
SCHEMA = json.loads((ROOT / "benchmarks" / "goals.schema.json").read_text())


def test_the_goals_file_follows_its_schema() -> None:
    doc = json.loads(goals.GOALS_FILE.read_text())
    jsonschema.validate(doc, SCHEMA)
    for bad in (
        {"target": "decode-step", "op": "<", "value": 1.0, "of": "value"},
        {"target": "decode-step", "op": "<=", "value": 1.0, "of": "value", "modle": "x"},
        {"target": "decode-step", "op": "<=", "value": -1.0, "of": "ratio"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"goals": [bad]}, SCHEMA)


def test_every_goal_judges_a_target_a_bench_records() -> None:
    """A goal's target is a figure's target named in the bench code (`figure("...")` or a goals
    lookup), so a renamed figure cannot leave its goal judging nothing."""
    sources = [*ROOT.glob("runtime/bench/*.py"), *ROOT.glob("benchmarks/*.py")]
    text = "\n".join(p.read_text() for p in sources)
    recorded = set(re.findall(r'figure\(\s*"([a-z0-9-]+)"', text))
    recorded |= set(re.findall(r'goals\.(?:threshold|of_target)\(\s*"([a-z0-9-]+)"', text))
    assert {g.target for g in goals.load_goals()} <= recorded


def test_a_goal_holds_for_the_rows_its_axes_name() -> None:
    assert goals.threshold("decode-step", model="SmolLM2-135M", batch_size=1) == Threshold(
        "<=", 0.5
    )
    assert goals.threshold("decode-step", model="Llama-3.1-8B", batch_size=1) == Threshold(
        "<=", 1.1, "ratio"
    )
    assert goals.threshold("decode-step", model="SmolLM2-135M", batch_size=2) is None
    assert goals.threshold("ray-vs-inproc") == Threshold("<=", 1.05, "ratio")  # every row
    # a min_ / max_ axis bounds the row's axis of that name
    assert goals.threshold("mla-decode", batch_size=8) == Threshold(">=", 0.7, "ratio")
    assert goals.threshold("mla-decode", batch_size=4) is None
    assert goals.threshold("fused-moe", tokens=64) is not None
    assert goals.threshold("fused-moe", tokens=65) is None
    assert [g.threshold.value for g in goals.of_target("startup-time")] == [30.0, 10.0]


def test_no_goals_file_means_no_goals(tmp_path: Path) -> None:
    assert goals.load_goals(tmp_path / "goals.json") == ()

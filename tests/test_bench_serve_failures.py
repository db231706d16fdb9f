"""`atomrt bench serve` with structured outputs on a preset's dummy weights given a real tokenizer
(`--tokenizer embedded`), and a run whose requests all fail: reported as failed, with the other
runs' figures still recorded (no crash on its NaN percentiles)."""

from __future__ import annotations

import json
import math

import pytest

from atomrt.runtime.bench.records import Figure, Quantity, load_records, save
from atomrt.runtime.bench.serve import main as bench_serve

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
# refused by the server (uniqueItems is not enforced): every request constrained to it fails
REFUSED = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
PRESET = [
    "--model",
    "tiny-qwen3-moe",
    "--load-format",
    "dummy",
    "--hf-overrides",
    '{"vocab_size": 49152}',
    "--device",
    "cpu",
    "--enforce-eager",
    "--set",
    "cache_config.num_kv_blocks=128",
]
RUN = ["--no-progress", "--num-prompts", "4", "--input-len", "4", "--output-len", "12"]


def test_a_figure_that_is_not_finite_is_left_out_with_a_note(tmp_path) -> None:
    figures = [
        Figure("serving", "a", 10.0, "tokens/s", extra={"TPOT p50": Quantity(math.nan, "ms")}),
        Figure("serving", "b", math.nan, "tokens/s"),
    ]
    assert save(tmp_path, "serve", [], figures, on_gpu=False) is not None
    ((_, record),) = load_records(tmp_path)
    assert [f.case for f in record.figures] == ["a"] and record.figures[0].extra == {}
    assert any("TPOT p50 not measured" in n for n in record.notes)
    assert any("serving / b: not measured" in n for n in record.notes)


def test_bench_serve_structured_on_a_preset_with_the_embedded_tokenizer(tmp_path, capsys) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    report = tmp_path / "report.json"
    args = [*RUN, "--concurrency", "2", "--structured-output-ratio", "0,1"]
    args += ["--json-schema", str(schema), "--json", str(report), "--tokenizer", "embedded"]
    assert bench_serve([*args, *PRESET]) == 0
    out = capsys.readouterr().out
    assert "/tokenize answered" not in out
    runs = json.loads(report.read_text())["runs"]
    assert [r["failed"] for r in runs] == [0, 0]
    assert runs[1]["structured"]["num_structured"] == runs[1]["structured"]["num_valid"] == 4


@pytest.fixture
def tiny_server(tiny_bpe_server):
    """The session's server on the tiny BPE Llama (conftest.py)."""
    return tiny_bpe_server


def test_a_run_of_failed_requests_is_reported_and_the_others_recorded(
    tiny_server, tmp_path, capsys
) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(REFUSED))
    records = tmp_path / "records"
    args = ["--url", tiny_server.url, *RUN, "--concurrency", "2", "--json-schema", str(schema)]
    args += ["--structured-output-ratio", "0,0.5,1", "--record", str(records)]
    assert bench_serve(args) == 1  # failed requests: not a clean run
    out = capsys.readouterr().out
    assert "structured x1: FAILED, every request failed" in out
    ((_, record),) = load_records(records)
    assert [f.case.split(" x")[-1].split(",")[0] for f in record.figures] == ["0.5"]
    assert any("x1: every one of its 4 requests failed" in n for n in record.notes)

"""benchmarks/bench_grammar_apply.py's record: its rows become `grammar-mask-apply` figures that
the records' loader reads back; a row whose kernel and torch results differ is a note, not a
figure. (The measurement itself needs CUDA: tests/gpu.)"""

import importlib.util
import sys
from pathlib import Path

from atomrt.runtime.bench.records import load_records, save

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_grammar_apply.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_grammar_apply", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ROWS = [
    dict(rows=16, vocab=128256, kernel_us=3.2, torch_us=41.0, clone_us=5.0, same=True),
    dict(rows=64, vocab=128256, kernel_us=7.9, torch_us=150.5, clone_us=17.0, same=True),
    dict(rows=8, vocab=128256, kernel_us=2.0, torch_us=20.0, clone_us=3.0, same=False),
]


def test_rows_become_figures_and_a_mismatch_a_note(tmp_path) -> None:
    bench = _bench()
    figures = bench.figures(ROWS)
    assert [f.case for f in figures] == ["16 rows × 128256", "64 rows × 128256"]
    first = figures[0]
    assert (first.target, first.unit, first.value, first.anchor) == (
        "grammar-mask-apply",
        "µs",
        3.2,
        41.0,
    )
    assert first.ratio == round(3.2 / 41.0, 4)
    assert first.extra["logits clone"].value == 5.0
    notes = bench.mismatches(ROWS)
    assert len(notes) == 1 and notes[0].startswith("8 rows × 128256: the kernel and the torch")
    path = save(tmp_path, "bench_grammar_apply", ["--record"], figures, on_gpu=False, notes=notes)
    [(_, record)] = load_records(tmp_path)
    assert path is not None and record.bench == "bench_grammar_apply"
    assert [f.case for f in record.figures] == [f.case for f in figures]
    assert record.notes == notes


def test_upload_refuses_record(tmp_path, monkeypatch, capsys) -> None:
    """--upload prints the host's hold per upload and keeps no figure: with --record it is refused
    by name before anything runs."""
    bench = _bench()
    monkeypatch.setattr(
        sys, "argv", ["bench_grammar_apply.py", "--upload", "--record", str(tmp_path)]
    )
    try:
        bench.main()
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--upload --record ran")
    assert (
        "--upload prints the host's hold per upload: it takes no --record"
        in capsys.readouterr().err
    )
    assert list(tmp_path.iterdir()) == []

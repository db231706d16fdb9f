"""`atomrt bench report`: docs/perf.md is what the committed records render (CI fails on drift),
every committed record validates, and the renderer keeps the newest figure of each (target, case,
machine kind); `--history` and `--plot` show a target over time."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from records_harness import SCHEMA

from atomrt.runtime.bench.records import (
    RESULTS,
    Machine,
    Record,
    Threshold,
    figure,
    load_records,
    write_record,
)
from atomrt.runtime.bench.report import TEMPLATE, main, render
from atomrt.runtime.entrypoints.cli import build_parser

ROOT = Path(__file__).parent.parent
PAGE = ROOT / "docs" / "perf.md"
H200 = Machine("H200", "NVIDIA H200", 1, None, 16, "2.11", "3.6", "13.0", "3.12")
CPU = Machine("2-core CPU", None, 0, None, 2, "2.13.0", "3.9.0", None, "3.11")


def test_docs_perf_md_is_what_the_records_render() -> None:
    rendered = render(ROOT / RESULTS, ROOT / RESULTS / TEMPLATE, PAGE)
    assert rendered == PAGE.read_text(), (
        "docs/perf.md differs from what benchmarks/results/ renders: run `atomrt bench report` "
        "(and edit benchmarks/results/perf-template.md, not docs/perf.md)"
    )
    assert rendered.count("\n") <= 210, (
        "docs/perf.md is past 210 lines: remove the records of rows no longer worth one (git "
        "keeps them) or shorten the template's notes"
    )


def test_every_committed_record_validates() -> None:
    paths = sorted((ROOT / RESULTS).glob("*.json"))
    for path in paths:
        jsonschema.validate(json.loads(path.read_text()), SCHEMA)
    assert len(load_records(ROOT / RESULTS)) == len(paths) > 0


def _save(folder: Path, date: str, machine: Machine, command: str, *figures) -> Path:
    return write_record(
        folder, Record("latency", command, date, "abcdef0123", False, machine, list(figures))
    )


@pytest.fixture
def results(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    target = Threshold("<=", 0.5)
    _save(
        folder,
        "2026-12-01",
        H200,
        "old run",
        figure(
            "decode-step",
            "m bs=1",
            0.7,
            "ms",
            anchor=0.07,
            anchor_name="true floor",
            threshold=target,
        ),
        figure("decode-step", "m bs=32", 1.2, "ms", anchor=0.09, anchor_name="true floor"),
    )
    _save(
        folder,
        "2026-12-02T08:00:00Z",
        H200,
        "new run | piped",
        figure(
            "decode-step",
            "m bs=1",
            0.45,
            "ms",
            anchor=0.07,
            anchor_name="true floor",
            threshold=target,
        ),
    )
    _save(folder, "2026-12-01", CPU, "cpu run", figure("decode-step", "m bs=1", 9.0, "ms"))
    _save(folder, "2026-12-01", CPU, "other", figure("transport", "bs=8 ipc", 60.0, "µs"))
    (folder / TEMPLATE).write_text(
        "# Page\n\nPreface.\n\n## Decode\n\n{{table decode-step}}\n\nA note.\n\n{{table prefill}}\n"
    )
    return folder


def test_the_newest_figure_of_each_case_and_machine_kind(results: Path, tmp_path: Path) -> None:
    page = tmp_path / "docs" / "perf.md"
    text = render(results, results / TEMPLATE, page)
    lines = text.splitlines()
    assert lines[:6] == ["# Page", "", "Preface.", "", "## Decode", ""]
    table = lines[6 : lines.index("A note.") - 1]
    assert (
        table[0]
        == "| case | figure | true floor | ratio | target | date | commit | machine | command |"
    )
    # newest run first: H200's bs=1 from the new run; bs=32 from the old (nothing newer); the
    # CPU's own bs=1 stays beside the H200's
    cells = [row.split(" | ") for row in table[2:]]
    assert [(c[0].lstrip("| "), c[1], c[5], c[7]) for c in cells] == [
        ("m bs=1", "0.45 ms", "2026-12-02", "H200"),
        ("m bs=32", "1.2 ms", "2026-12-01", "H200"),
        ("m bs=1", "9 ms", "2026-12-01", "2-core CPU"),
    ]
    assert "≤ 0.5 ms: met" in table[2] and "`new run \\| piped`" in table[2]
    assert "[record](../results/2026-12-02T080000Z-latency-H200-abcdef0.json)" in table[2]
    assert cells[1][4] == "—" and "`old run`" in table[3]  # no target on bs=32
    assert cells[2][2:5] == ["—", "—", "—"] and "`cpu run`" in table[4]
    assert "0.7 ms" not in text  # the older bs=1 figure of the same machine kind is gone
    assert "_No record yet._" in lines  # a placed target without records
    # a target the template does not place comes after it
    assert lines[lines.index("## Other targets") + 2] == "### `transport`"


def test_runs_group_their_rows(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    _save(
        folder,
        "2026-12-03",
        H200,
        "matrix",
        *(figure("decode-step", f"m bs={bs}", 1.0 + bs / 100, "ms") for bs in (128, 8, 32, 1)),
    )
    (folder / TEMPLATE).write_text("{{table decode-step}}\n")
    rows = render(folder, folder / TEMPLATE, tmp_path / "perf.md").splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| m bs=1", "| m bs=8", "| m bs=32", "| m bs=128"]
    assert "`matrix`" in rows[0] and all(r.endswith("〃 | 〃 | 〃 | 〃 |") for r in rows[1:])


def test_a_placeholder_with_cases_shows_only_the_cases_its_regex_finds(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    cases = ("m bs=1 FULL", "m bs=1 TR_HYBRID", "m bs=8 FULL", "m bs=8 TR_HYBRID")
    _save(
        folder, "2026-12-03", H200, "matrix", *(figure("decode-step", c, 1.0, "ms") for c in cases)
    )
    (folder / TEMPLATE).write_text("{{table decode-step cases ^(?!.*TR_HYBRID)}}\n")
    page = render(folder, folder / TEMPLATE, tmp_path / "perf.md")
    rows = page.splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| m bs=1 FULL", "| m bs=8 FULL"]
    assert "Other targets" not in page  # placed, though some of its cases are not shown


def test_a_ratio_stated_without_its_anchor_keeps_the_anchor_column(tmp_path: Path) -> None:
    """A record moved from prose may know the ratio and not the anchor's value."""
    folder = tmp_path / "r"
    f = figure("serving", "c=8", 1623.3, "tokens/s", anchor_name="offline engine")
    f.ratio = 0.933
    _save(folder, "2026-12-04", H200, "serve", f)
    (folder / TEMPLATE).write_text("{{table serving}}\n")
    header, _, row = render(folder, folder / TEMPLATE, tmp_path / "perf.md").splitlines()
    assert header.startswith("| case | figure | offline engine | ratio |")
    assert row.startswith("| c=8 | 1623.3 tokens/s | — | 0.933× |")


def test_report_writes_checks_and_shows_history(results: Path, tmp_path: Path, capsys) -> None:
    page = tmp_path / "perf.md"
    common = ["--results", str(results), "--out", str(page)]
    assert main([*common, "--check"]) == 1  # nothing written yet
    assert "differs from what the records render" in capsys.readouterr().out
    assert main(common) == 0 and main([*common, "--check"]) == 0
    page.write_text(page.read_text().replace("0.45 ms", "0.40 ms"))  # edited by hand
    assert main([*common, "--check"]) == 1
    assert "-| m bs=1 | 0.40 ms" in capsys.readouterr().out

    png = tmp_path / "h.png"
    assert (
        main(
            [
                "--results",
                str(results),
                "--history",
                "decode-step",
                "--case",
                "bs=1",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| case | machine | date | commit | figure |")
    # every bs=1 figure: the CPU's, then the H200's oldest first
    assert [row.split(" | ")[1:3] for row in out[2:5]] == [
        ["2-core CPU", "2026-12-01"],
        ["H200", "2026-12-01"],
        ["H200", "2026-12-02T08:00:00Z"],
    ]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["--results", str(results), "--history", "prefill"]) == 2
    assert "targets: ['decode-step', 'transport']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--results", str(results), "--plot", str(png)])  # --plot goes with --history


def test_cli_wires_the_subcommand() -> None:
    args, rest = build_parser().parse_known_args(["bench", "report", "--check"])
    assert (args.command, args.what, rest) == ("bench", "report", ["--check"])

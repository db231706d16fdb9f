"""Bench records: the schema's checks, where `--record` writes, the commit and machine a record
names, and what the latency bench records on a GPU (targets, TR_HYBRID against FULL, capture)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
from pathlib import Path

import jsonschema
import pytest
from records_harness import SCHEMA

from atomrt.runtime.bench import records, targets
from atomrt.runtime.bench.dp import dp_figures
from atomrt.runtime.bench.latency import Report, Row, _parse
from atomrt.runtime.bench.latency_figures import latency_figures
from atomrt.runtime.bench.records import (
    Machine,
    Quantity,
    Record,
    RecordError,
    Threshold,
    add_record_flag,
    figure,
    load_records,
    machine_kind,
    parse_record,
    resolve_record_flag,
    write_record,
)

ROOT = Path(__file__).parent.parent
H200 = Machine("H200", "NVIDIA H200", 1, None, 16, "2.11", "3.6", "13.0", "3.12")


def _record(date: str, *figures: records.Figure, machine: Machine = H200) -> Record:
    return Record("latency", "atomrt bench latency", date, "abc1234", False, machine, list(figures))


def test_a_figure_works_out_its_ratio_and_verdict() -> None:
    f = figure(
        "decode-step", "m bs=1", 4.276, "ms", anchor=3.542, threshold=Threshold("<=", 1.1, "ratio")
    )
    assert f.ratio == round(4.276 / 3.542, 4) and f.met is False
    assert figure("t", "c", 0.45, "ms", threshold=Threshold("<=", 0.5)).met is True
    assert figure("t", "c", 0.714, "×", threshold=Threshold(">=", 0.55)).met is True
    assert figure("t", "c", 3.0, "ms").ratio is None


def test_records_round_trip_and_load_oldest_first(tmp_path: Path) -> None:
    old = _record("2026-12-04", figure("decode-step", "a", 1.0, "ms", anchor=0.5))
    new = _record(
        "2026-12-04T10:21:07Z",
        figure("decode-step", "a", 0.9, "ms", extra={"p90": Quantity(1.0, "ms")}),
    )
    paths = [write_record(tmp_path, new), write_record(tmp_path, old), write_record(tmp_path, old)]
    assert [p.name for p in paths] == [
        "2026-12-04T102107Z-latency-H200-abc1234.json",
        "2026-12-04-latency-H200-abc1234.json",
        "2026-12-04-latency-H200-abc1234-2.json",  # the same name again: a second file
    ]
    for p in paths:
        data = json.loads(p.read_text())
        assert list(data)[0] == "schema"
        jsonschema.validate(data, SCHEMA)
    loaded = load_records(tmp_path)
    assert [p for p, _ in loaded] == [paths[1], paths[2], paths[0]]  # by date, then name
    assert loaded[-1][1] == new and loaded[0][1] == old


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(schema=2), "schema 2"),
        (lambda d: d.update(colour="red"), "unknown fields \\['colour'\\]"),
        (lambda d: d.update(date="4 Dec 2026"), "date"),
        (lambda d: d.pop("command"), "command: missing"),
        (lambda d: d["machine"].update(gpu_count="one"), "machine.gpu_count: expected int"),
        (lambda d: d.update(figures=[]), "at least one figure"),
        (lambda d: d["figures"][0].update(value=float("nan")), "finite"),
        (lambda d: d["figures"][0].update(met=True), "met is True, the threshold says False"),
        (lambda d: d["figures"][0].update(ratio=3.0), "ratio 3.0 is not value / anchor"),
        (lambda d: d["figures"][0].update(target="Decode Step"), "target is lower-case"),
        (lambda d: d["figures"][0]["threshold"].update(op="<"), "op is <= or >="),
    ],
)
def test_a_bad_record_names_what_is_wrong(change, message: str) -> None:
    good = _record(
        "2026-12-04",
        figure("decode-step", "a", 2.0, "ms", anchor=1.0, threshold=Threshold("<=", 1.5, "ratio")),
    )
    data = json.loads(json.dumps(dataclasses.asdict(good)))
    parse_record(data, "r.json")  # the unchanged record loads
    change(data)
    with pytest.raises(RecordError, match=message):
        parse_record(data, "r.json")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench")
    add_record_flag(p)
    return p


def test_record_flag_writes_into_the_checkout_or_the_given_folder(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    checkout = tmp_path / "checkout"
    (checkout / "benchmarks" / "results").mkdir(parents=True)
    (checkout / "sub").mkdir()
    monkeypatch.chdir(checkout / "sub")
    p = _parser()
    for argv, want in (
        ([], None),
        (["--record", "out"], "out"),
        (["--record"], str(checkout / "benchmarks" / "results")),
    ):
        args = p.parse_args(argv)
        resolve_record_flag(args, p)
        assert args.record == want
    monkeypatch.chdir(tmp_path)  # not a checkout: a bare --record has nowhere to go
    args = p.parse_args(["--record"])
    with pytest.raises(SystemExit):
        resolve_record_flag(args, p)
    assert "give --record DIR" in capsys.readouterr().err


def test_the_commit_is_this_checkout_s_head(monkeypatch) -> None:
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    commit, dirty = records.source_commit()
    assert commit == head.stdout.strip() and isinstance(dirty, bool)
    # a copy without git names its commit through the environment; whether it is dirty is unknown
    monkeypatch.setattr(records, "ENV", dataclasses.replace(records.ENV, bench_commit="0123abc"))
    assert records.source_commit() == ("0123abc", None)


def test_the_command_line_names_the_variables_that_change_a_run(monkeypatch) -> None:
    env = dataclasses.replace(records.ENV, recorded_by_benches=(("ATOMRT_PDL", "1"),))
    monkeypatch.setattr(records, "ENV", env)
    monkeypatch.setattr(targets, "ENV", env)
    cmd = records.command_line(
        "atomrt bench latency", ["--modes", "FULL+async", "--speculative-config", '{"k": 3}']
    )
    assert (
        cmd
        == "ATOMRT_PDL=1 atomrt bench latency --modes FULL+async --speculative-config '{\"k\": 3}'"
    )
    assert targets.env_variant() == ["ATOMRT_PDL=1"]  # a case of its own, not the default's


def test_machine_kinds() -> None:
    assert machine_kind("NVIDIA H200", 1, 16) == "H200"
    assert machine_kind("NVIDIA H200", 2, 32) == "2×H200"
    assert machine_kind(None, 0, 2) == "2-core CPU"
    cpu = records.this_machine(on_gpu=False)
    assert (cpu.gpu, cpu.gpu_count, cpu.kind) == (None, 0, machine_kind(None, 0, cpu.cpu_cores))
    assert cpu.torch and cpu.python


def _row(model: str, mode: str, bs: int, ms: float, floor: float, kind: str = "req_graph") -> Row:
    return Row(
        model,
        mode,
        "inproc",
        bs,
        kind,
        ms,
        ms * 1.02,
        bs / ms * 1e3,
        floor,
        ms / floor,
        3.5,
        20.0,
        None,
    )


def test_latency_figures_on_a_gpu(monkeypatch) -> None:
    """On a GPU at the standard settings: each decode step against its target, TR_HYBRID against
    FULL of the same run, one capture figure per graph mode; an eager row gets no verdict."""
    monkeypatch.setattr(targets, "ENV", dataclasses.replace(targets.ENV, recorded_by_benches=()))
    args = _parse(
        [
            "--model",
            "SmolLM2-135M",
            "--level",
            "3",
            "--modes",
            "eager,FULL+async,TR_HYBRID+async",
            "--batch-sizes",
            "1",
        ]
    )
    report = Report("NVIDIA H200", "2.11", 4200.0, {})
    report.rows = [
        _row("SmolLM2-135M", "eager", 1, 13.7, 0.064, "eager"),
        _row("SmolLM2-135M", "FULL+async", 1, 0.638, 0.065),
        _row("SmolLM2-135M", "TR_HYBRID+async", 1, 0.634, 0.065, "token_graph"),
    ]
    figs = latency_figures(report, args, on_cuda=True)
    got = {(f.target, f.case): f for f in figs}
    assert list(got) == [
        ("decode-step", "SmolLM2-135M bs=1 eager"),
        ("decode-step", "SmolLM2-135M bs=1 FULL+async"),
        ("decode-step", "SmolLM2-135M bs=1 TR_HYBRID+async"),
        ("tr-hybrid-vs-full", "SmolLM2-135M bs=1 TR_HYBRID+async"),
        ("graph-capture", "SmolLM2-135M FULL+async, ladder 1..1"),
        ("graph-capture", "SmolLM2-135M TR_HYBRID+async, ladder 1..1"),
    ]
    assert got["decode-step", "SmolLM2-135M bs=1 eager"].threshold is None
    full = got["decode-step", "SmolLM2-135M bs=1 FULL+async"]
    assert (full.threshold, full.met, full.anchor_name) == (
        Threshold("<=", 0.5),
        False,
        "true floor",
    )
    tr = got["tr-hybrid-vs-full", "SmolLM2-135M bs=1 TR_HYBRID+async"]
    assert (tr.anchor, tr.anchor_name, tr.ratio, tr.met) == (
        0.638,
        "FULL+async",
        round(0.634 / 0.638, 4),
        True,
    )
    # the capture target is the 1..512 ladder's; a bare --level 0 run is a variant: no verdicts
    assert all(f.threshold is None for (t, _), f in got.items() if t == "graph-capture")
    args = _parse(["--model", "SmolLM2-135M", "--modes", "FULL+async", "--batch-sizes", "1"])
    plain = latency_figures(report, args, on_cuda=True)
    assert plain[1].case == "SmolLM2-135M bs=1 FULL+async, level 0" and plain[1].threshold is None
    assert all(
        f.threshold is None
        for f in latency_figures(report, _parse(["--level", "3"]), on_cuda=False)
    )


def test_a_dp_case_names_each_setting_once(monkeypatch) -> None:
    """The executor is a dp case's axis, not also an engine flag; numbers are written plainly."""
    from atomrt.runtime.bench.dp import LayoutResult, Report, _parse

    monkeypatch.setattr(targets, "ENV", dataclasses.replace(targets.ENV, recorded_by_benches=()))
    args = _parse(["--executor", "ray", "--imbalance", "0", "--layouts", "1x1,2x1"])
    report = Report("tiny-qwen3-moe", "cpu", "", [32], 64, 32, 0.0, 0, 0, ["none"], {})
    for dp, rate in ((1, 1182.8), (2, 699.0)):
        report.results.append(
            LayoutResult(
                f"DP={dp} TP=1", dp, 1, "ray", None, 0, 0, rate, 0, 0, 0, 0.25, 0, 0, "none", 32
            )
        )
    one, two = dp_figures(report, args, on_gpu=False)
    assert (
        two.case
        == "tiny-qwen3-moe DP=2 TP=1, ray, tbo=none, 32 requests, imbalance 0, --load-format dummy"
    )
    assert (one.anchor, two.anchor, two.anchor_name, two.ratio) == (
        None,
        1182.8,
        "DP=1 TP=1",
        round(699.0 / 1182.8, 4),
    )


def test_a_run_without_figures_writes_no_record(tmp_path: Path, capsys) -> None:
    assert records.save(tmp_path, "latency", [], [], on_gpu=False) is None
    assert list(tmp_path.iterdir()) == [] and "nothing written" in capsys.readouterr().out

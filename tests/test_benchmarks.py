"""benchmarks/: every script is indexed in its README, compiles, and answers --help on CPU."""

import importlib.util
import json
import py_compile
import re
import subprocess
import sys
from pathlib import Path

from records_harness import check_records

from atomrt.runtime.bench.records import Threshold

ROOT = Path(__file__).parent.parent
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))


def indexed() -> list[str]:
    """The scripts named in the first column of benchmarks/README.md's index table."""
    rows = (line for line in (BENCH / "README.md").read_text().splitlines() if line.startswith("|"))
    return [m.group(1) for line in rows if (m := re.match(r"\|\s*`?([\w.]+\.py)`?\s*\|", line))]


def test_readme_indexes_every_script_once():
    names = indexed()
    assert SCRIPTS, "benchmarks/ holds no scripts"
    assert len(names) == len(set(names)), (
        f"listed twice: {sorted({n for n in names if names.count(n) > 1})}"
    )
    assert set(names) == set(SCRIPTS), (
        f"not in the README: {sorted(set(SCRIPTS) - set(names))}; "
        f"in the README but missing: {sorted(set(names) - set(SCRIPTS))}"
    )


def test_scripts_compile(tmp_path):
    for name in SCRIPTS:
        py_compile.compile(str(BENCH / name), cfile=str(tmp_path / f"{name}c"), doraise=True)


# Runs every script's --help in one interpreter (torch imported once): a script's argparse exits
# before any work; stdout and the exit of each are reported back as JSON.
_HELP_RUNNER = """
import contextlib, io, json, runpy, sys
failed = {}
for path in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        failed[path] = "ran past --help"
    except SystemExit as e:
        if e.code not in (0, None) or "usage:" not in out.getvalue():
            failed[path] = f"exit {e.code}: {out.getvalue()[:200]}"
    except BaseException as e:
        failed[path] = repr(e)
print(json.dumps(failed))
"""


def test_scripts_answer_help():
    # No script touches CUDA before parsing its arguments, so all answer --help here.
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_RUNNER, *(str(BENCH / name) for name in SCRIPTS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, failed


def test_host_step_bench_runs(tmp_path):
    """bench_host_step.py stands in for the model's forward: a change to the runner's forward
    signature must keep it running; its --record keeps the figure as a record."""
    argv = [str(BENCH / "bench_host_step.py"), "--bs", "2", "--steps", "5"]
    proc = subprocess.run(
        [sys.executable, *argv, "--record", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = re.search(r"bs=2 async: host ([\d.]+) us/step", proc.stdout)
    assert m, proc.stdout
    ((f,),) = [r.figures for r in check_records(tmp_path, "bench_host_step")]
    assert (f.target, f.case, f.value, f.unit) == ("host-step", "bs=2 async", float(m[1]), "µs")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_scripts_record_their_figures():
    """What the GPU scripts' --record keeps, from rows as they measure them: each figure against
    the anchor of the same run, and the scripts' targets where they apply."""
    prefill = _script("bench_prefill").figures(
        [
            dict(
                model="Llama-3.1-8B",
                mode="FULL",
                shape="8x2048",
                ms=424.95,
                tokens_s=38556,
                tflops=558.9,
            ),
            dict(
                model="Llama-3.2-1B",
                mode="FULL",
                shape="32x512",
                ms=85.17,
                tokens_s=192374,
                tflops=380.8,
            ),
        ],
        ceiling=782.94,
    )
    assert [(f.case, f.anchor, f.threshold, f.met) for f in prefill] == [
        ("Llama-3.1-8B 8x2048 FULL", 782.9, Threshold(">=", 0.55, "ratio"), True),
        ("Llama-3.2-1B 32x512 FULL", 782.9, None, None),
    ]
    assert prefill[0].ratio == round(558.9 / 782.9, 4) and prefill[0].extra["time"].value == 424.95

    moe = _script("sweep_moe")
    outcomes = [
        moe.Outcome("Qwen3-30B-A3B", m, {}, 30.0, {}, us, 20.0, 9, 0)
        for m, us in ((8, 24.0), (512, 90.0))
    ]
    small, large = moe.figures(outcomes)
    assert (small.case, small.ratio, small.met) == ("Qwen3-30B-A3B M=8", 1.2, True)
    assert large.threshold is None  # not a decode size

    (argmax,) = _script("bench_argmax").figures([(1, 128256, 16, [26.4, 3.2, 10.3], [13.3, 30.6])])
    assert (argmax.case, argmax.value, argmax.anchor, argmax.anchor_name) == (
        "1 × 128256, 16 splits",
        3.2,
        26.4,
        "torch.argmax",
    )

    gemm = _script("sweep_gemm")
    summary = dict(
        n=960, k=576, default={}, best={}, best_gbs=None, num_timed=1, num_skipped=0, searched=True
    )
    summaries = [
        gemm.Summary("SmolLM2-135M qkv", 1, cublas_us=3.7, default_us=2.5, best_us=2.23, **summary),
        gemm.Summary("SmolLM2-135M o", 1, cublas_us=3.14, default_us=None, best_us=None, **summary),
    ]
    (f,) = gemm.figures(summaries, norm=True)  # every config of the second was skipped
    assert (f.case, f.value, f.anchor, f.extra["default config"].value) == (
        "SmolLM2-135M qkv M=1, with the norm",
        2.23,
        3.7,
        2.5,
    )


def test_mla_decode_dry_run_keeps_its_rows_as_a_record(tmp_path):
    """bench_mla_decode.py --dry-run (toy shapes, Triton's interpreter) with --record: a figure per
    row against the copy of the same run, no verdict off the GPU; on a GPU, bs >= 8 is judged."""
    out = tmp_path / "mla.json"
    argv = [str(BENCH / "bench_mla_decode.py"), "--dry-run", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, *argv, "--record", str(tmp_path / "records")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    (record,) = check_records(tmp_path / "records", "bench_mla_decode")
    assert "python benchmarks/bench_mla_decode.py --dry-run --json" in record.command
    assert any("dry run" in n for n in record.notes)
    assert [(f.target, f.case, f.value, f.threshold) for f in record.figures] == [
        ("mla-decode", f"{r['heads']} heads bs={r['bs']} ctx={r['ctx']}", r["gbps"], None)
        for r in rows
    ]
    on_gpu = _script("bench_mla_decode").figures(
        [dict(r, bs=bs, gbps=gbps) for r, bs, gbps in ((rows[0], 1, 900.0), (rows[0], 8, 3100.0))],
        copy=4200.0,
        on_gpu=True,
    )
    assert [(f.threshold, f.met) for f in on_gpu] == [
        (None, None),
        (Threshold(">=", 0.7, "ratio"), True),
    ]
    assert on_gpu[1].ratio == round(3100 / 4200, 4) and on_gpu[1].extra["time"].unit == "µs"


def test_scripts_with_figures_take_record():
    names = ("bench_argmax", "bench_host_step", "bench_mla_decode", "bench_prefill", "sweep_gemm")
    for name in (*names, "sweep_moe"):
        assert "add_record_flag" in (BENCH / f"{name}.py").read_text(), name

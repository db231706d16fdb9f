"""benchmarks/: every script is indexed in its README, compiles, and answers --help on CPU."""

import json
import py_compile
import re
import subprocess
import sys
from pathlib import Path

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


def test_host_step_bench_runs():
    """bench_host_step.py stands in for the model's forward: a change to the runner's forward
    signature must keep it running (it is the host-step figure of docs/perf.md)."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_host_step.py"), "--bs", "2", "--steps", "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"bs=2 async: host [\d.]+ us/step", proc.stdout), proc.stdout

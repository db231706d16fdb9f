"""benchmarks/: every script is indexed in its README, compiles, and answers --help on CPU."""

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


def test_scripts_answer_help():
    # No script touches CUDA before parsing its arguments, so all answer --help here; they run
    # side by side because each spends seconds importing torch.
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(BENCH / name), "--help"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in SCRIPTS
    }
    failed = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0 or "usage:" not in out:
            failed[name] = f"rc={proc.returncode}: {err.strip().splitlines()[-1:] or out[:200]}"
    assert not failed, failed

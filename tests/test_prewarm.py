"""`atomrt prewarm`: fill the compile cache for a config, then check it read-only.

The default run checks the command line (the same engine flags as `generate`, a config that compiles
nothing refused before any engine starts); tests/test_deploy_ray.py runs prewarm as a Ray job and
shows the second start compiling nothing. The slow test here runs the whole cycle through the real
`atomrt` script: fill, check read-only (exit 0), check a config whose pieces are missing (exit 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from executor_harness import build_tiny_llama

from atomrt.runtime.entrypoints.cli import build_parser, main


def _options(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {s for a in sub.choices[command]._actions for s in a.option_strings}


def test_prewarm_takes_every_engine_flag_of_generate():
    only_generate = {"--prompt", "--chat", "--max-tokens", "--temperature", "--seed"}
    assert _options("prewarm") == _options("generate") - only_generate
    args = build_parser().parse_args(
        ["prewarm", "--model", "m", "--level", "3", "--tp", "2", "--set", "a.b=1"]
    )
    assert (args.command, args.level, args.tensor_parallel_size, args.overrides) == (
        "prewarm",
        3,
        2,
        ["a.b=1"],
    )


@pytest.mark.parametrize(
    "flags, knob",
    [
        ([], "compilation_config.level is 0"),
        (["--level", "3", "--enforce-eager"], "enforce_eager"),
        (["--level", "3", "--set", "compilation_config.use_inductor=false"], "use_inductor"),
    ],
)
def test_a_config_that_compiles_nothing_is_refused(flags, knob, capsys):
    assert main(["prewarm", "--model", "no-such-model-is-loaded", *flags]) == 2
    assert knob in capsys.readouterr().err


def _prewarm(model: Path, cache: Path, sizes: str, read_only: bool) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("atomrt")
    env = dict(os.environ, ATOMRT_COMPILE_CACHE_READ_ONLY="1" if read_only else "0")
    cmd = [str(script), "prewarm", "--model", str(model), "--device", "cpu", "--level", "3"]
    cmd += ["--set", f"compilation_config.compile_sizes={sizes}", "--max-num-seqs", "8"]
    cmd += ["--set", f"compilation_config.cache_dir={cache}"]
    cmd += ["--set", "cache_config.num_kv_blocks=64"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.mark.slow
def test_fill_then_check_read_only(tmp_path: Path):
    model = build_tiny_llama(tmp_path / "model")
    cache = tmp_path / "cache"
    cold = _prewarm(model, cache, "[3]", read_only=False)
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert "6 Inductor compiles and 0 cache loads" in cold.stdout  # 3 pieces x (general, 3)
    (record_path,) = cache.glob("*/prewarm.json")
    record = json.loads(record_path.read_text())
    assert record["compile_sizes"] == [3] and record["capture_sizes"] == list(range(1, 9))
    assert record["ranks"][0]["cache_dirs"] == [str(record_path.parent / "rank_0" / "backbone")]
    assert not record["read_only"] and record["inductor_compiles"] == 6
    before = _tree(cache)
    check = _prewarm(model, cache, "[3]", read_only=True)
    assert check.returncode == 0, check.stderr[-3000:]
    assert "0 Inductor compiles and 6 cache loads" in check.stdout
    assert "built from the kept trace" in check.stdout  # the fill kept Dynamo's trace
    assert "0 loaded, traced" in cold.stdout
    assert "holds every piece" in check.stdout
    other = _prewarm(model, cache, "[3, 5]", read_only=True)  # another config: another hash
    assert other.returncode == 1 and "lacks 9 piece(s)" in other.stdout
    assert _tree(cache) == before  # the checks wrote nothing

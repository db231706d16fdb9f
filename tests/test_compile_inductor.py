"""Levels 2 and 3 with Inductor on CPU, and the on-disk cache across processes.

One level-3 compile in this process fills a cache directory (module fixture); child processes
(tests/test_compile_toys.py run as a script) then load from it, recompile a truncated artifact,
and race on a fresh key. Children report `compilation_counter`, so the assertions count
compilations instead of timing them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_compile_toys import make_config, make_models, max_diff

from atomrt.compile import PiecewiseBackend, compilation_counter, trace_store
from atomrt.compile.cache import INDEX_FILE_NAME, read_index, verify_ready_marker

TOYS = Path(__file__).with_name("test_compile_toys.py")
CHILD_TIMEOUT_S = 400
TOLERANCE = 1e-4


def run_child(cache_dir: Path, level: int, two_ops: bool, num_layers: int = 2) -> tuple[dict, str]:
    # The child imports the toys as this process does (not as __main__), so its model class has
    # the same qualified name, which the trace cache's key holds.
    run_toys = (
        f"import sys; sys.path.insert(0, {str(TOYS.parent)!r}); import test_compile_toys; "
        "test_compile_toys.main(sys.argv[1:])"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            run_toys,
            str(cache_dir),
            str(level),
            "1" if two_ops else "0",
            str(num_layers),
        ],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _result(proc.stdout), proc.stderr


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0][len("RESULT ") :])


def _prefix_dir(cache_root: Path) -> Path:
    (hash_dir,) = [p for p in cache_root.iterdir() if p.is_dir() and p.name != trace_store.DIR_NAME]
    return hash_dir / "rank_0" / "backbone"


@pytest.fixture(scope="module")
def level3_cache(tmp_path_factory):
    """Compile the two-op toy model at level 3 here; return (cache root, diff, pieces, counter)."""
    torch._dynamo.reset()
    compilation_counter.reset()
    root = tmp_path_factory.mktemp("level3_cache")
    torch.manual_seed(0)
    model, eager = make_models(make_config(3, str(root)), two_ops=True)
    diff = max_diff(model, eager)
    pieces = [
        v
        for v in model.compile_backend.split_gm.__dict__.values()
        if isinstance(v, PiecewiseBackend)
    ]
    return root, diff, pieces, compilation_counter.snapshot()


def test_level3_matches_eager(level3_cache):
    _, diff, pieces, counter = level3_cache
    assert diff <= TOLERANCE
    assert len(pieces) == 3  # one more than the two splitting calls
    for piece in pieces:
        assert piece.compiled_graph_for_general_shape is not None
        assert set(piece.concrete_size_entries) == {4} and piece.concrete_size_entries[4].compiled
    assert counter["num_inductor_compiles"] == 6  # 3 pieces x (general + size 4)
    assert counter["num_cache_loads"] == 0


def test_level2_matches_eager(tmp_path):
    torch._dynamo.reset()
    compilation_counter.reset()
    torch.manual_seed(0)
    model, eager = make_models(make_config(2, str(tmp_path)))
    assert max_diff(model, eager) <= TOLERANCE
    assert compilation_counter.num_inductor_compiles == 1  # Inductor once, general shape


def test_second_process_loads_every_artifact(level3_cache):
    root = level3_cache[0]
    result, _ = run_child(root, level=3, two_ops=True)
    assert result["max_diff"] <= TOLERANCE
    assert result["counter"]["num_inductor_compiles"] == 0
    assert result["counter"]["num_cache_loads"] == 6
    assert result["counter"]["num_trace_loads"] == 1  # built from the trace kept here: no Dynamo


@pytest.mark.slow
def test_truncated_artifact_is_recompiled_with_a_warning(level3_cache, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(level3_cache[0], root)
    artifact = _prefix_dir(root) / "artifact_shape_None_subgraph_1"
    victim = max(
        (p for p in artifact.rglob("*") if p.is_file() and p.name != "READY"),
        key=lambda p: p.stat().st_size,
    )
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    result, stderr = run_child(root, level=3, two_ops=True)
    assert result["max_diff"] <= TOLERANCE
    assert result["counter"]["num_corrupt_entries"] == 1
    assert result["counter"]["num_inductor_compiles"] == 1
    # 5 after tracing, and the first piece once before: the build from the kept trace stops at
    # the damaged piece and the child traces instead
    assert result["counter"]["num_cache_loads"] == 6
    assert result["counter"]["num_trace_loads"] == 0
    assert "WARNING" in stderr and "truncated" in stderr
    verify_ready_marker(artifact)  # rewritten whole


@pytest.mark.slow
def test_concurrent_compiles_of_one_key(tmp_path):
    cmd = [sys.executable, str(TOYS), str(tmp_path), "2", "0"]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=CHILD_TIMEOUT_S) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    results = [_result(out) for out, _ in outputs]
    assert all(r["max_diff"] <= TOLERANCE for r in results)
    assert sorted(r["counter"]["num_inductor_compiles"] for r in results) == [0, 1]
    assert sorted(r["counter"]["num_cache_loads"] for r in results) == [0, 1]
    prefix = _prefix_dir(tmp_path)
    assert list(read_index(prefix / INDEX_FILE_NAME)) == [(None, 0, "inductor_standalone")]
    verify_ready_marker(prefix / "artifact_shape_None_subgraph_0")


@pytest.mark.slow
def test_read_only_mount_loads_every_artifact_and_writes_nothing(level3_cache, tmp_path):
    """Serving pods mount the cache a prewarm job filled read-only: Inductor's loader must not
    need to write beside the artifacts (it takes file locks there)."""
    import os

    root = tmp_path / "cache"
    shutil.copytree(level3_cache[0], root)
    files = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}
    view = tmp_path / "view"
    view.mkdir()
    if os.geteuid() != 0:
        for p in [root, *root.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        view = root
    elif subprocess.run(["mount", "--bind", "-o", "ro", str(root), str(view)]).returncode != 0:
        pytest.skip("running as root without the right to mount: no read-only directory here")
    try:
        result, stderr = run_child(view, level=3, two_ops=True)
    finally:
        if view != root:
            subprocess.run(["umount", str(view)], check=True)
    assert result["max_diff"] <= TOLERANCE
    assert result["counter"]["num_inductor_compiles"] == 0, stderr[-3000:]
    assert result["counter"]["num_cache_loads"] == 6
    after = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}
    assert after == files


@pytest.mark.slow  # ~20 s; test_second_process_loads_every_artifact covers the cache
def test_pieces_that_compute_the_same_share_one_compile_and_one_load(tmp_path):
    """Five layers: the pieces between the splitting calls of layers 1..4 are the same code on
    other weights (inputs), so the first of them is compiled (general shape and size 4) and the
    other three reuse it; the model still matches eager. A second process loads the three
    distinct pieces and shares the rest, compiling nothing."""
    torch._dynamo.reset()
    compilation_counter.reset()
    torch.manual_seed(0)
    model, eager = make_models(make_config(3, str(tmp_path)), num_layers=5)
    assert max_diff(model, eager) <= TOLERANCE
    pieces = [
        v
        for v in model.compile_backend.split_gm.__dict__.values()
        if isinstance(v, PiecewiseBackend)
    ]
    assert len(pieces) == 6
    middle = pieces[1:-1]
    assert all(
        p.compiled_graph_for_general_shape is middle[0].compiled_graph_for_general_shape
        for p in middle
    )
    assert (
        pieces[0].compiled_graph_for_general_shape is not middle[0].compiled_graph_for_general_shape
    )
    counter = compilation_counter.snapshot()
    assert counter["num_inductor_compiles"] == 2 * 3  # (first, middle, last) x (general, size 4)
    assert counter["num_shared_pieces"] == 2 * 3
    result, _ = run_child(tmp_path, level=3, two_ops=False, num_layers=5)
    assert result["max_diff"] <= TOLERANCE
    warm = result["counter"]
    assert (warm["num_inductor_compiles"], warm["num_cache_loads"]) == (0, 2 * 3)
    assert warm["num_shared_pieces"] == 2 * 3

"""The compile cache without Inductor: hash inputs, index, READY manifest, lock, compile-or-load."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from test_compile_toys import make_config

from atomrt.compile import (
    CompilerInterface,
    CompilerManager,
    CorruptCacheEntry,
    compilation_counter,
    compute_cache_hash,
)
from atomrt.compile.cache import (
    FileLock,
    cache_dir_for,
    read_index,
    verify_ready_marker,
    write_index,
    write_ready_marker,
)
from atomrt.runtime.config import CacheConfig, ParallelConfig, SchedulerConfig


def _hash(config, files) -> str:
    return compute_cache_hash(config.compute_hash(), files, "compiler-x").hash


def test_hash_follows_model_source(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "model.py").write_text("x = 1\n")
    (b / "model.py").write_text("x = 1\n")
    config = make_config(3)
    base = _hash(config, [str(a / "model.py")])
    assert _hash(config, [str(b / "model.py")]) == base  # another checkout of the same source
    (b / "model.py").write_text("x = 2\n")
    assert _hash(config, [str(b / "model.py")]) != base
    assert (
        compute_cache_hash(config.compute_hash(), [str(a / "model.py")], "compiler-y").hash != base
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {"compile_sizes": [2]},
        {"splitting_ops": ["atomrt.test_attn"]},
        {"inductor_compile_config": {"epilogue_fusion": False}},
        {"level": 2},
        {"use_inductor": False},
    ],
)
def test_graph_affecting_config_changes_the_hash(overrides):
    overrides = dict(overrides)
    level = overrides.pop("level", 3)
    assert _hash(make_config(level, **overrides), []) != _hash(make_config(3), [])


def test_placement_and_unrelated_settings_keep_the_hash():
    base = make_config(3)
    h = _hash(base, [])
    variants = [
        make_config(3, cache_dir="/somewhere/else", debug_dump_path="/tmp/dump"),
        dataclasses.replace(
            base, parallel_config=ParallelConfig(ray_address="10.1.2.3:6390", worker_timeout_s=5.0)
        ),
        dataclasses.replace(
            base, parallel_config=ParallelConfig(data_parallel_size=2, executor="ray")
        ),
        dataclasses.replace(base, scheduler_config=SchedulerConfig(max_num_seqs=64)),
        dataclasses.replace(
            base, cache_config=CacheConfig(block_size=32, gpu_memory_utilization=0.5)
        ),
    ]
    for v in variants:
        assert _hash(v, []) == h
    # The rank is a directory below the hash, never part of it.
    root = Path("/cache-root")
    assert (
        cache_dir_for(root, h, 0, "backbone").parent.parent
        == cache_dir_for(root, h, 1, "backbone").parent.parent
    )


def test_index_round_trip_and_garbage(tmp_path):
    index = {
        (None, 0, "inductor_standalone"): {
            "handle": ("artifact_shape_None_subgraph_0",),
            "graph_hash": "ab",
        },
        (4, 1, "inductor_standalone"): {
            "handle": ("artifact_shape_4_subgraph_1",),
            "graph_hash": "cd",
        },
    }
    path = tmp_path / "atomrt_compile_cache.py"
    write_index(path, index)
    assert read_index(path) == index
    path.write_text("{(None, 0, 'x'): {'handle': ")
    with pytest.raises(CorruptCacheEntry):
        read_index(path)
    path.write_text("__import__('os').system('true')")  # never executed
    with pytest.raises(CorruptCacheEntry):
        read_index(path)


def test_ready_marker_detects_partial_and_truncated(tmp_path):
    art = tmp_path / "artifact"
    (art / "sub").mkdir(parents=True)
    (art / "sub" / "code.py").write_text("print('kernel')\n" * 20)
    with pytest.raises(CorruptCacheEntry, match="READY"):
        verify_ready_marker(art)  # written but not marked: partial
    write_ready_marker(art)
    verify_ready_marker(art)
    (art / "sub" / "extra.so").write_bytes(b"built at load")  # added later: allowed
    verify_ready_marker(art)
    (art / "sub" / "code.py").write_text("print('ker")
    with pytest.raises(CorruptCacheEntry, match="truncated"):
        verify_ready_marker(art)


def test_lock_waits_with_a_timeout(tmp_path):
    with FileLock(tmp_path / ".lock"):
        with pytest.raises(TimeoutError, match="lock"):
            with FileLock(tmp_path / ".lock", timeout_s=0.2):
                pass
    with FileLock(tmp_path / ".lock", timeout_s=0.2):
        pass


class _FileCompiler(CompilerInterface):
    """Saves a file per artifact; `load` returns the graph after checking the manifest."""

    name = "file_test"

    def compile(self, graph, example_inputs, compiler_config, runtime_shape=None, key=None):
        if self.disable_cache or self.read_only:
            return graph, None
        path = self.cache_dir / key
        path.mkdir(parents=True, exist_ok=True)
        (path / "artifact.txt").write_text(graph.code)
        write_ready_marker(path)
        return graph, (key,)

    def load(self, handle, graph, example_inputs, graph_index, runtime_shape=None):
        verify_ready_marker(self.cache_dir / handle[0])
        return graph


def _manager(cache_dir) -> CompilerManager:
    manager = CompilerManager(make_config(3).compilation_config)
    manager.compiler = _FileCompiler()
    manager.initialize_cache(cache_dir)
    return manager


def test_manager_compiles_loads_and_recompiles_damage(tmp_path, caplog):
    graph = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    args = [torch.randn(2, 4)]
    compilation_counter.reset()
    _manager(tmp_path).compile(graph, args, {}, graph_index=0, runtime_shape=None)
    assert (compilation_counter.num_inductor_compiles, compilation_counter.num_cache_loads) == (
        1,
        0,
    )
    index = read_index(tmp_path / "atomrt_compile_cache.py")
    assert list(index) == [(None, 0, "file_test")]
    _manager(tmp_path).compile(graph, args, {}, graph_index=0, runtime_shape=None)
    assert (compilation_counter.num_inductor_compiles, compilation_counter.num_cache_loads) == (
        1,
        1,
    )
    (tmp_path / "artifact_shape_None_subgraph_0" / "artifact.txt").write_text("trunc")
    with caplog.at_level(logging.WARNING, logger="atomrt.compile"):
        _manager(tmp_path).compile(graph, args, {}, graph_index=0, runtime_shape=None)
    assert compilation_counter.num_corrupt_entries == 1
    assert compilation_counter.num_inductor_compiles == 2
    assert any("truncated" in r.getMessage() for r in caplog.records)
    verify_ready_marker(tmp_path / "artifact_shape_None_subgraph_0")  # repaired
    # Another graph under the same key is not served the old artifact.
    other = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    with caplog.at_level(logging.WARNING, logger="atomrt.compile"):
        _manager(tmp_path).compile(other, args, {}, graph_index=0, runtime_shape=None)
    assert compilation_counter.num_inductor_compiles == 3
    assert any("different graph" in r.getMessage() for r in caplog.records)


def test_cache_root_prefers_config_then_env():
    from atomrt.compile.cache import cache_root
    from atomrt.runtime.envs import ENV

    assert cache_root("/explicit/dir") == Path("/explicit/dir")
    assert cache_root("") == ENV.cache_root / "torch_compile_cache"


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root`: relative path -> (size, mtime in ns)."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_read_only_cache_loads_and_never_writes(tmp_path, caplog, monkeypatch):
    import atomrt.compile.cache as cache_module
    from atomrt.runtime.envs import ENV

    graph = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    args = [torch.randn(2, 4)]
    _manager(tmp_path).compile(graph, args, {}, graph_index=0, runtime_shape=None)
    before = _tree(tmp_path)
    monkeypatch.setattr(cache_module, "ENV", dataclasses.replace(ENV, compile_cache_read_only=True))
    compilation_counter.reset()
    manager = _manager(tmp_path)
    assert manager.read_only and manager.compiler.read_only
    manager.compile(graph, args, {}, graph_index=0, runtime_shape=None)  # a hit
    with caplog.at_level(logging.WARNING, logger="atomrt.compile"):
        manager.compile(graph, args, {}, graph_index=0, runtime_shape=4)  # a miss
    assert compilation_counter.num_cache_loads == 1
    assert (
        compilation_counter.num_inductor_compiles == 1 and compilation_counter.num_cache_misses == 1
    )
    assert any("read-only and lacks piece 0 for shape 4" in r.getMessage() for r in caplog.records)
    assert _tree(tmp_path) == before  # no lock, no index entry, no artifact
    assert (4, 0, "file_test") not in read_index(tmp_path / "atomrt_compile_cache.py")


def test_unwritable_directory_is_read_only(tmp_path):
    import os
    import subprocess

    from atomrt.compile.cache import is_read_only

    target = tmp_path / "cache"
    target.mkdir()
    assert not is_read_only(target) and not is_read_only(target / "not" / "there")
    view = tmp_path / "view"
    view.mkdir()
    if os.geteuid() != 0:
        target.chmod(0o555)
        view = target
    elif subprocess.run(["mount", "--bind", "-o", "ro", str(target), str(view)]).returncode != 0:
        pytest.skip("running as root without the right to mount: no read-only directory here")
    try:
        assert is_read_only(view) and is_read_only(view / "rank_0" / "backbone")
    finally:
        if view != target:
            subprocess.run(["umount", str(view)], check=True)
        target.chmod(0o755)

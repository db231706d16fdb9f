"""Dynamo's trace kept beside the compile cache (compile/trace_cache.py).

The real model classes (tiny random Llama, and Qwen3 under -m slow) at level 3 on CPU: the first
build traces and keeps the trace, a second build in a fresh model object loads it and runs no
Dynamo, with the same logits bit for bit (and eager's within 1e-4). A changed source file, a changed
model attribute, a damaged entry and a compile cache without the pieces each fall back to tracing.
A forward with a side effect keeps Dynamo's bytecode. The cross-process case is in
tests/test_compile_inductor.py (a child process builds from the kept trace).
"""

from __future__ import annotations

import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from model_harness import run_prefill_and_decode
from test_compile_models import PROMPTS_3, tiny_folder
from test_compile_toys import inputs, make_config

from atomrt.compile import (
    compilation_counter,
    support_torch_compile,
    trace_cache,
    trace_guards,
    trace_store,
)
from atomrt.runtime.config import CompilationConfig, Config
from atomrt.workers.loading.loader import load_model


@pytest.fixture(scope="module", params=["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def folder(request, tmp_path_factory) -> Path:
    """The compile tests' tiny Llama; their Qwen3 (the same checks on a second model class, about
    two minutes on the 2-core machine) runs with -m slow."""
    return tiny_folder(request.param, tmp_path_factory)


def _build(model_dir: Path, cache_dir: Path, level: int = 3):
    cc = CompilationConfig(level=level, compile_sizes=[3], cache_dir=str(cache_dir))
    config = Config(model=str(model_dir), device="cpu", compilation_config=cc)
    torch._dynamo.reset()
    return load_model(config, "cpu", torch.float32).model


def _run(model) -> list[torch.Tensor]:
    return run_prefill_and_decode(model, PROMPTS_3, 3).logits


@pytest.fixture(scope="module")
def primed(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """Eager's logits, and a cache dir a first level-3 build filled (its kept trace and every
    piece): the tests that start from a filled cache copy it rather than compile it again."""
    cache_dir = tmp_path_factory.mktemp("primed")
    eager = _run(_build(folder, cache_dir, level=0))
    _run(_build(folder, cache_dir))
    return cache_dir, eager


def _filled(primed: tuple[Path, list], cache_dir: Path) -> list[torch.Tensor]:
    """Copy the primed cache into `cache_dir`; return eager's logits."""
    shutil.copytree(primed[0], cache_dir, dirs_exist_ok=True)
    return primed[1]


def _entries(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / trace_store.DIR_NAME).glob("*/rank_0/*/*.pkl"))


def _compiled(model):
    (unit,) = [m for m in model.modules() if hasattr(m, "compiled_codes")]
    return unit


def test_a_kept_trace_builds_the_model_without_dynamo(folder: Path, tmp_path: Path, primed) -> None:
    eager = primed[1]
    traced_model = _build(folder, tmp_path)
    before = compilation_counter.snapshot()
    traced = _run(traced_model)
    assert len(_entries(tmp_path)) == 1
    assert len(_compiled(traced_model).compiled_codes) == 1  # Dynamo ran
    assert compilation_counter.num_trace_loads == before["num_trace_loads"]

    loaded_model = _build(folder, tmp_path)
    before = compilation_counter.snapshot()
    loaded = _run(loaded_model)
    after = compilation_counter.snapshot()
    assert after["num_trace_loads"] == before["num_trace_loads"] + 1
    assert _compiled(loaded_model).compiled_codes == []  # no Dynamo
    assert after["num_inductor_compiles"] == before["num_inductor_compiles"]
    assert after["num_cache_loads"] > before["num_cache_loads"]
    for a, b, e in zip(traced, loaded, eager):
        assert torch.equal(a, b)
        torch.testing.assert_close(b, e, atol=1e-4, rtol=1e-4)


def _rewrite(entry: Path, **changes) -> None:
    traced = pickle.loads(entry.read_bytes())
    for key, value in changes.items():
        setattr(traced, key, value)
    entry.write_bytes(pickle.dumps(traced))


def test_an_entry_traced_from_other_sources_than_its_name_says_is_traced_over(
    folder: Path,
    tmp_path: Path,
    caplog,
    primed,
) -> None:
    _filled(primed, tmp_path)
    (entry,) = _entries(tmp_path)
    real_hash = pickle.loads(entry.read_bytes()).source_hash
    _rewrite(entry, source_hash="0" * 64)  # as if written for the hash of other files
    model = _build(folder, tmp_path)
    before = compilation_counter.snapshot()
    with caplog.at_level(logging.WARNING, logger="atomrt.compile.trace_cache"):
        _run(model)
    assert "other sources" in caplog.text
    assert compilation_counter.num_trace_loads == before["num_trace_loads"]
    assert len(_compiled(model).compiled_codes) == 1
    assert pickle.loads(entry.read_bytes()).source_hash == real_hash  # written again


def test_an_entry_is_found_for_the_sources_this_process_imports(tmp_path: Path, monkeypatch):
    """Module names are looked up through this process's imports: an edited module, or a copy of
    it first on sys.path, has another entry (none yet), never the one traced from the original."""
    original, copy = tmp_path / "original", tmp_path / "copy"
    original.mkdir()
    copy.mkdir()
    (original / "kept_trace_probe.py").write_text("SCALE = 1\n")
    (copy / "kept_trace_probe.py").write_text("SCALE = 2\n")
    monkeypatch.syspath_prepend(str(original))
    sources = trace_store.sources(["kept_trace_probe"])
    assert sources is not None and sources.files == [str(original / "kept_trace_probe.py")]
    directory = tmp_path / "entries"
    empty = trace_guards.Guards([], [], {})
    traced = trace_cache.TracedForward([], [], sources.modules, sources.hash, empty)
    entry = trace_store.save(directory, traced, sources)
    assert trace_store.find(directory) == (entry, sources)
    assert trace_store.load(entry, sources).modules == ["kept_trace_probe"]

    monkeypatch.syspath_prepend(str(copy))
    assert trace_store.find(directory) is None
    monkeypatch.syspath_prepend(str(original))
    assert trace_store.find(directory) == (entry, sources)
    (original / "kept_trace_probe.py").write_text("SCALE = 3\n")
    assert trace_store.find(directory) is None
    assert trace_store.sources(["no_such_module_anywhere"]) is None


def test_a_changed_attribute_that_forward_reads_means_a_new_trace(
    folder: Path, tmp_path: Path, primed
):
    eager = _filled(primed, tmp_path)
    model = _build(folder, tmp_path)
    _compiled(model).layers[0].self_attn.some_flag = True  # set after construction, never read
    before = compilation_counter.snapshot()
    _run(model)
    assert compilation_counter.num_trace_loads == before["num_trace_loads"] + 1

    model = _build(folder, tmp_path)
    unit = _compiled(model)
    unit.layers[0].mlp.gate_up_proj.skinny_max_rows = 0  # read by forward: Dynamo guards it
    before = compilation_counter.snapshot()
    logits = _run(model)
    assert compilation_counter.num_trace_loads == before["num_trace_loads"]
    assert len(unit.compiled_codes) == 1
    for a, e in zip(logits, eager):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


def test_a_damaged_entry_is_traced_over(folder: Path, tmp_path: Path, caplog, primed) -> None:
    _filled(primed, tmp_path)
    (entry,) = _entries(tmp_path)
    entry.write_bytes(entry.read_bytes()[:100])
    model = _build(folder, tmp_path)
    with caplog.at_level(logging.WARNING, logger="atomrt.compile.trace_cache"):
        _run(model)
    assert "unreadable" in caplog.text
    assert len(_compiled(model).compiled_codes) == 1
    assert isinstance(pickle.loads(entry.read_bytes()), trace_cache.TracedForward)


def test_a_trace_that_cannot_be_written_is_warned_of(
    folder: Path, tmp_path: Path, caplog, primed
) -> None:
    (tmp_path / trace_store.DIR_NAME).write_text("not a directory")
    eager = primed[1]
    with caplog.at_level(logging.WARNING, logger="atomrt.compile.decorators"):
        logits = _run(_build(folder, tmp_path))
    assert "trace not written" in caplog.text
    for a, e in zip(logits, eager):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


def test_an_entry_of_another_layout_is_traced_over(tmp_path: Path, caplog) -> None:
    entry = tmp_path / "backbone.pkl"
    empty = trace_guards.Guards([], [], {})
    old = trace_cache.TracedForward([], [], [], "", empty)
    del old.guards  # an entry written before a field was added
    entry.write_bytes(pickle.dumps(old))
    sources = trace_cache.Sources([], [], "")
    with caplog.at_level(logging.WARNING, logger="atomrt.compile.trace_cache"):
        assert trace_store.load(entry, sources) is None
        assert trace_store.load(tmp_path / "missing.pkl", sources) is None
    assert "unreadable" in caplog.text


def test_pieces_missing_from_the_compile_cache_are_traced_again(
    folder: Path,
    tmp_path: Path,
    caplog,
    primed,
) -> None:
    eager = _filled(primed, tmp_path)
    for hash_dir in tmp_path.iterdir():
        if hash_dir.name != trace_store.DIR_NAME:
            shutil.rmtree(hash_dir)
    model = _build(folder, tmp_path)
    before = compilation_counter.snapshot()
    with caplog.at_level(logging.WARNING, logger="atomrt.compile.decorators"):
        logits = _run(model)
    assert "PieceNotCached" in caplog.text
    assert compilation_counter.num_trace_loads == before["num_trace_loads"]
    assert compilation_counter.num_inductor_compiles > before["num_inductor_compiles"]
    # one miss per compile: the build from the kept trace, which stopped at the first, counted none
    compiles = compilation_counter.num_inductor_compiles - before["num_inductor_compiles"]
    assert compilation_counter.num_cache_misses - before["num_cache_misses"] == compiles
    assert len(_compiled(model).compiled_codes) == 1
    for a, e in zip(logits, eager):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


class _CountingToy(torch.nn.Module):
    """A forward with a side effect Dynamo's bytecode replays (it sets an attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.relu(self.proj(x))


CountingToy = support_torch_compile(_CountingToy)


def test_a_forward_with_side_effects_keeps_dynamos_bytecode_and_is_warned_of(
    tmp_path: Path, caplog
) -> None:
    torch._dynamo.reset()
    model = CountingToy(config=make_config(3, str(tmp_path), splitting_ops=[], compile_sizes=[]))
    with caplog.at_level(logging.INFO, logger="atomrt.compile.decorators"):  # (and WARNING)
        with torch.no_grad():
            first = model(torch.ones(3, 4))
            second = model(torch.ones(2, 4))
    assert "Dynamo's trace is not kept" in caplog.text
    assert _entries(tmp_path) == []
    assert model._compiled_forward.__code__ is model.compiled_codes[0]  # Dynamo's bytecode
    torch.testing.assert_close(first[:2], second)
    # Dynamo stored the value it traced: the counter stopped; the first call says so
    assert model.calls == 1
    assert "changed calls (0 -> 1)" in caplog.text


class _PlainToy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


PlainToy = support_torch_compile(_PlainToy)


def test_a_failure_to_keep_the_trace_never_stops_a_start(tmp_path: Path, caplog, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(trace_cache, "capture", broken)
    torch._dynamo.reset()
    model = PlainToy(config=make_config(3, str(tmp_path), splitting_ops=[], compile_sizes=[]))
    with caplog.at_level(logging.WARNING, logger="atomrt.compile.decorators"):
        with torch.no_grad():
            out = model(torch.ones(3, 4))
    assert "trace is not kept (RuntimeError: something unforeseen)" in caplog.text
    assert model._compiled_forward.__code__ is model.compiled_codes[0]  # Dynamo's bytecode
    torch.testing.assert_close(out, torch.relu(model.proj(torch.ones(3, 4))).detach())
    assert _entries(tmp_path) == []


def test_keys_and_constructor_text() -> None:
    assert trace_store.describe_init((1, "a"), {"b": 2.0}) == "((1, 'a'), [('b', 2.0)])"
    assert trace_store.describe_init((object(),), {}) is None
    group = "<torch.distributed.distributed_c10d.ProcessGroup object at 0x7f00deadbeef>"

    class FakeGroupHolder:
        def __repr__(self) -> str:
            return f"TPInfo(tp_rank=1, tp_size=2, group={group})"

    text = trace_store.describe_init((FakeGroupHolder(),), {})
    assert text == "((TPInfo(tp_rank=1, tp_size=2, group=<ProcessGroup>),), [])"
    cpu = torch.device("cpu")
    key = trace_store.trace_key("h", CountingToy, "a", "backbone", cpu)
    assert key == trace_store.trace_key("h", CountingToy, "a", "backbone", cpu)
    assert key != trace_store.trace_key("h", CountingToy, "b", "backbone", cpu)
    assert key != trace_store.trace_key("g", CountingToy, "a", "backbone", cpu)
    assert key != trace_store.trace_key("h", CountingToy, "a", "draft", cpu)


@pytest.mark.parametrize(
    "source",
    [
        "L['self']._modules['x'].__class__.mro()",
        "G['torch'].ones(2)",
        "L['x'] + 1",
        "[L['x']][0]",
    ],
)
def test_sources_other_than_attribute_paths_and_sizes_are_refused(source: str) -> None:
    with pytest.raises(trace_cache.Ineligible):
        trace_cache._python_expression(source)


def test_a_size_source_reads_as_python() -> None:
    text = trace_cache._python_expression("L['input_ids'].size()[0]")
    assert text == "input_ids.size()[0]"
    ids, _ = inputs(5)
    assert eval(text, {}, {"input_ids": ids}) == 5

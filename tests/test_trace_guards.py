"""Dynamo's guards on a kept trace, recorded and checked without Dynamo (compile/trace_guards.py).

In one process, with toys at level 2 (pieces run as traced): a model built from a kept trace
whose guards hold runs no Dynamo; a function a global names, the grad mode, and a size relation
that no longer hold make it trace again, with eager's results; a guard on a value another process
could not name keeps Dynamo's bytecode and writes no entry. The cross-process cases are in
tests/test_trace_cache_processes.py.
"""

from __future__ import annotations

import enum
import logging
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from atomrt.compile import compilation_counter, support_torch_compile, trace_guards
from atomrt.runtime.config import CompilationConfig, Config

ACT = torch.relu  # read by ActToy.forward


@support_torch_compile
class ActToy(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ACT(self.proj(x))


def _config(cache_dir: Path) -> Config:
    cc = CompilationConfig(level=2, cache_dir=str(cache_dir), use_inductor=False)
    return Config(model="toy", device="cpu", compilation_config=cc)


def _call(model: nn.Module, rows: int = 3) -> torch.Tensor:
    return model(torch.linspace(-1, 1, rows * 4).reshape(rows, 4))


def _loads(tmp_path: Path, rows: int = 3) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """Build ActToy from the cache at `tmp_path` (seeded) and call it: (from the kept trace?,
    its output, eager's)."""
    torch.manual_seed(0)
    model = ActToy(config=_config(tmp_path))
    torch.manual_seed(0)
    eager = ActToy()  # no config: level 0
    before = compilation_counter.num_trace_loads
    output = _call(model, rows)
    return compilation_counter.num_trace_loads > before, output, _call(eager, rows)


def test_a_global_naming_another_function_means_a_new_trace(tmp_path: Path, monkeypatch) -> None:
    with torch.no_grad():
        assert _loads(tmp_path)[0] is False  # traced, kept
        assert _loads(tmp_path)[0] is True
        monkeypatch.setattr(f"{__name__}.ACT", torch.tanh)
        loaded, output, eager = _loads(tmp_path)
    assert not loaded
    torch.testing.assert_close(output, eager)


def test_another_grad_mode_means_a_new_trace(tmp_path: Path) -> None:
    with torch.no_grad():
        _loads(tmp_path)
    loaded, output, eager = _loads(tmp_path)  # grad enabled: Dynamo guards the grad mode
    assert not loaded
    torch.testing.assert_close(output, eager)


def test_a_guard_on_what_no_other_process_can_name_keeps_dynamos_bytecode(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(f"{__name__}.ACT", lambda x: x * 2)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="atomrt.compile.decorators"):
        loaded, output, eager = _loads(tmp_path)
        assert _loads(tmp_path)[0] is False
    assert "has no importable name" in caplog.text
    assert not list(tmp_path.glob("forward/**/*.pkl"))
    torch.testing.assert_close(output, eager)


def test_the_size_relations_are_checked_on_the_first_call() -> None:
    guards = trace_guards.Guards([], ["2 <= L['x'].size()[0]"], trace_guards.global_state())
    assert trace_guards.check(guards, {"x": torch.ones(3, 4)}, {}) is None
    assert "fails" in trace_guards.check(guards, {"x": torch.ones(1, 4)}, {})
    with pytest.raises(trace_guards.Ineligible):
        trace_guards._check_shape_text("Max(2, L['x'].size()[0]) == 4")


@pytest.mark.parametrize(
    "text, steps",
    [
        (
            "L['self']._modules['a'].eps",
            (("L", "self"), ("attr", "_modules"), ("item", "a"), ("attr", "eps")),
        ),
        ("G['SCALE']", (("G", "SCALE"),)),
        (
            "dict(type(L['m']).__dict__)['f']",
            (("L", "m"), ("type",), ("attr", "__dict__"), ("dict",), ("item", "f")),
        ),
        ("getattr(L['m'], 'a b')", (("L", "m"), ("attr", "a b"))),
        ("___odict_getitem(L['m'], 'k')", (("L", "m"), ("___odict_getitem", "k"))),
        ("__import__('torch').nn", (("module", "torch"), ("attr", "nn"))),
        ("L['t'][-1]", (("L", "t"), ("item", -1))),
    ],
)
def test_dynamo_sources_read_as_paths(text: str, steps: tuple) -> None:
    assert trace_guards.parse_path(text) == steps
    if "a b" not in text:  # messages write a path back as Dynamo wrote its source
        assert trace_guards.parse_path(trace_guards._text(steps)) == steps


@pytest.mark.parametrize("text", ["G['x']()", "list(dict.keys(L['d']))[0]", "L['x'] + 1", "L[x]"])
def test_other_sources_are_refused(text: str) -> None:
    with pytest.raises(trace_guards.Ineligible):
        trace_guards.parse_path(text)


class _Colour(enum.Enum):
    RED = 1


@pytest.mark.parametrize(
    "value",
    [
        torch.nn.functional.silu,
        torch.rsqrt,
        iter,
        torch.ops.aten,
        torch.ops.aten.add,
        torch.ops.aten.add.Tensor,
        _Colour.RED,
        types,
        torch.nn.Linear,
    ],
)
def test_objects_are_named_as_any_process_imports_them(value) -> None:
    assert trace_guards.resolve(trace_guards.object_ref(value)) is value


def test_an_object_without_an_importable_name_is_refused() -> None:
    def local() -> None: ...

    with pytest.raises(trace_guards.Ineligible):
        trace_guards.object_ref(local)
    with pytest.raises(trace_guards.Ineligible):
        trace_guards.object_ref(object())
    # a name this process cannot resolve is no object: the identity guard fails, nothing raises
    assert trace_guards.resolve(("op", "aten::no_such_op")) is None
    assert trace_guards.resolve(("fn", "no_such_module_here", "f")) is None


def test_a_guard_of_an_unknown_kind_is_refused() -> None:
    guard = types.SimpleNamespace(name="L['x']", create_fn=None, code_list=None)
    entry = types.SimpleNamespace(guard_type="WEAKREF_ALIVE", orig_guard=guard, value=None)
    with pytest.raises(trace_guards.Ineligible, match="WEAKREF_ALIVE"):
        trace_guards.record([entry], {}, {})


def test_a_hasattr_guard_of_either_torch_form_is_checked() -> None:
    """Newer torch guards the base with the attribute as a keyword; torch 2.8, `base.attr`."""
    import functools

    holder = types.SimpleNamespace(flag=1)
    newer = types.SimpleNamespace(
        name="L['m']", create_fn=functools.partial(print, attr="flag"), code_list=None
    )
    older = types.SimpleNamespace(name="L['m'].flag", create_fn=print, code_list=None)
    for guard, value in ((newer, holder), (older, holder.flag)):
        entry = types.SimpleNamespace(guard_type="HASATTR", orig_guard=guard, value=value)
        guards = trace_guards.record([entry], {}, trace_guards.global_state())
        assert trace_guards.check(guards, {"m": holder}, {}) is None
        assert trace_guards.check(guards, {"m": types.SimpleNamespace()}, {}) is not None

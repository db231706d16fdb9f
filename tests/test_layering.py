"""The package's import graph points one way, lazy imports included.

Layers, lowest first: the runtime leaves (config, config_sections, config_io, envs, forward_context,
sampling_params, decision) <- compile, graphs, distributed <- workers <- runtime.executors <-
runtime.driver <- runtime.entrypoints and runtime.bench (and the `atomrt.runtime` package, which
re-exports `LLM`). A module may import its own layer or a lower one, and the module graph has no
cycle. The graph is read from the source (every `import` statement, those inside functions too);
imports under `if TYPE_CHECKING:` are type annotations only and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FOLDERS = {
    "runtime": "atomrt.runtime",
    "workers": "atomrt.workers",
    "compile": "atomrt.compile",
    "graphs": "atomrt.graphs",
    "distributed": "atomrt.distributed",
}
LEAVES = {
    f"atomrt.runtime.{m}"
    for m in (
        "config",
        "config_sections",
        "config_io",
        "envs",
        "forward_context",
        "sampling_params",
        "inputs",
        "decision",
    )
}
LAYERS = [  # (prefix, layer); the longest matching prefix wins
    ("atomrt.compile", 1),
    ("atomrt.graphs", 1),
    ("atomrt.distributed", 1),
    ("atomrt.workers", 2),
    ("atomrt.runtime.executors", 3),
    ("atomrt.runtime.driver", 4),
    ("atomrt.runtime.entrypoints", 5),
    ("atomrt.runtime.bench", 5),
]
LAYER_NAMES = [
    "runtime leaves",
    "compile / graphs / distributed",
    "workers",
    "runtime.executors",
    "runtime.driver",
    "runtime.entrypoints / bench",
]


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The atomrt modules a file imports anywhere in it (not under `if TYPE_CHECKING:`)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("atomrt."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("atomrt."):
            for a in node.names:  # `from package import module` names the module itself
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in known}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(p, set(mods)) - {m} for m, p in mods.items()}


def layer_of(module: str) -> int:
    if module in LEAVES:
        return 0
    if module == "atomrt.runtime":
        return 5  # the package re-exports LLM, AsyncLLM (its __getattr__ imports the entry points)
    matches = [
        (len(prefix), layer)
        for prefix, layer in LAYERS
        if module == prefix or module.startswith(prefix + ".")
    ]
    if not matches:
        raise AssertionError(
            f"{module}: in no layer; add it to LEAVES or LAYERS in {Path(__file__).name}"
        )
    return max(matches)[1]


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return cycles


def test_no_import_cycle() -> None:
    assert find_cycles(import_graph()) == []


def test_imports_point_down_the_layers() -> None:
    bad = [
        f"{src} ({LAYER_NAMES[layer_of(src)]}) imports {dst} ({LAYER_NAMES[layer_of(dst)]})"
        for src, dsts in sorted(import_graph().items())
        for dst in sorted(dsts)
        if layer_of(dst) > layer_of(src)
    ]
    assert bad == []


def test_every_module_has_a_layer() -> None:
    for module in modules():
        layer_of(module)


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    """The reader sees lazy imports and `from package import module`, skips TYPE_CHECKING blocks,
    and a cycle through a lazy import is found."""
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from atomrt.workers.kernels import device_info\n"
        "if TYPE_CHECKING:\n    from atomrt.runtime.driver.engine import LLMEngine\n"
        "def f():\n    import atomrt.runtime.config\n    from atomrt.runtime.driver.scheduler import Scheduler\n"
    )
    known = set(modules())
    assert imports_of(src, known) == {
        "atomrt.workers.kernels.device_info",
        "atomrt.runtime.config",
        "atomrt.runtime.driver.scheduler",
    }
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("atomrt.runtime.something_new")
    assert (
        layer_of("atomrt.runtime.driver.engine")
        > layer_of("atomrt.runtime.executors.base")
        > layer_of("atomrt.workers.worker")
        > layer_of("atomrt.graphs.buckets")
        > layer_of("atomrt.runtime.config")
    )

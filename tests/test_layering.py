"""The package's import graph points one way, lazy imports included: DESIGN.md's rules, file by
file.

Layers, lowest first: the runtime leaves (config, config_sections, config_io, envs, forward_context,
sampling_params, decision, and the `atomrt.runtime` package itself, which imports nothing) <-
compile, graphs, distributed <- workers <- runtime.executors <- runtime.driver <-
runtime.entrypoints and runtime.bench <- the top-level `atomrt` package (the user's names, `LLM`
and the rest, imported on first use). A module may import its own layer or a lower one; the module graph has no cycle
(so no lazy import dodges one); nothing outside runtime.entrypoints imports an entry point. The
graph is read from the source: every `import` statement (relative ones resolved, those inside
functions too) and every `importlib.import_module` / `__import__` of a constant name; imports under
`if TYPE_CHECKING:` are type annotations only and are left out. A finding names the file and line.

What the tree breaks today is listed below, one reason each, in files the fix belongs to; a new
finding fails the test.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FOLDERS = {
    "atomrt": "atomrt",
    "runtime": "atomrt.runtime",
    "workers": "atomrt.workers",
    "compile": "atomrt.compile",
    "graphs": "atomrt.graphs",
    "distributed": "atomrt.distributed",
}
LEAVES = {
    f"atomrt.runtime.{m}"
    for m in (
        "bytecode_cache",
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
    "the top-level atomrt (the user's names)",
]


# (importer, imported) -> why: import edges left out of the graph (none today)
ALLOWED_EDGES: dict[tuple[str, str], str] = {}

_BENCH = "drives LLM / EngineArgs as a user's script does; belongs beside the entry points"
# modules outside runtime.entrypoints that import an entry point
ENTRY_POINT_IMPORTERS = {
    "atomrt.runtime.bench.dp": _BENCH,
    "atomrt.runtime.bench.latency": _BENCH,
    "atomrt.runtime.bench.serve": _BENCH,
    "atomrt.runtime.bench.serve_figures": _BENCH,
    "atomrt.runtime.bench.serve_views": _BENCH,
    "atomrt.runtime.bench.spec_decode": _BENCH,
    "atomrt.runtime.bench.startup": _BENCH,
    "atomrt.runtime.bench.targets": _BENCH,
    "atomrt.runtime.bench.throughput": _BENCH,
}
ENTRY_POINTS = "atomrt.runtime.entrypoints"


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


def _import_module_call(node: ast.AST) -> str:
    """The module a call `importlib.import_module("...")` / `import_module("...")` /
    `__import__("...")` names by a string constant, else ""."""
    if not isinstance(node, ast.Call) or not node.args:
        return ""
    func, arg = node.func, node.args[0]
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name in ("import_module", "__import__") and isinstance(arg, ast.Constant):
        return arg.value if isinstance(arg.value, str) else ""
    return ""


def import_sites(path: Path, known: set[str], module: str = "") -> list[tuple[int, str, bool]]:
    """(line, atomrt module, lazy) for every import in a file, not under `if TYPE_CHECKING:`: import
    statements (relative ones resolved against `module`, the file's own module name) and calls of
    `importlib.import_module` / `__import__` with a constant name. Lazy: inside a function."""
    is_package = path.name == "__init__.py"
    found: list[tuple[int, str, bool]] = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def add(line: int, name: str, lazy: bool) -> None:
        if name.startswith("atomrt.") and (line, name, lazy) not in found:
            found.append((line, name, lazy))

    def visit(node: ast.AST, lazy: bool) -> None:
        if _type_checking_block(node):
            for child in node.orelse:
                visit(child, lazy)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                add(node.lineno, a.name, lazy)
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node)
            for a in node.names:  # `from package import module` names the module itself
                sub = f"{source}.{a.name}"
                add(node.lineno, sub if sub in known else source, lazy)
        elif name := _import_module_call(node):
            add(node.lineno, name, lazy)
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return [site for site in found if site[1] in known]


def imports_of(path: Path, known: set[str], module: str = "") -> set[str]:
    """The atomrt modules a file imports anywhere in it (not under `if TYPE_CHECKING:`)."""
    return {name for _, name, _ in import_sites(path, known, module)}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {
        m: imports_of(p, set(mods), m) - {m} - {dst for src, dst in ALLOWED_EDGES if src == m}
        for m, p in mods.items()
    }


def layer_of(module: str) -> int:
    if module in LEAVES:
        return 0
    if module == "atomrt.runtime":
        return 0  # the package's __init__ imports nothing (the user's names are atomrt's)
    if module == "atomrt":
        return len(LAYER_NAMES) - 1
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


def sites() -> list[tuple[str, str, str, bool]]:
    """(importer, "file:line", imported, lazy) for every import in the package, allowed edges left
    out."""
    mods = modules()
    return [
        (src, f"{path.relative_to(ROOT)}:{line}", dst, lazy)
        for src, path in sorted(mods.items())
        for line, dst, lazy in import_sites(path, set(mods), src)
        if dst != src and (src, dst) not in ALLOWED_EDGES
    ]


def test_no_import_cycle() -> None:
    cycles = find_cycles(import_graph())
    within = [
        f"{where} {'lazily ' if lazy else ''}imports {dst}"
        for cycle in cycles
        for src, where, dst, lazy in sites()
        if src in cycle and dst in cycle
    ]
    assert cycles == [], "\n".join(within)


def test_imports_point_down_the_layers() -> None:
    bad = [
        f"{where}: {src} ({LAYER_NAMES[layer_of(src)]}) {'lazily ' if lazy else ''}imports {dst} "
        f"({LAYER_NAMES[layer_of(dst)]})"
        for src, where, dst, lazy in sites()
        if layer_of(dst) > layer_of(src)
    ]
    assert bad == []


def _entry_point(module: str) -> bool:
    return module == ENTRY_POINTS or module.startswith(ENTRY_POINTS + ".")


def test_nothing_imports_the_entry_points() -> None:
    bad = [
        f"{where}: {src} {'lazily ' if lazy else ''}imports {dst}"
        for src, where, dst, lazy in sites()
        if _entry_point(dst) and not _entry_point(src) and src not in ENTRY_POINT_IMPORTERS
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


def test_the_reader_resolves_relative_and_dynamic_imports(tmp_path: Path) -> None:
    """Relative imports resolve against the file's module (a package's `__init__` is the package),
    a constant `importlib.import_module` / `__import__` counts, and each site has its line and
    whether it sits in a function."""
    src = tmp_path / "engine.py"
    src.write_text(
        "import importlib\n"
        "from . import planner\n"
        "from .scheduler import Scheduler\n"
        "from ..executors import base\n"
        "def f(name):\n"
        "    importlib.import_module('atomrt.runtime.entrypoints.llm')\n"
        "    __import__('atomrt.runtime.config')\n"
        "    importlib.import_module(name)\n"
    )
    known = set(modules())
    assert import_sites(src, known, "atomrt.runtime.driver.engine") == [
        (2, "atomrt.runtime.driver.planner", False),
        (3, "atomrt.runtime.driver.scheduler", False),
        (4, "atomrt.runtime.executors.base", False),
        (6, "atomrt.runtime.entrypoints.llm", True),
        (7, "atomrt.runtime.config", True),
    ]
    init = tmp_path / "__init__.py"
    init.write_text("from .scheduler import Scheduler\nfrom .. import config\n")
    assert imports_of(init, known, "atomrt.runtime.driver") == {
        "atomrt.runtime.driver.scheduler",
        "atomrt.runtime.config",
    }

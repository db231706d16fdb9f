"""The grammar-backend interface (runtime/driver/grammar_backend.py): the registry matches the
config's names, no module but the xgrammar backend imports xgrammar (read from the source), and
an engine loads it only for its first constrained request."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from atomrt.runtime.config import GRAMMAR_BACKENDS, ConfigError, StructuredOutputsConfig
from atomrt.runtime.driver.grammar_backend import GrammarBackend, GrammarMatcher
from atomrt.runtime.driver.grammar_compiler import BACKENDS

ROOT = Path(__file__).parent.parent
# Modules that may import xgrammar, and why.
XGRAMMAR_IMPORTERS = {
    "runtime/driver/xgrammar_backend.py": "the backend",
    "workers/runner/logit_additions.py": "its CPU kernel applies any backend's packed mask",
}


def test_every_configurable_backend_has_a_class_and_no_other() -> None:
    assert set(BACKENDS) == set(GRAMMAR_BACKENDS)
    for name, cls in BACKENDS.items():
        assert issubclass(cls, GrammarBackend), name
        assert StructuredOutputsConfig(backend=name).backend == name
    with pytest.raises(ConfigError, match="structured_outputs_config.backend"):
        StructuredOutputsConfig(backend="outlines")


def _imports_xgrammar(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        if any(n == "xgrammar" or n.startswith("xgrammar.") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_the_xgrammar_backend_imports_xgrammar() -> None:
    folders = ("runtime", "workers", "compile", "graphs", "distributed")
    found = {
        str(p.relative_to(ROOT)): lines
        for folder in folders
        for p in sorted((ROOT / folder).rglob("*.py"))
        if (lines := _imports_xgrammar(p))
    }
    assert set(found) <= set(XGRAMMAR_IMPORTERS), found
    assert "runtime/driver/xgrammar_backend.py" in found


def test_the_matcher_interface_is_the_backends_primitives() -> None:
    abstract = GrammarMatcher.__abstractmethods__
    assert abstract == {"accept", "rollback", "is_terminated", "fill"}
    assert GrammarBackend.__abstractmethods__ == {
        "__init__",
        "validate",
        "parse",
        "compile",
        "matcher",
    }


def test_an_engine_imports_xgrammar_for_its_first_constrained_request_only() -> None:
    """Importing xgrammar takes seconds (it imports transformers): an engine on the embedded
    model starts and serves plain requests without it; a constrained request loads it."""
    code = (
        "import sys\n"
        "from atomrt.runtime import SamplingParams\n"
        "from atomrt.runtime.config import DEFAULT_MODEL\n"
        "from atomrt.runtime.entrypoints.llm import LLM\n"
        "llm = LLM(DEFAULT_MODEL, device='cpu', enforce_eager=True, max_num_seqs=4,\n"
        "          num_kv_blocks=64)\n"
        "llm.generate(['Hello'], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "print('plain', 'xgrammar' in sys.modules)\n"
        "so = SamplingParams(max_tokens=8, structured_outputs={'regex': '(yes|no)'})\n"
        "out = llm.generate(['Yes or no?'], so, use_tqdm=False)[0].outputs[0]\n"
        "print('constrained', 'xgrammar' in sys.modules, out.text, out.finish_reason)\n"
        "llm.shutdown()\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert "plain False" in lines, run.stdout[-2000:]
    last = lines[-1].split()
    assert last[:2] == ["constrained", "True"] and last[2] in ("yes", "no") and last[3] == "stop"

"""The grammar-backend interface (runtime/driver/grammar_backend.py): the registry matches the
config's names, no module but the xgrammar backend imports xgrammar (read from the source), an
engine loads it only for its first constrained request, and a second backend (a small one written
here, for choice lists) runs constrained requests with no change outside its own class."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from grammar_harness import build_tiny_bpe

from atomrt import SamplingParams
from atomrt.runtime.config import GRAMMAR_BACKENDS, ConfigError, StructuredOutputsConfig
from atomrt.runtime.driver.grammar_backend import GrammarBackend, GrammarMatcher
from atomrt.runtime.driver.grammar_compiler import BACKENDS
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import StructuredOutputsParams

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
        "from atomrt import SamplingParams\n"
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


class ChoiceMatcher(GrammarMatcher):
    """Where an output stands among a choice list's token sequences (each choice as the tokenizer
    encodes it), then a stop token."""

    def __init__(self, choices: list[tuple[int, ...]], stops: list[int], vocab_size: int) -> None:
        self.choices, self.stops, self.vocab_size = choices, stops, vocab_size
        self.tokens: list[int] = []
        self.ended = False
        self.fills = self.rollbacks = 0

    def _allowed(self) -> list[int]:
        if self.ended:
            return []
        n = len(self.tokens)
        live = [c for c in self.choices if list(c[:n]) == self.tokens]
        return sorted(
            {c[n] for c in live if len(c) > n}
            | (set(self.stops) if any(len(c) == n for c in live) else set())
        )

    def accept(self, token_id: int) -> bool:
        if token_id not in self._allowed():
            return False
        self.ended = token_id in self.stops
        if not self.ended:
            self.tokens.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        self.rollbacks += 1
        if num_tokens and self.ended:
            self.ended, num_tokens = False, num_tokens - 1
        del self.tokens[len(self.tokens) - num_tokens :]

    @property
    def is_terminated(self) -> bool:
        return self.ended

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.fills += 1
        bits = np.zeros(bitmask.shape[1] * 32, dtype=bool)
        bits[self._allowed()] = True
        bitmask[row] = torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").copy())


class ChoiceBackend(GrammarBackend):
    """Choice lists only: every request's output is one of its choices."""

    matchers: list[ChoiceMatcher] = []

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.hf, self.vocab_size, self.stops = hf_tokenizer, vocab_size, list(stop_token_ids)

    @staticmethod
    def validate(so: StructuredOutputsParams) -> Any:
        if so.kind != "choice":
            raise ValueError(f"structured_outputs.{so.kind}: the choice backend takes choices")
        return list(so.choice)

    @staticmethod
    def parse(so: StructuredOutputsParams, checked: Any) -> Any:
        return checked

    def compile(self, grammar: Any) -> Any:
        return [tuple(self.hf.encode(c, add_special_tokens=False)) for c in grammar]

    def matcher(self, compiled: Any) -> ChoiceMatcher:
        m = ChoiceMatcher(compiled, self.stops, self.vocab_size)
        ChoiceBackend.matchers.append(m)
        return m


def test_a_second_backend_runs_constrained_requests(tmp_path, monkeypatch) -> None:
    import atomrt.runtime.config_sections as sections

    monkeypatch.setitem(BACKENDS, "choices", ChoiceBackend)
    monkeypatch.setattr(ChoiceBackend, "matchers", [])
    monkeypatch.setattr(sections, "GRAMMAR_BACKENDS", (*GRAMMAR_BACKENDS, "choices"))
    model = build_tiny_bpe(tmp_path / "model")
    choices = ["yes", "no", "maybe not at all", "never ever again"]
    prompt = "Pick yes, no, maybe not at all or never ever again."  # n-gram drafts to verify
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=16, structured_outputs={"choice": choices}
        )
        for i in range(6)
    ]
    with LLM(
        str(model),
        device="cpu",
        enforce_eager=True,
        num_kv_blocks=64,
        structured_outputs_config={"backend": "choices"},
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
    ) as llm:
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        spec = llm.engine.stats.spec_decode
        bad = llm.generate(
            [prompt],
            SamplingParams(max_tokens=4, structured_outputs={"regex": "a+"}),
            use_tqdm=False,
        )[0]
    for out in outs:
        assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop", out
    assert len({out.outputs[0].text for out in outs}) > 1  # sampled: the backend's masks decide
    assert len(ChoiceBackend.matchers) == len(params) and all(
        m.fills for m in ChoiceBackend.matchers
    )
    assert "the choice backend takes choices" in bad.error
    assert spec.num_drafts > 0  # verify rows filled through the interface, drafts rolled back
    assert sum(m.rollbacks for m in ChoiceBackend.matchers) > 0

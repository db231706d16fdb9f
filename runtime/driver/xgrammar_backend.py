"""The xgrammar backend (the library vLLM and SGLang use): `XgrammarBackend`, `XgrammarMatcher`.

A constraint becomes a grammar in two parts:

- parsing (`parse`): a JSON schema (walked and rewritten first: runtime/driver/json_schema/), a
  regex, an EBNF grammar, a choice list or a structural tag becomes an xgrammar `Grammar`; what does
  not parse is a ValueError naming the field. Usually milliseconds, but a schema's long string
  bounds can take xgrammar seconds;
- compiling: the grammar against the tokenizer's vocabulary, the token-mask cache that makes each
  step's mask cheap (a complex schema can take seconds). xgrammar releases the GIL while it
  compiles, so the step loop runs on beside the compile threads.

xgrammar is imported on first use (`_xgr`): importing it takes seconds (it imports transformers),
which an engine that never sees a constrained request does not pay.
"""

from __future__ import annotations

import functools
import json
import re
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

import torch

from atomrt.runtime.config_sections import usable_cpu_count
from atomrt.runtime.driver.grammar_backend import GrammarBackend, GrammarMatcher
from atomrt.runtime.driver.json_schema import prepare_schema
from atomrt.runtime.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr


# a step with this many constrained rows fills their masks on threads; fewer stay on the calling
# thread: on an H100 host (bench_grammar_step.py --device cuda --bs 64, Llama 3's vocabulary) 16
# rows on threads made the step 2099 us against 1865 us on the calling thread
PARALLEL_FILL_ROWS = 32
MAX_FILL_THREADS = 8
MIN_FILL_CORES = 8  # on fewer cores the fill's threads would take those the step loop needs


def fill_threads(cores: int) -> int:
    """The threads a large batch's mask fill runs on, on a machine of `cores` usable cores: half
    of them, at most `MAX_FILL_THREADS`; 1 below `MIN_FILL_CORES`. Each fill call pays tens of us
    to start its threads, so small batches fill on the calling thread (`PARALLEL_FILL_ROWS`)."""
    if cores < MIN_FILL_CORES:
        return 1
    return min(MAX_FILL_THREADS, cores // 2)


def _xgr() -> ModuleType:
    import xgrammar  # on first use: see the module docstring

    return xgrammar


class XgrammarMatcher(GrammarMatcher):
    """One sequence's `xgrammar.GrammarMatcher`. Whether it terminated is kept here: it changes
    only when a stop token is accepted or rolled back, and the stop rules and the mask fill ask
    for it of every row each step (each ask a call into xgrammar). `_ahead`: the token the
    backend accepted ahead (`XgrammarBackend.accept_ahead`) and xgrammar's answer, until the
    stop rules' `accept` of it reads that answer."""

    _ahead: Optional[tuple[int, bool]] = None

    def __init__(
        self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int], vocab_size: int
    ) -> None:
        self.matcher = _xgr().GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.vocab_size = vocab_size
        self._stops = frozenset(self.matcher.stop_token_ids)  # those it terminates on
        self._terminated = self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self._ahead is not None:
            if self._ahead[0] == token_id:
                accepted, self._ahead = self._ahead[1], None
                return accepted
            self.settle()  # another token than the one accepted ahead
        accepted = self.matcher.accept_token(token_id)
        if accepted and token_id in self._stops:
            self._terminated = self.matcher.is_terminated()
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.settle()
        self.matcher.rollback(num_tokens)
        self._terminated = self.matcher.is_terminated()

    def settle(self) -> bool:
        ahead, self._ahead = self._ahead, None
        if ahead is None or not ahead[1]:
            return False
        self.matcher.rollback(1)
        self._terminated = self.matcher.is_terminated()
        return True

    def _took_ahead(self, token_id: int, accepted: bool) -> None:
        self._ahead = (token_id, accepted)
        if accepted and token_id in self._stops:
            self._terminated = self.matcher.is_terminated()

    @property
    def is_terminated(self) -> bool:
        return self._terminated

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class XgrammarBackend(GrammarBackend):
    """xgrammar over one tokenizer: its `TokenizerInfo`, compiler and batch mask filler."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _xgr()
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self.vocab_size = self.info.vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        threads = fill_threads(usable_cpu_count())
        self._parallel = xgr.BatchGrammarMatcher(max_threads=threads) if threads > 1 else None

    @staticmethod
    def validate(so: StructuredOutputsParams) -> Any:
        """A JSON schema constraint, or the schemas inside a structural tag, walked and rewritten
        (runtime/driver/json_schema/: xgrammar drops or approximates some keywords; a ValueError
        naming the keyword and its path); other constraints as they are."""
        value = getattr(so, so.kind)
        if so.kind not in ("json", "structural_tag"):
            return value
        try:
            parsed = json.loads(value) if isinstance(value, str) else value
            if so.kind == "structural_tag":
                return _prepare_tag_schemas(parsed, "")
            return prepare_schema(parsed)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{so.kind}: {e}") from None

    @staticmethod
    def parse(so: StructuredOutputsParams, checked: Any) -> xgr.Grammar:
        xgr = _xgr()
        kind, value = so.kind, checked
        try:
            if kind in ("json", "json_object"):
                schema = '{"type": "object"}' if kind == "json_object" else value
                max_whitespace = None if so.disable_any_whitespace else so.max_whitespace
                grammar = xgr.Grammar.from_json_schema(
                    schema if isinstance(schema, str) else json.dumps(schema),
                    any_whitespace=not so.disable_any_whitespace,
                    strict_mode=kind == "json",
                    max_whitespace_cnt=max_whitespace,
                )
                return _json_rewrites(grammar, max_whitespace)
            if kind == "regex":
                return xgr.Grammar.from_regex(value)
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(value)
            if kind == "choice":  # each choice a JSON-escaped EBNF literal
                return xgr.Grammar.from_ebnf(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
                )
            return xgr.Grammar.from_structural_tag(
                value if isinstance(value, str) else json.dumps(value)
            )
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind}: {_reason(e)}") from None

    def compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        return self._compiler.compile_grammar(grammar)

    def matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarMatcher:
        return XgrammarMatcher(compiled, self.stop_token_ids, self.vocab_size)

    def fill_rows(
        self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]
    ) -> None:
        """One call for the rows (xgrammar fills them through DLPack), on threads when there are
        `PARALLEL_FILL_ROWS` or more and the machine has the cores (`fill_threads`): a step's masks
        must be out before its forward ends, or the GPU waits for them."""
        inner = [m.matcher for m in matchers]  # this backend's: XgrammarMatcher
        batch = self._batch
        if self._parallel is not None and len(rows) >= PARALLEL_FILL_ROWS:
            batch = self._parallel
        batch.batch_fill_next_token_bitmask(inner, bitmask, rows)

    def accept_ahead(self, matchers: list[GrammarMatcher], tokens: list[int]) -> bool:
        """One call into xgrammar for the batch's tokens, on the calling thread. Split over Python
        threads it ran slower, not faster: each part's thread needs the GIL to start and to hand
        its answers back while the step loop holds it. `bench_grammar_step.py --device cuda` on an
        H100 host (16 cores, Llama 3's vocabulary, user_profiles.json) took 5.1 us a row in one
        call at 16 rows and 11.5 us a row over 8 threads at 64; on a 2-core CPU a 64-row batch
        took 176-221 us in one call against 427-454 us in two threads."""
        answers = _batch_accept([m.matcher for m in matchers], tokens)  # XgrammarMatcher's
        for m, token, accepted in zip(matchers, tokens, answers):
            m._took_ahead(token, accepted)
        return True


@functools.cache
def core_batch_accept() -> Any:
    """The library call under xgrammar's `BatchGrammarMatcher.batch_accept_token` (xgrammar 0.2's
    `base._core`), None where its layout differs."""
    core = getattr(getattr(_xgr(), "base", None), "_core", None)
    return getattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token", None)


def _batch_accept(matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> list[bool]:
    """xgrammar's batch accept. Its Python wrapper reads the answers back one call each (about
    0.6 us a row, longer than most accepts); here one call asks whether any token was refused,
    and when none was (a token sampled under its mask never is) nothing more is read."""
    raw = core_batch_accept()
    if raw is None:  # another xgrammar layout: its wrapper
        return _xgr().BatchGrammarMatcher.batch_accept_token(matchers, tokens)
    answers = raw([m._handle for m in matchers], tokens, False)
    if 0 not in answers:  # one call into the library's array
        return [True] * len(matchers)
    return [bool(a) for a in answers]


def _prepare_tag_schemas(node: Any, where: str) -> Any:
    """A structural tag with each `{"type": "json_schema", "json_schema": ...}` format's schema
    walked and rewritten like a plain JSON schema constraint, so a keyword the backend would drop
    inside a tag is refused too (the error names the format's place in the tag)."""
    if isinstance(node, list):
        return [_prepare_tag_schemas(v, f"{where}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, v in node.items():
        at = f"{where}.{key}" if where else key
        if key == "json_schema" and node.get("type") == "json_schema":
            try:
                out[key] = prepare_schema(v)
            except ValueError as e:
                raise ValueError(f"{at}: {e}") from None
        else:
            out[key] = _prepare_tag_schemas(v, at)
    return out


# xgrammar's rule for one character of a string with minLength / maxLength (a bounded repeat of
# it: cheap at any length) lets raw control characters through, which JSON forbids;
# `_json_rewrites` swaps it for any character but a control character, a quote or a backslash.
# Such a string is therefore written without escape sequences: with an escape alternative in the
# repeated rule xgrammar cannot precompute the token mask inside the string, and filling one row
# took about 1000x longer (26 ms against 21 us on a 49k vocabulary). Every output still validates.
_LENGTH_CHAR = r"(([^\"\\\r\n]))"
_JSON_CHAR = r"(([^\0-\x1f\"\\]))"


# xgrammar writes JSON's bounded whitespace (`max_whitespace_cnt`) as a repeat of a one-character
# rule (`whitespace_3{0, 4}`), whose count it tracks while matching: in those places it could not
# precompute the token mask, and a fill there took ~100 us against ~20 elsewhere (replaying random
# valid outputs of user_profiles.json over Llama 3's 128k vocabulary on a 2-core CPU: 40 us a
# fill on average at a bound of 4, 60-70 at 8 to 16, 20 unbounded). `_json_rewrites` writes the
# repeat out as alternatives, one per count (`("" | [ \n\r\t] | [ \n\r\t] [ \n\r\t] | ...)`):
# the same language, filled as fast as unbounded whitespace (~22 us at 4 and 16). They grow with
# the square of the bound, so only bounds up to `INLINE_WHITESPACE_MAX` are written out.
INLINE_WHITESPACE_MAX = 16
_WHITESPACE_RULE = re.compile(r"^(\w+) ::= \(\(\[ \\n\\r\\t\]\)\)$", re.M)
_WS_CHAR = r"[ \n\r\t]"


def _json_rewrites(grammar: xgr.Grammar, max_whitespace: Optional[int]) -> xgr.Grammar:
    """A JSON schema's grammar with its length-bounded strings JSON-safe and its bounded whitespace
    written out (see above); the grammar itself when neither is in it."""
    text = str(grammar)
    rewritten = text.replace(_LENGTH_CHAR, _JSON_CHAR)
    if max_whitespace is not None and max_whitespace <= INLINE_WHITESPACE_MAX:
        names = _WHITESPACE_RULE.findall(rewritten)
        if names:
            counts = [" ".join([_WS_CHAR] * k) for k in range(1, max_whitespace + 1)]
            inline = "(" + " | ".join(['""', *counts]) + ")"
            alternation = "|".join(names)
            repeat = re.compile(rf"\b(?:{alternation})\{{0, {max_whitespace}\}}")
            rewritten = repeat.sub(lambda _: inline, rewritten)
    if rewritten == text:
        return grammar
    return _xgr().Grammar.from_ebnf(rewritten)


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location ("[time] file.cc:123: ...")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    head, sep, rest = text.partition(".cc:")
    if sep:
        text = rest.split(": ", 1)[-1]
    return text

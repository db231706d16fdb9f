"""`GrammarCompiler`: requests' structured-output constraints -> compiled grammars, off the step loop.

The backend is xgrammar (the library vLLM and SGLang use). A constraint becomes a grammar in two
parts:

- parsing (`parse`, at add_request, microseconds to milliseconds): a JSON schema, a regex, an EBNF
  grammar, a choice list or a structural tag becomes an xgrammar `Grammar`; what does not parse is a
  ValueError naming the field, before the request is queued;
- compiling (`compile`, on a thread pool): the grammar against the tokenizer's vocabulary, the
  token-mask cache that makes each step's mask cheap. This is the slow part (a complex schema can
  take seconds), so the request waits for it in its own state while others step
  (runtime/driver/structured_outputs.py), and fails once it waited
  `structured_outputs_config.grammar_compile_timeout_s`.

Compiled grammars are kept in an LRU cache keyed by the constraint (`StructuredOutputsParams.
cache_key`), one per engine: every DP rank's requests share it. xgrammar releases the GIL while it
compiles, so the step loop runs on beside the compile threads.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from atomrt.runtime.config import StructuredOutputsConfig
from atomrt.runtime.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class CompileStats:
    """Compiles since start, for metrics and benchmarks: requests whose grammar was compiled for
    them (`misses`) or found compiled (`hits`), and the seconds each kind waited from add_request
    until their grammar was ready."""

    misses: int = 0
    hits: int = 0
    miss_seconds: float = 0.0
    hit_seconds: float = 0.0
    timeouts: int = 0  # requests failed for waiting longer than the compile budget


# JSON Schema keywords the grammar cannot enforce (xgrammar would accept them and not enforce
# them): refused by name rather than ignored. `oneOf` branches that may overlap are enforced as
# `anyOf` (docs/serving.md).
UNENFORCED_KEYWORDS = (
    "uniqueItems",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "contains",
    "minContains",
    "maxContains",
    "propertyNames",
    "unevaluatedItems",
)
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_DATA = ("enum", "const", "default", "examples", "description", "title", "required")


def check_schema(schema: Any, where: str = "structured_outputs.json") -> None:
    """Refuse a JSON schema that uses a keyword the grammar would not enforce (ValueError)."""
    if isinstance(schema, list):
        for item in schema:
            check_schema(item, where)
        return
    if not isinstance(schema, dict):
        return
    shaped = [k for k in ("pattern", "format") if k in schema]
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    if shaped and lengths:  # xgrammar keeps the shape and drops the length
        raise ValueError(
            f"{where}: {lengths[0]!r} beside {shaped[0]!r} cannot be enforced while decoding; "
            "put the length in the pattern (or check it on the output)"
        )
    for key, value in schema.items():
        if key in UNENFORCED_KEYWORDS and not (key == "uniqueItems" and value is False):
            raise ValueError(
                f"{where}: the keyword {key!r} cannot be enforced while decoding; remove it (and "
                "check it on the output)"
            )
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise ValueError(
                f"{where}: 'allOf' of more than one schema cannot be enforced while decoding; "
                "merge them into one"
            )
        if key in _DATA:
            continue
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            for sub in value.values():
                check_schema(sub, where)
        else:
            check_schema(value, where)


# A string with a length bound and no pattern: xgrammar's own rule for it lets raw control
# characters through (invalid JSON) and no escapes, so it becomes this pattern: the same lengths,
# without control characters, quotes or backslashes.
_BOUNDED_STRING = '^[^\\x00-\\x1f"\\\\]{%d,%s}$'


def _bounded_strings(schema: Any) -> Any:
    """`schema` with every length-bounded string without a pattern given `_BOUNDED_STRING`."""
    if isinstance(schema, list):
        return [_bounded_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA else _bounded_strings(v)) for k, v in schema.items()}
    for key in _NAMED_SCHEMAS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _bounded_strings(s) for name, s in schema[key].items()}
    bounded = "minLength" in schema or "maxLength" in schema
    plain = not any(k in schema for k in ("pattern", "format", "enum", "const"))
    if schema.get("type") == "string" and bounded and plain:
        hi = out.pop("maxLength", None)
        out["pattern"] = _BOUNDED_STRING % (out.pop("minLength", 0), "" if hi is None else hi)
    return out


def parse(so: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar of a constraint; a ValueError naming the field when it does not parse."""
    kind = so.kind
    value = getattr(so, kind)
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        check_schema(schema)
        value = _bounded_strings(schema)
    try:
        if kind in ("json", "json_object"):
            schema = '{"type": "object"}' if kind == "json_object" else value
            return xgr.Grammar.from_json_schema(
                schema if isinstance(schema, str) else json.dumps(schema),
                any_whitespace=not so.disable_any_whitespace,
                strict_mode=kind == "json",
                max_whitespace_cnt=so.max_whitespace if not so.disable_any_whitespace else None,
            )
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


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location ("[time] file.cc:123: ...")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    head, sep, rest = text.partition(".cc:")
    if sep:
        text = rest.split(": ", 1)[-1]
    return text


COMPILE_NICENESS = 10  # how much lower than the step loop's a compile thread's CPU priority is


def _below_the_step_loop() -> None:
    """A compile thread yields the CPU to the step loop (and the workers' threads) where both
    want it: its scheduling priority, per thread on Linux, goes down by COMPILE_NICENESS."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
        pass


class GrammarCompiler:
    """One engine's compiler: its tokenizer's vocabulary, the compile threads and the LRU cache."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        config: StructuredOutputsConfig,
    ) -> None:
        """`vocab_size`: the model's (its logits' width, which may exceed the tokenizer's);
        `stop_token_ids`: the tokens a finished grammar allows (the engine's EOS ids)."""
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self.stop_token_ids = list(stop_token_ids)
        self._xgr = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.pool = ThreadPoolExecutor(
            max_workers=config.grammar_compile_threads,
            thread_name_prefix="atomrt-grammar",
            initializer=_below_the_step_loop,
        )
        self.timeout_s = float(config.grammar_compile_timeout_s)
        self.cache_size = config.grammar_cache_size
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache is read by the step loop, filled by the threads
        self.stats = CompileStats()

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def compile(self, so: StructuredOutputsParams) -> Future:
        """The compiled grammar of `so` as a future: done at once when cached, else compiled on a
        compile thread. Parses first (a ValueError naming the field, synchronously)."""
        key = so.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        grammar = parse(so)
        future = self.pool.submit(self._compile, grammar)
        with self._lock:
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return future

    def _compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        compiled = self._xgr.compile_grammar(grammar)
        logger.debug("grammar compiled in %.3f s", time.perf_counter() - start)
        return compiled

    def record(self, waited_s: float, hit: bool) -> None:
        """A request's grammar was ready after `waited_s` (hit: it was compiled already)."""
        s = self.stats
        if hit:
            s.hits += 1
            s.hit_seconds += waited_s
        else:
            s.misses += 1
            s.miss_seconds += waited_s

    def shutdown(self) -> None:
        """Stop taking compiles; a compile running now ends in its thread, unwaited."""
        self.pool.shutdown(wait=False, cancel_futures=True)

"""`GrammarCompiler`: requests' structured-output constraints -> compiled grammars, off the step loop.

The backend is xgrammar (the library vLLM and SGLang use). A constraint becomes a grammar in two
parts:

- parsing (`parse`): a JSON schema (walked and rewritten first: runtime/driver/json_schema.py), a
  regex, an EBNF grammar, a choice list or a structural tag becomes an xgrammar `Grammar`; what does
  not parse is a ValueError naming the field. Usually milliseconds, but a schema's long string
  bounds can take xgrammar seconds;
- compiling: the grammar against the tokenizer's vocabulary, the token-mask cache that makes each
  step's mask cheap (a complex schema can take seconds).

Both run on the compile threads (`compile` returns a future at once), never on the step loop or an
API server's event loop, so the request waits in its own state while others step
(runtime/driver/structured_outputs.py) and fails once it waited
`structured_outputs_config.grammar_compile_timeout_s` (`COMPILE_TIMEOUT`: a busy machine, worth a
retry: the compile goes on and is cached) or at once when the constraint can never compile (the
future's ValueError).

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
from atomrt.runtime.driver.json_schema import check_json_values, prepare_schema
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


def check(so: StructuredOutputsParams) -> Any:
    """A JSON schema constraint, or the schemas inside a structural tag, walked and rewritten
    (runtime/driver/json_schema.py; a ValueError naming the keyword and its path); other
    constraints as they are."""
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


def parse(so: StructuredOutputsParams, checked: Any = None) -> xgr.Grammar:
    """The grammar of a constraint (`checked`: what `check` made of it, if it ran already); a
    ValueError naming the field when it does not parse."""
    kind = so.kind
    value = checked if checked is not None else check(so)
    try:
        if kind in ("json", "json_object"):
            schema = '{"type": "object"}' if kind == "json_object" else value
            grammar = xgr.Grammar.from_json_schema(
                schema if isinstance(schema, str) else json.dumps(schema),
                any_whitespace=not so.disable_any_whitespace,
                strict_mode=kind == "json",
                max_whitespace_cnt=so.max_whitespace if not so.disable_any_whitespace else None,
            )
            return _json_safe_lengths(grammar)
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


# xgrammar's rule for one character of a string with minLength / maxLength (a bounded repeat of
# it: cheap at any length) lets raw control characters through, which JSON forbids;
# `_json_safe_lengths` swaps it for any character but a control character, a quote or a backslash.
# Such a string is therefore written without escape sequences: with an escape alternative in the
# repeated rule xgrammar cannot precompute the token mask inside the string, and filling one row
# took about 1000x longer (26 ms against 21 us on a 49k vocabulary). Every output still validates.
_LENGTH_CHAR = r"(([^\"\\\r\n]))"
_JSON_CHAR = r"(([^\0-\x1f\"\\]))"


def _json_safe_lengths(grammar: xgr.Grammar) -> xgr.Grammar:
    text = str(grammar)
    if _LENGTH_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LENGTH_CHAR, _JSON_CHAR))


COMPILE_TIMEOUT = "did not compile within"  # in the error of a request that waited past its budget


def compile_timed_out(error: str) -> bool:
    """Whether a request's error says its grammar missed the compile budget (a busy machine:
    the server answers 503 with Retry-After, not 400)."""
    return error.startswith("structured_outputs") and COMPILE_TIMEOUT in error


def cache_key(so: StructuredOutputsParams) -> str:
    """The compiled-grammar cache's key of `so` (its canonical JSON text); a ValueError naming
    where a schema holds a value JSON has no form for (a set, bytes, NaN)."""
    try:
        return so.cache_key()
    except (TypeError, ValueError):
        check_json_values(getattr(so, so.kind), f"structured_outputs.{so.kind}: #")
        raise ValueError(f"structured_outputs.{so.kind}: not JSON") from None


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
        # the schema walk: its own thread, so a refusal never queues behind a long compile
        self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atomrt-schema")
        self.timeout_s = float(config.grammar_compile_timeout_s)
        self.cache_size = config.grammar_cache_size
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache is read by the step loop, filled by the threads
        self.stats = CompileStats()

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def compile(self, so: StructuredOutputsParams) -> Future:
        """The compiled grammar of `so` as a future: done at once when cached, else parsed and
        compiled on a compile thread (a constraint that cannot compile: the future's ValueError,
        naming the field). Only `so`'s cache key is computed here (a ValueError when it holds a
        value JSON has no form for)."""
        key = cache_key(so)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        future: Future = Future()
        self._checker.submit(self._check_then_compile, so, future)
        with self._lock:
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return future

    def _check_then_compile(self, so: StructuredOutputsParams, future: Future) -> None:
        """On the schema thread: walk the constraint, then hand it to a compile thread; `future`
        gets the compiled grammar or the error."""
        try:
            checked = check(so)
            inner = self.pool.submit(self._compile, so, checked)
        except BaseException as e:  # noqa: BLE001 - the request's error (a ValueError), or shutdown
            future.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
            return

        def done(f: Future) -> None:
            error = f.exception() if not f.cancelled() else RuntimeError("compile cancelled")
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(f.result())

        inner.add_done_callback(done)

    def _compile(self, so: StructuredOutputsParams, checked: Any) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        compiled = self._xgr.compile_grammar(parse(so, checked))
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
        self._checker.shutdown(wait=False, cancel_futures=True)
        self.pool.shutdown(wait=False, cancel_futures=True)

"""`GrammarCompiler`: requests' structured-output constraints -> compiled grammars, off the step loop.

The grammar library is a backend (runtime/driver/grammar_backend.py), chosen by
`structured_outputs_config.backend` from `BACKENDS`. A constraint is first validated (`check`: a
JSON schema walked and rewritten, a ValueError naming the field or the keyword), then parsed into
the backend's grammar (`parse`) and compiled against the tokenizer's vocabulary.

All of it runs on the compile threads (`compile` returns a future at once), never on the step loop
or an API server's event loop, so the request waits in its own state while others step
(runtime/driver/structured_outputs.py) and fails once it waited
`structured_outputs_config.grammar_compile_timeout_s` (`COMPILE_TIMEOUT`: a busy machine, worth a
retry: the compile goes on and is cached) or at once when the constraint can never compile (the
future's ValueError).

Compiled grammars are kept in an LRU cache keyed by the constraint (`StructuredOutputsParams.
cache_key`), one per engine: every DP rank's requests share it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from atomrt.runtime.config import StructuredOutputsConfig
from atomrt.runtime.driver.grammar_backend import GrammarBackend
from atomrt.runtime.driver.json_schema import check_json_values
from atomrt.runtime.driver.xgrammar_backend import XgrammarBackend
from atomrt.runtime.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# structured_outputs_config.backend -> its class (the config's GRAMMAR_BACKENDS lists the names)
BACKENDS: dict[str, type[GrammarBackend]] = {"xgrammar": XgrammarBackend}
DEFAULT_BACKEND: str = StructuredOutputsConfig.backend


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


def check(so: StructuredOutputsParams, backend: str = DEFAULT_BACKEND) -> Any:
    """`so` as the backend's `parse` takes it, or a ValueError naming the field (or the schema
    keyword and its path) when the backend would not enforce it exactly."""
    return BACKENDS[backend].validate(so)


def parse(so: StructuredOutputsParams, checked: Any = None, backend: str = DEFAULT_BACKEND) -> Any:
    """The backend's grammar of a constraint (`checked`: what `check` made of it, if it ran
    already); a ValueError naming the field when it does not parse."""
    cls = BACKENDS[backend]
    return cls.parse(so, checked if checked is not None else cls.validate(so))


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


COMPILE_NICENESS = 10  # how much lower than the step loop's a compile thread's CPU priority is


def _below_the_step_loop() -> None:
    """A compile thread yields the CPU to the step loop (and the workers' threads) where both
    want it: its scheduling priority, per thread on Linux, goes down by COMPILE_NICENESS."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
        pass


class GrammarCompiler:
    """One engine's compiler: its backend (over the tokenizer's vocabulary), the compile threads
    and the LRU cache."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        config: StructuredOutputsConfig,
    ) -> None:
        """`vocab_size`: the model's (its logits' width, which may exceed the tokenizer's);
        `stop_token_ids`: the tokens a finished grammar allows (the engine's EOS ids)."""
        self.backend_name = config.backend
        self.backend: GrammarBackend = BACKENDS[config.backend](
            hf_tokenizer, vocab_size, stop_token_ids
        )
        self.vocab_size = vocab_size
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
            checked = check(so, self.backend_name)
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

    def _compile(self, so: StructuredOutputsParams, checked: Any) -> Any:
        start = time.perf_counter()
        compiled = self.backend.compile(parse(so, checked, self.backend_name))
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
        self.backend.shutdown()

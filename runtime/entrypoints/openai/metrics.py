"""The server's Prometheus metrics: vLLM's names under an `atomrt:` prefix, and atomrt's own.

Engine-wide figures (running / waiting requests, KV usage, preemptions, steps by kind, padded
rows) come from the engine core's statistics, sent with every step; per-request latencies are
measured here, in the API process, from the request's arrival and each output's arrival.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        # the API process's own CPU seconds, memory and file descriptors (process_*, as vLLM's
        # default registry shows them): its cost per streamed token, read at each scrape
        ProcessCollector(registry=r)
        labels = ["model_name"]
        self.model = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, *more_labels: str) -> Counter:
            return Counter(name, doc, labels + list(more_labels), registry=r)

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r)

        self.num_running = gauge("atomrt:num_requests_running", "Requests the engine runs")
        self.num_waiting = gauge("atomrt:num_requests_waiting", "Requests waiting to run")
        self.kv_usage = gauge("atomrt:kv_cache_usage_perc", "KV cache blocks in use (0-1)")
        self.prompt_tokens = counter("atomrt:prompt_tokens", "Prompt tokens received")
        self.generation_tokens = counter("atomrt:generation_tokens", "Tokens generated")
        self.success = counter("atomrt:request_success", "Requests finished", "finished_reason")
        self.ttft = latency("atomrt:time_to_first_token_seconds", "Arrival to first token")
        self.itl = latency("atomrt:inter_token_latency_seconds", "Time between output tokens")
        self.e2e = latency("atomrt:e2e_request_latency_seconds", "Arrival to last token")
        self.queue_time = latency("atomrt:request_queue_time_seconds", "Arrival to first scheduled")
        self.preemptions = counter("atomrt:preemptions", "Sequences preempted (to recompute)")
        self.steps = counter("atomrt:steps", "Engine steps by kind", "kind")
        self.padded = counter("atomrt:padded_tokens", "Rows run beyond the real ones")
        self.compile_seconds = gauge("atomrt:compile_seconds", "Start-up compile time")
        self.capture_seconds = gauge("atomrt:capture_seconds", "CUDA-graph capture time")
        # speculative decoding, as vLLM names it
        self.spec_drafts = counter(
            "atomrt:spec_decode_num_drafts", "Verify steps of a sequence with drafts"
        )
        self.spec_draft_tokens = counter(
            "atomrt:spec_decode_num_draft_tokens", "Draft tokens verified"
        )
        self.spec_accepted = counter(
            "atomrt:spec_decode_num_accepted_tokens", "Draft tokens accepted"
        )
        self.spec_accepted_per_pos = counter(
            "atomrt:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: the first)",
            "position",
        )
        self.grammar_requests = counter(
            "atomrt:grammar_requests",
            "Structured-output requests, by whether their grammar was compiled already",
            "cached",
        )
        self.grammar_wait = counter(
            "atomrt:grammar_wait_seconds",
            "Seconds structured-output requests waited for their grammar",
            "cached",
        )
        self.mask_rows = counter("atomrt:grammar_mask_rows", "Grammar mask rows filled")
        self.mask_seconds = counter(
            "atomrt:grammar_mask_fill_seconds", "Seconds spent filling masks"
        )
        # the children the per-token path observes, bound once
        self._generated = self.generation_tokens.labels(model_name)
        self._itl = self.itl.labels(model_name)
        self._last_token: dict[str, float] = {}
        self._totals: dict[str, int] = {}  # the engine's running totals, last seen

    def _advance(self, counter: Any, name: str, total: float, *labels: str) -> None:
        """Move a counter to the engine's running `total` (sent whole with every step)."""
        delta = total - self._totals.get(name, 0)
        if delta > 0:
            counter.labels(self.model, *labels).inc(delta)
            self._totals[name] = total

    def engine_stats(self, stats: Any) -> None:
        m = self.model
        self.num_running.labels(m).set(stats.num_running)
        self.num_waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self._advance(self.preemptions, "preemptions", stats.num_preemptions)
        self._advance(self.steps, "eager", stats.steps_eager, "eager")
        self._advance(self.steps, "req_graph", stats.steps_req_graph, "req_graph")
        self._advance(self.steps, "token_graph", stats.steps_token_graph, "token_graph")
        self._advance(self.padded, "padded", stats.padded_tokens)
        if stats.spec_num_drafts:  # every position shows, a collapse to 0 too
            self._advance(self.spec_drafts, "spec_drafts", stats.spec_num_drafts)
            self._advance(self.spec_draft_tokens, "spec_draft_tokens", stats.spec_num_draft_tokens)
            self.spec_accepted.labels(m)
            self._advance(self.spec_accepted, "spec_accepted", stats.spec_num_accepted_tokens)
            for pos, total in enumerate(stats.spec_accepted_per_position):
                self.spec_accepted_per_pos.labels(m, str(pos))
                self._advance(self.spec_accepted_per_pos, f"spec_pos{pos}", total, str(pos))
        self._advance(self.grammar_requests, "compiled", stats.grammar_compiles, "false")
        self._advance(self.grammar_wait, "compiled_s", stats.grammar_compile_seconds, "false")
        self._advance(self.grammar_requests, "hits", stats.grammar_cache_hits, "true")
        self._advance(self.grammar_wait, "hits_s", stats.grammar_cache_hit_seconds, "true")
        self._advance(self.mask_rows, "mask_rows", stats.grammar_mask_rows)
        self._advance(self.mask_seconds, "mask_s", stats.grammar_mask_seconds)

    def request_in(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model).inc(num_prompt_tokens)

    def first_token(self, arrival: float, out: Any) -> None:
        now = time.monotonic()
        self.ttft.labels(self.model).observe(now - arrival)
        if out.first_scheduled_time is not None:
            self.queue_time.labels(self.model).observe(max(0.0, out.first_scheduled_time - arrival))
        self._generated.inc(len(out.token_ids))
        self._last_token[f"{out.request_id}/{out.index}"] = now

    def next_tokens(self, out: Any) -> None:
        """More tokens of a sample that already had its first: their inter-token latency."""
        n = len(out.token_ids)
        self._generated.inc(n)
        key = f"{out.request_id}/{out.index}"
        now = time.monotonic()
        last = self._last_token.get(key)
        if last is not None:
            for _ in range(n):
                self._itl.observe((now - last) / n)
        self._last_token[key] = now

    def request_done(self, arrival: float, out: Any, num_tokens: int) -> None:
        self.e2e.labels(self.model).observe(time.monotonic() - arrival)
        self.success.labels(self.model, out.finish_reason or "unknown").inc()
        self._last_token.pop(f"{out.request_id}/{out.index}", None)

    def startup(self, capture_seconds: float, compile_seconds: Optional[float] = None) -> None:
        self.capture_seconds.labels(self.model).set(capture_seconds)
        if compile_seconds is not None:
            self.compile_seconds.labels(self.model).set(compile_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

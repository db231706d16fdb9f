"""`LLM.get_metrics()`: a snapshot of the offline engine's metrics as vLLM's reader shapes them
(`Counter`, `Gauge`, `Vector`, `Histogram`, each with a `name` and `labels`), under the names the
server's /metrics uses (runtime/entrypoints/openai/metrics.py)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from atomrt.runtime.driver.outputs import RequestOutput
from atomrt.runtime.entrypoints.openai.metrics import _LATENCY_BUCKETS


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound (as text, "+Inf" last) -> cumulative count


@dataclass
class _Hist:
    bounds: tuple[float, ...] = _LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(_LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self, name: str, labels: dict[str, str]) -> Histogram:
        cumulative, running = {}, 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += n
            cumulative[bound] = running
        return Histogram(name, labels, running, self.total, cumulative)


class OfflineMetrics:
    """What `LLM(disable_log_stats=False)` counts over its finished requests."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {}
        self.ttft = _Hist()
        self.e2e = _Hist()
        self.queue = _Hist()

    def observe(self, out: RequestOutput) -> None:
        self.prompt_tokens += len(out.prompt_token_ids)
        for c in out.outputs:
            self.generation_tokens += len(c.token_ids)
            reason = c.finish_reason or "abort"
            self.success[reason] = self.success.get(reason, 0) + 1
        m = out.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)

    def snapshot(self, engine: Any) -> list[Metric]:
        labels = self.labels
        schedulers = engine.schedulers
        blocks = sum(s.block_manager.num_blocks for s in schedulers)
        used = sum(s.block_manager.num_used_blocks for s in schedulers)
        metrics: list[Metric] = [
            Gauge("atomrt:num_requests_running", labels, sum(len(s.running) for s in schedulers)),
            Gauge("atomrt:num_requests_waiting", labels, sum(len(s.waiting) for s in schedulers)),
            Gauge("atomrt:kv_cache_usage_perc", labels, used / blocks if blocks else 0.0),
            Counter("atomrt:prompt_tokens", labels, self.prompt_tokens),
            Counter("atomrt:generation_tokens", labels, self.generation_tokens),
            Counter("atomrt:num_preemptions", labels, sum(s.num_preemptions for s in schedulers)),
            Counter(
                "atomrt:prefix_cache_queries",
                labels,
                sum(s.block_manager.num_prefix_query_tokens for s in schedulers),
            ),
            Counter(
                "atomrt:prefix_cache_hits",
                labels,
                sum(s.block_manager.num_prefix_hit_tokens for s in schedulers),
            ),
        ]
        for reason, n in sorted(self.success.items()):
            metrics.append(
                Counter("atomrt:request_success", {**labels, "finished_reason": reason}, n)
            )
        metrics.append(self.ttft.snapshot("atomrt:time_to_first_token_seconds", labels))
        metrics.append(self.e2e.snapshot("atomrt:e2e_request_latency_seconds", labels))
        metrics.append(self.queue.snapshot("atomrt:request_queue_time_seconds", labels))
        return metrics

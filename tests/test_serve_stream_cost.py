"""What a streamed chunk costs the API process, and the mechanisms that cut it: the bench's
reading of the server's CPU seconds per token and per chunk, the start-up heap hidden from the
garbage collector."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from atomrt.runtime.bench.serve import Outcome, summarize
from atomrt.runtime.bench.serve_views import add_server_view, line
from atomrt.runtime.entrypoints.openai.metrics import ServerMetrics


def test_the_server_metrics_carry_the_api_process_cpu_seconds():
    text = ServerMetrics("m").render().decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["process_cpu_seconds_total"] > 0  # this process has run some Python


def test_the_bench_divides_the_api_cpu_of_a_run_by_its_tokens_and_chunks():
    # two requests: 4 tokens in 3 chunks (one chunk merged two steps), 2 tokens in 2 chunks
    outcomes = [
        Outcome(ok=True, start=0.0, ttft=0.1, latency=1.0, output_tokens=4, itls=[0.1, 0.2]),
        Outcome(ok=True, start=0.0, ttft=0.1, latency=1.0, output_tokens=2, itls=[0.3]),
        Outcome(ok=False, error="x"),
    ]
    r = summarize(outcomes, 0.0, 2.0, 2, None)
    assert (r.output_tokens, r.chunks) == (6, 5)
    before = {"atomrt:time_to_first_token_seconds_count": 1.0, "process_cpu_seconds_total": 10.0}
    after = {
        "atomrt:time_to_first_token_seconds_count": 3.0,
        "atomrt:time_to_first_token_seconds_sum": 0.2,
        "atomrt:request_queue_time_seconds_count": 0.0,
        "atomrt:request_queue_time_seconds_sum": 0.0,
        "atomrt:steps_total": 4.0,
        "process_cpu_seconds_total": 10.3,
    }
    add_server_view(r, before, after)
    assert r.api_cpu_us_per_token == round(0.3e6 / 6, 2)
    assert r.api_cpu_us_per_chunk == round(0.3e6 / 5, 2)
    assert r.api_cpu_busy == 0.15
    assert "API process CPU: 50000.0 us/token, 60000.0 us/chunk (5 chunks)" in line(r)


def test_the_server_hides_its_start_up_heap_from_the_collector():
    """`freeze_startup_heap` (called once the server is ready) leaves a full collection only the
    objects made after it to scan; run in a child, so that this process's collector is untouched."""
    code = (
        "import gc\n"
        "from atomrt.runtime.entrypoints.openai.api_server import freeze_startup_heap\n"
        "before = len(gc.get_objects())\n"
        "freeze_startup_heap()\n"
        "kept = [[i] for i in range(1000)]\n"
        "print(before, gc.get_freeze_count(), len(gc.get_objects()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    before, frozen, tracked = map(int, out.stdout.split())
    assert frozen > 10_000 and frozen >= before // 2  # FastAPI, pydantic, uvicorn and more
    assert 1000 <= tracked < 2000  # what a full collection scans now: the lists made after

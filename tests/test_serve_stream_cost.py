"""What a streamed chunk costs the API process, and the mechanisms that cut it: the bench's
reading of the server's CPU seconds per token and per chunk, the start-up heap hidden from the
garbage collector."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any, Optional

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from atomrt.distributed.messages import CoreOutput
from atomrt.runtime.bench.serve import Outcome, summarize
from atomrt.runtime.bench.serve_views import add_server_view, line
from atomrt.runtime.entrypoints.openai.metrics import ServerMetrics
from atomrt.runtime.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from atomrt.runtime.entrypoints.openai.responses import ChatResponses, CompletionResponses
from atomrt.runtime.entrypoints.openai.serving import Choice, Job, Serving
from atomrt.runtime.sampling_params import SamplingParams


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


TEXTS = ["", " hello", 'quo"te\\back', "new\nline\ttab\x01", "é中文🙂", "\u2028", " </s>"]


def _stream(responses_type: type, body: dict, plain: bool) -> list[str]:
    """The SSE events of a one-choice job whose outputs are TEXTS (the last one finished),
    formatted directly (`plain`) or through the general path (`plain_delta` answering None)."""
    serving = Serving(None, None, "m", ServerMetrics("m"))
    req = parse(
        ChatCompletionRequest if responses_type is ChatResponses else CompletionRequest, body
    )
    job = Job([[5, 6]], SamplingParams(max_tokens=len(TEXTS)))
    job.choices = [Choice(0)]
    responses = responses_type(serving, req, job)
    responses.id, responses.created = "cmpl-1", 1  # drawn per response: the same for both paths
    if not plain:
        responses.plain_delta = lambda choice, out: None

    async def outputs():
        for i, text in enumerate(TEXTS):
            last = i == len(TEXTS) - 1
            out = CoreOutput("r", token_ids=[i], text=text, finished=last)
            out.finish_reason = "length" if last else None
            choice = job.choices[0]
            choice.text, choice.token_ids = choice.text + text, choice.token_ids + [i]
            choice.finish_reason = out.finish_reason
            yield choice, out

    async def collect() -> list[str]:
        return [event async for event in responses.chunks(outputs())]

    return asyncio.run(collect())


def _read_with_openai(events: list[str], chat: bool) -> list[Any]:
    """The chunks the official client reads from these SSE bytes, answered to its request."""
    wire = "".join(events + ["data: [DONE]\n\n"]).encode()

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=wire, headers={"content-type": "text/event-stream"})

    client = openai.OpenAI(
        base_url="http://server/v1",
        api_key="none",
        http_client=httpx.Client(transport=httpx.MockTransport(answer)),
    )
    if chat:
        messages = [{"role": "user", "content": "hi"}]
        return list(client.chat.completions.create(model="m", messages=messages, stream=True))
    return list(client.completions.create(model="m", prompt=[5, 6], stream=True))


def test_chunks_formatted_directly_are_the_general_paths_bytes_and_openai_reads_them():
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    for responses_type, body in (
        (CompletionResponses, {"prompt": [5, 6], **usage}),
        (ChatResponses, {"messages": [{"role": "user", "content": "hi"}], **usage}),
    ):
        fast, general = _stream(responses_type, body, True), _stream(responses_type, body, False)
        assert len(fast) == len(general) > len(TEXTS) and fast == general
        chat = responses_type is ChatResponses
        chunks = _read_with_openai(fast, chat)
        read = "".join(
            (c.choices[0].delta.content or "" if chat else c.choices[0].text)
            for c in chunks
            if c.choices
        )
        assert read == "".join(TEXTS)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == len(TEXTS)


def test_the_server_loop_is_uvloops_when_asked(monkeypatch):
    from atomrt.runtime.entrypoints.cli import run_event_loop

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_event_loop(loop_module(), uvloop_loop=False).startswith("asyncio")
    assert run_event_loop(loop_module(), uvloop_loop=True).startswith("uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed
    with pytest.raises(ValueError, match="ATOMRT_SERVE_UVLOOP=1: uvloop is not installed"):
        run_event_loop(loop_module(), uvloop_loop=True)


def _serve_events(leave_after: Optional[int]) -> tuple[list[dict], list[str]]:
    """An EventStream of 5 events answered over ASGI; the client leaves (http.disconnect) once
    `leave_after` bodies were sent (None: it stays). What was sent, and what the stream saw."""
    from atomrt.runtime.entrypoints.openai.generation import EventStream

    sent: list[dict] = []
    seen: list[str] = []
    gone = asyncio.Event()

    async def events():
        try:
            for i in range(5):
                await asyncio.sleep(0.01)
                seen.append(f"event {i}")
                yield f"data: {i}\n\n"
        finally:
            seen.append("closed")

    async def receive() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        bodies = [m for m in sent if m["type"] == "http.response.body"]
        if leave_after is not None and len(bodies) == leave_after:
            gone.set()

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}

    async def run() -> None:
        await EventStream(events(), media_type="text/event-stream")(scope, receive, send)
        assert not asyncio.current_task().cancelling()  # the stream's own cancel, answered

    asyncio.run(run())
    return sent, seen


def test_an_event_stream_sends_every_event_and_ends_when_the_client_leaves():
    sent, seen = _serve_events(None)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert [m["body"] for m in sent[1:]] == [f"data: {i}\n\n".encode() for i in range(5)] + [b""]
    assert sent[-1]["more_body"] is False and seen[-1] == "closed"
    # the client leaves after two events: the stream is cancelled where it waits, its generator
    # closed (the job's abort runs there), nothing more is sent, and the response ends quietly
    sent, seen = _serve_events(2)
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n"]
    assert seen == ["event 0", "event 1", "closed"]


def test_the_output_queue_keeps_order_across_waits_and_a_cancelled_get():
    """`OutputQueue` (a stream's outputs, asyncio.Queue's calls without its loop checks): a get
    waits for the next put, a cancelled get loses nothing, the order is the order put."""
    from atomrt.runtime.entrypoints.engine_client import OutputQueue

    async def run() -> list:
        q, got = OutputQueue(), []
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        waiting.cancel()  # a reader that stopped waiting
        await asyncio.sleep(0)
        q.put_nowait(1)
        assert q.qsize() == 1 and not q.empty()
        reader = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        got.append(await reader)
        with pytest.raises(asyncio.QueueEmpty):
            q.get_nowait()
        reader = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)  # it waits: nothing is there
        for item in (2, 3, None):
            q.put_nowait(item)
        got.append(await reader)
        got += [q.get_nowait(), await q.get()]
        return got

    assert asyncio.run(run()) == [1, 2, 3, None]

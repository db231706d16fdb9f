"""The bench's streaming client (runtime/bench/sse_client.py) against a real uvicorn server: SSE
framing across chunk boundaries and line endings, sized and chunked bodies, error statuses, kept
connections, a stream cut short."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from atomrt.runtime.bench.sse_client import SSEClient, StreamError

# events cut at awkward places: mid-line, between the two newlines, CRLF endings, a comment line,
# an event of two data lines, a field without the optional space
PIECES = [
    b'data: {"a": 1}\n',
    b'\ndata: {"a"',
    b": 2}\r\n\r\n: a comment\ndata: line one\ndata: line two\n\n",
    b"data:[DONE]\n\n",
]
EVENTS = [b'{"a": 1}', b'{"a": 2}', b"line one\nline two", b"[DONE]"]


async def _stream(request: Request) -> Response:
    body = await request.json()

    async def gen():
        for piece in PIECES:
            yield piece
            await asyncio.sleep(0.001)

    if body.get("mode") == "sized":
        return Response(b"".join(PIECES), media_type="text/event-stream")
    if body.get("mode") == "error":
        return Response(b'{"error": {"message": "bad prompt"}}', status_code=400)
    if body.get("mode") == "cut":

        async def cut():
            yield PIECES[0] + b"\n"  # one whole event, then the stream breaks
            raise RuntimeError("the server fails mid-stream")

        return StreamingResponse(cut(), media_type="text/event-stream")
    return StreamingResponse(gen(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def url():
    app = Starlette(routes=[Route("/v1/stream", _stream, methods=["POST"])])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start in 30 s"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


async def _collect(client: SSEClient, mode: str) -> list[bytes]:
    async with contextlib.aclosing(client.events("/v1/stream", {"mode": mode})) as events:
        return [e async for e in events]


def test_events_are_framed_across_chunks_and_line_endings(url):
    async def run():
        async with SSEClient(url) as client:
            chunked = await _collect(client, "chunked")
            sized = await _collect(client, "sized")
            return chunked, sized, len(client._idle)

    chunked, sized, idle = asyncio.run(run())
    assert chunked == EVENTS and sized == EVENTS
    assert idle == 1  # both requests went over one kept connection


def test_an_error_status_raises_with_the_body(url):
    async def run():
        async with SSEClient(url) as client:
            with pytest.raises(StreamError, match="HTTP 400: .*bad prompt"):
                await _collect(client, "error")
            return await _collect(client, "chunked")  # the client still works after it

    assert asyncio.run(run()) == EVENTS


def test_a_stream_cut_short_raises(url):
    async def run():
        async with SSEClient(url) as client:
            got = []
            with pytest.raises((asyncio.IncompleteReadError, OSError, StreamError)):
                async with contextlib.aclosing(client.events("/v1/stream", {"mode": "cut"})) as ev:
                    async for e in ev:
                        got.append(e)
            return got, len(client._idle)

    got, idle = asyncio.run(run())
    assert got == [EVENTS[0]] and idle == 0  # a broken connection is not kept


def test_only_http_urls():
    with pytest.raises(ValueError, match="only http"):
        SSEClient("ftp://example.com")

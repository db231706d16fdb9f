"""An admitted generation request answered (`atomrt serve`'s /v1/completions,
/v1/chat/completions and /v1/responses): submitted to the engine, then gathered whole while the
client is watched for leaving, or streamed as server-sent events; either way the job is aborted
when nobody reads it any more, and `ServerState.in_flight` counts it until then."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from atomrt.runtime.entrypoints.engine_client import EngineGone
from atomrt.runtime.entrypoints.openai.protocol import RequestError
from atomrt.runtime.entrypoints.openai.responses import CompletionResponses, sse
from atomrt.runtime.entrypoints.openai.responses_api import ResponsesBodies, peeked
from atomrt.runtime.entrypoints.openai.server_state import ServerState
from atomrt.runtime.entrypoints.openai.serving import Job


async def generate(
    state: ServerState, request: Request, responses: CompletionResponses
) -> Response:
    """/v1/completions, /v1/chat/completions: an admitted job streamed as chunks, or its body."""
    stream = (responses.chunks, _chunk_error, sse("[DONE]"))
    return await _answer(
        state, request, responses.job, responses.req.stream, stream, responses.body
    )


async def generate_response(
    state: ServerState, request: Request, bodies: ResponsesBodies, streamed: bool
) -> Response:
    """/v1/responses: run its chat job, then answer a `response` object or its event stream."""
    stream = (bodies.events, _response_error, "")
    return await _answer(state, request, bodies.job, streamed, stream, bodies.response)


# a stream's events of the job's outputs, the event an error ends it with, and its last event
StreamForm = tuple[
    Callable[[AsyncIterator[Any]], AsyncIterator[str]], Callable[[Exception], str], str
]


async def _answer(
    state: ServerState,
    request: Request,
    job: Job,
    streamed: bool,
    stream: StreamForm,
    body: Callable[[], Any],
) -> Response:
    """Run an admitted job: stream it, or gather it whole while watching for the client leaving
    and answer `body()`. A streamed structured job's first output is awaited before the 200
    stream begins: what refuses it (a constraint that does not compile) is answered with its
    status."""
    state.in_flight += 1
    try:
        state.serving.submit(job)
        if streamed:
            outputs = state.serving.outputs(job)
            if job.params.structured_outputs is not None:
                outputs = await peeked(outputs)
    except BaseException:
        _release(state, job)
        raise
    if streamed:
        events, error_event, last = stream
        return EventStream(
            _stream(state, job, events(outputs), error_event, last),
            media_type="text/event-stream",
        )
    try:
        if not await gather(state, request, job):
            return Response(status_code=499)  # the client is gone: nobody reads this
    finally:
        state.in_flight -= 1
    return JSONResponse(body())


class EventStream(StreamingResponse):
    """Starlette's StreamingResponse, its watch for the client leaving a plain task beside the
    stream instead of an anyio task group around both (a tenth of a request's cost in the API
    process, paid 64 times at once when a wave of c=64 requests ends). As there, the client
    leaving cancels the stream where it waits (its generator's `finally` aborts the job), and the
    response ends quietly."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        streaming = asyncio.current_task()
        left = False

        async def watch() -> None:
            nonlocal left
            await self.listen_for_disconnect(receive)
            left = True
            streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not left:
                raise
            if hasattr(streaming, "uncancel"):  # Python 3.11+: the cancel was ours, answered
                streaming.uncancel()
        finally:
            watcher.cancel()
        if self.background is not None:
            await self.background()


async def gather(state: ServerState, request: Request, job: Job) -> bool:
    """Collect every output of `job`; False (and the job aborted) if the client disconnects."""

    async def drain() -> None:
        async for _ in state.serving.outputs(job):
            pass

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collect = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([collect, gone], return_when=asyncio.FIRST_COMPLETED)
        if collect.done():
            collect.result()  # raises what ended the job early (engine stopped, rejected)
            return True
        return False
    finally:
        collect.cancel()
        gone.cancel()
        if not job.finished:
            state.serving.abort(job)


async def _stream(
    state: ServerState,
    job: Job,
    events: AsyncIterator[str],
    error_event: Callable[[Exception], str],
    last: str,
) -> AsyncIterator[str]:
    """The job's events; an error that ends it early (the engine stopped, a refusal) as its
    error event; then `last`. A client that disconnects cancels this generator (Starlette), which
    aborts the job in `finally`."""
    try:
        try:
            async for event in events:
                yield event
        except (EngineGone, RequestError) as e:
            yield error_event(e)
        if last:
            yield last
    finally:
        _release(state, job)


def _release(state: ServerState, job: Job) -> None:
    """The job no longer counts as in flight; aborted unless it finished."""
    state.in_flight -= 1
    if not job.finished:
        state.serving.abort(job)


def _error_fields(e: Exception) -> tuple[str, int, Optional[str]]:
    """(type, status, param) of an error that ends a stream."""
    if isinstance(e, EngineGone):
        return "service_unavailable", 503, None
    assert isinstance(e, RequestError)
    return e.kind, e.status, e.param


def _chunk_error(e: Exception) -> str:
    kind, code, param = _error_fields(e)
    return sse({"error": {"message": str(e), "type": kind, "param": param, "code": code}})


def _response_error(e: Exception) -> str:
    kind, _, param = _error_fields(e)
    data = {"type": "error", "code": kind, "message": str(e), "param": param}
    return f"event: error\ndata: {json.dumps(data)}\n\n"

"""An admitted generation request answered (`atomrt serve`'s /v1/completions,
/v1/chat/completions and /v1/responses): submitted to the engine, then gathered whole while the
client is watched for leaving, or streamed as server-sent events; either way the job is aborted
when nobody reads it any more, and `ServerState.in_flight` counts it until then."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

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
    """Run an admitted job: stream it, or gather it whole while watching for the client leaving."""
    job = responses.job
    state.in_flight += 1
    try:
        state.serving.submit(job)
    except BaseException:
        state.in_flight -= 1
        state.serving.abort(job)
        raise
    if responses.req.stream:
        outputs = state.serving.outputs(job)
        if job.params.structured_outputs is not None:  # refused (or busy) before any output
            try:
                outputs = await _after_first(outputs)
            except BaseException:
                state.in_flight -= 1
                state.serving.abort(job)
                raise
        return StreamingResponse(
            stream(state, job, responses, outputs), media_type="text/event-stream"
        )
    try:
        if not await gather(state, request, job):
            return Response(status_code=499)  # the client is gone: nobody reads this
    finally:
        state.in_flight -= 1
    return JSONResponse(responses.body())


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


async def _after_first(outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`outputs` once its first item is in (what refuses the request raises here, so it is
    answered with its status, not a 200 stream; a structured-output constraint is parsed and
    compiled on the engine's compile threads meanwhile)."""
    it = outputs.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        return it

    async def chained() -> AsyncIterator[Any]:
        yield first
        async for item in it:
            yield item

    return chained()


async def stream(
    state: ServerState, job: Job, responses: CompletionResponses, outputs: AsyncIterator[Any]
) -> AsyncIterator[str]:
    """The job as server-sent events. A client that disconnects cancels this generator (Starlette),
    which aborts the job in `finally`."""
    try:
        try:
            async for chunk in responses.chunks(outputs):
                yield chunk
        except (EngineGone, RequestError) as e:
            kind = "service_unavailable" if isinstance(e, EngineGone) else e.kind
            code = 503 if isinstance(e, EngineGone) else e.status
            param = None if isinstance(e, EngineGone) else e.param
            yield sse({"error": {"message": str(e), "type": kind, "param": param, "code": code}})
        yield sse("[DONE]")
    finally:
        state.in_flight -= 1
        if not job.finished:
            state.serving.abort(job)


async def generate_response(
    state: ServerState, request: Request, bodies: ResponsesBodies, streamed: bool
) -> Response:
    """/v1/responses: run its chat job, then answer a `response` object or its event stream."""
    job = bodies.job
    state.in_flight += 1
    try:
        state.serving.submit(job)
        outputs = state.serving.outputs(job)
        if streamed and job.params.structured_outputs is not None:
            outputs = await peeked(outputs)  # refused before any output: a 400, no stream
    except BaseException:
        state.in_flight -= 1
        state.serving.abort(job)
        raise
    if streamed:
        return StreamingResponse(
            _response_events(state, job, bodies, outputs), media_type="text/event-stream"
        )
    try:
        if not await gather(state, request, job):
            return Response(status_code=499)
    finally:
        state.in_flight -= 1
    return JSONResponse(bodies.response())


async def _response_events(
    state: ServerState, job: Job, bodies: ResponsesBodies, outputs: AsyncIterator[Any]
) -> AsyncIterator[str]:
    try:
        try:
            async for event in bodies.events(outputs):
                yield event
        except (EngineGone, RequestError) as e:
            code = "service_unavailable" if isinstance(e, EngineGone) else e.kind
            param = None if isinstance(e, EngineGone) else e.param
            data = {"type": "error", "code": code, "message": str(e), "param": param}
            yield f"event: error\ndata: {json.dumps(data)}\n\n"
    finally:
        state.in_flight -= 1
        if not job.finished:
            state.serving.abort(job)

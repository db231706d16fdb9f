"""`atomrt serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine core.

The HTTP loop never waits on a step: the engine runs in its own process (engine_core.py), fed over
ZeroMQ. Endpoints: /v1/completions, /v1/chat/completions (both with `stream: true` as server-sent
events), /v1/models, /tokenize, /detokenize, /health (the process and the engine loop are alive),
/ready (model loaded, graphs captured, the engine loop alive and not draining), /metrics, /version.

Errors are OpenAI's JSON, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad body
(naming the field), 401 without the API key, 404 for another model, 413 for a body over
--max-request-bytes, 429 with Retry-After when --max-queued-requests are in flight, 503 while
starting, draining or after the engine died, 500 only for the server's own faults (logged, never
a trace to the client). SIGTERM drains: new requests get 503, requests in flight get
--shutdown-timeout to finish, the rest end with a final error chunk, the engine core stops, the
process exits 0 (1 if the engine died).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Callable
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from atomrt.distributed.core_messages import CoreReady
from atomrt.runtime.config import Config
from atomrt.runtime.entrypoints.engine_client import EngineClient, EngineGone
from atomrt.runtime.entrypoints.openai.generation import generate, generate_response
from atomrt.runtime.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    TokenizeRequest,
    parse,
)
from atomrt.runtime.entrypoints.openai.responses import ChatResponses, CompletionResponses
from atomrt.runtime.entrypoints.openai.responses_api import (
    ResponsesBodies,
    renamed,
    to_chat_body,
)
from atomrt.runtime.entrypoints.openai.server_args import ServerArgs
from atomrt.runtime.entrypoints.openai.server_state import (
    PENDING,
    Guard,
    ServerState,
    error_response,
    read_json,
)
from atomrt.runtime.entrypoints.openai.serving import Serving

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
LIVENESS_S = 10.0  # /health and /ready fail when the engine loop said nothing for this long


# ------------------------------------------------------------------------- the app


def _need_tokenizer(state: ServerState) -> None:
    if state.serving.tokenizer is PENDING:
        raise RequestError("the engine is starting", status=503, kind="service_unavailable")


def build_app(state: ServerState) -> Any:
    app = FastAPI(title="atomrt", version=VERSION)
    app.state.atomrt = state

    @app.exception_handler(RequestError)
    async def request_error(_: Request, e: RequestError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(EngineGone)
    async def engine_gone(_: Request, e: EngineGone) -> JSONResponse:
        return error_response(
            RequestError(f"the engine stopped: {e}", status=503, kind="service_unavailable")
        )

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        logger.error("unhandled error serving %s", request.url.path, exc_info=e)
        return error_response(
            RequestError("internal server error", status=500, kind="internal_error")
        )

    async def answer(
        request: Request, body_type: type, job_of: Callable, responses_type: type
    ) -> Response:
        """Admit a request, read its body as `body_type`, make its job (`job_of(serving, req)`)
        and answer it through `responses_type`."""
        state.admit()
        req = parse(body_type, await read_json(state, request))
        job = job_of(state.serving, req)
        return await generate(state, request, responses_type(state.serving, req, job))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, CompletionRequest, Serving.completion_job, CompletionResponses)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await answer(request, ChatCompletionRequest, Serving.chat_job, ChatResponses)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        state.admit()
        body = await read_json(state, request)
        try:
            req = parse(ChatCompletionRequest, to_chat_body(body))
            job = state.serving.chat_job(req)
        except RequestError as e:
            raise renamed(e) from None
        bodies = ResponsesBodies(state.serving, body, job)
        return await generate_response(state, request, bodies, bool(body.get("stream")))

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "atomrt",
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse(TokenizeRequest, await read_json(state, request))
        _need_tokenizer(state)
        tokens = state.serving.tokenize_request(req)
        ready = state.client.ready
        max_len = ready.max_model_len if ready else None
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": max_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse(DetokenizeRequest, await read_json(state, request))
        _need_tokenizer(state)
        return JSONResponse({"prompt": state.serving.detokenize_request(req)})

    @app.get("/health")
    async def health() -> Response:
        if state.client.ready is not None and not state.client.alive(LIVENESS_S):
            why = state.client.fatal or f"no message for {LIVENESS_S:.0f} s"
            raise RequestError(
                f"the engine loop is not answering: {why}", status=503, kind="service_unavailable"
            )
        return JSONResponse({"status": "ok", "engine_pid": state.client.pid})

    @app.get("/ready")
    async def ready() -> Response:
        if state.starting or state.draining or not state.client.alive(LIVENESS_S):
            raise RequestError("not ready", status=503, kind="service_unavailable")
        return JSONResponse({"status": "ready", "model": state.model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": VERSION})

    describe_bodies(
        app,
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/tokenize": TokenizeRequest,
            "/detokenize": DetokenizeRequest,
        },
    )
    return Guard(app, state.args)


def describe_bodies(app: FastAPI, bodies: dict[str, type]) -> None:
    """Put each POST route's request body (the pydantic model `parse` validates it with) in the
    app's OpenAPI document: the handlers read the raw request (their own errors and size limit),
    so FastAPI cannot see the models itself. Generated from the models: it cannot drift."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": ref}},
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# ------------------------------------------------------------------------- the process


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: `serve` drains on SIGTERM before it stops HTTP."""

    def install_signal_handlers(self) -> None:  # uvicorn before 0.29
        pass

    @contextlib.contextmanager
    def capture_signals(self) -> Any:  # uvicorn 0.29 and later
        yield


def _load_tokenizer(config: Config) -> Any:
    """`config`'s tokenizer; its imports (transformers, and torch with it) happen here too."""
    from atomrt.runtime.entrypoints.llm import load_tokenizer_for

    return load_tokenizer_for(config)


async def start_engine(state: ServerState, config: Config) -> CoreReady:
    """Spawn the engine core, then, while it starts, load the tokenizer in a thread (unless the
    state has one): the API process's tokenizer costs the start-up nothing. The core's CoreReady,
    once both are in; a tokenizer that does not load is a ValueError (the core is left to stop)."""
    start = asyncio.ensure_future(state.client.start())
    try:
        await asyncio.sleep(0)  # the core process is spawned before the tokenizer's imports
        if state.serving.tokenizer is PENDING:
            state.serving.tokenizer = await asyncio.to_thread(_load_tokenizer, config)
        return await start
    finally:
        if not start.done():
            start.cancel()
        elif not start.cancelled():
            start.exception()  # retrieved: when the tokenizer failed, its error is the one told


async def serve(
    config: Config,
    args: ServerArgs,
    tokenizer: Any = PENDING,
    client: Optional[EngineClient] = None,
) -> int:
    """Run the server until SIGTERM / SIGINT (drain) or the engine's death; the exit status.
    Without `tokenizer`, it loads while the engine core starts; `client`, if given, is the
    engine core's, possibly spawned already."""
    state = ServerState(config, args, tokenizer, client)
    server = _Uvicorn(
        uvicorn.Config(
            build_app(state),
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=max(1, int(args.shutdown_timeout)),
        )
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    http = asyncio.ensure_future(server.serve())  # answers 503 (and /health) while starting
    print(f"atomrt: starting the engine for {state.model_name} ...", flush=True)
    try:
        ready = await _until(start_engine(state, config), stop)
    except (EngineGone, ValueError) as e:
        print(f"atomrt: error: {e}", flush=True)
        await _close(state, server, http)
        return 1
    if ready is None:  # a signal during start-up
        await _close(state, server, http)
        return 0
    state.metrics.startup(ready.capture_seconds, ready.compile_seconds)
    freeze_startup_heap()
    print(
        f"atomrt: ready: http://{args.host}:{args.port}/v1 (model {state.model_name}, "
        f"{ready.num_kv_blocks} KV blocks, compile {ready.compile_seconds:.1f} s, "
        f"capture {ready.capture_seconds:.1f} s)",
        flush=True,
    )
    died = asyncio.ensure_future(state.client.wait_dead())
    signalled = asyncio.ensure_future(stop.wait())
    await asyncio.wait([signalled, died, http], return_when=asyncio.FIRST_COMPLETED)
    code = 1 if state.client.fatal is not None else 0
    if code:
        print(f"atomrt: error: the engine stopped: {state.client.fatal}", flush=True)
    state.draining = True
    deadline = time.monotonic() + args.shutdown_timeout
    while state.in_flight and time.monotonic() < deadline and state.client.fatal is None:
        await asyncio.sleep(0.05)
    if state.in_flight:
        logger.warning(
            "ending %d requests still in flight after --shutdown-timeout", state.in_flight
        )
    died.cancel()
    signalled.cancel()
    await _close(state, server, http)  # ends what is still in flight with a final error
    return code


def freeze_startup_heap() -> None:
    """Collect once, then hide every object alive now (the imports: transformers and torch for
    the tokenizer, FastAPI, pydantic) from the garbage collector, as vLLM's server does once up.
    A full collection stops the event loop, every stream with it; it then scans what requests
    left, not the ~350k start-up objects (a 190 ms pause down to 16 ms, measured on a CPU)."""
    gc.collect()
    gc.freeze()


async def _close(state: ServerState, server: Any, http: asyncio.Future) -> None:
    await state.client.stop()
    server.should_exit = True
    await http
    state.client.cleanup()


async def _until(coro: Any, stop: asyncio.Event) -> Any:
    """`coro`'s result, or None if `stop` is set first (then `coro` is cancelled)."""
    task = asyncio.ensure_future(coro)
    waiter = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    return None

"""The API server's state (`ServerState`: the engine client, `Serving`, metrics, admission) and
what answers a request before any route runs: the error body, the API-key and body-size guard
(`Guard`, ASGI middleware), and the JSON body read under the same limit."""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from atomrt.runtime.config import Config
from atomrt.runtime.entrypoints.engine_client import EngineClient
from atomrt.runtime.entrypoints.openai.metrics import ServerMetrics
from atomrt.runtime.entrypoints.openai.protocol import RequestError
from atomrt.runtime.entrypoints.openai.server_args import ServerArgs
from atomrt.runtime.entrypoints.openai.serving import Serving

_GUARDED = ("/v1/", "/tokenize", "/detokenize")  # paths behind the API key and the size limit


# ServerState's tokenizer while `start_engine` loads it beside the engine core's start
PENDING: Any = object()


class ServerState:
    def __init__(
        self,
        config: Config,
        args: ServerArgs,
        tokenizer: Any = PENDING,
        client: Optional[EngineClient] = None,
    ) -> None:
        self.args = args
        self.model_name = args.served_model_name or config.model
        self.metrics = ServerMetrics(self.model_name)
        self.client = client or EngineClient(config, args.start_timeout)
        self.client.on_outputs = lambda msg: self.metrics.engine_stats(msg.stats)
        parser = args.tool_call_parser if args.enable_auto_tool_choice else None
        self.serving = Serving(self.client, tokenizer, self.model_name, self.metrics, parser)
        self.draining = False
        self.in_flight = 0  # API requests admitted and not yet answered in full
        self.started = time.time()

    @property
    def starting(self) -> bool:
        """The engine core or the tokenizer is not in yet."""
        return self.client.ready is None or self.serving.tokenizer is PENDING

    def admit(self) -> None:
        """Raise the RequestError (503 or 429) that refuses a new generation request, if any."""
        unavailable = dict(status=503, kind="service_unavailable")
        if self.draining:
            raise RequestError("the server is shutting down", **unavailable)
        if self.client.fatal is not None:
            raise RequestError(f"the engine stopped: {self.client.fatal}", **unavailable)
        if self.starting:
            raise RequestError("the engine is starting", **unavailable)
        if self.in_flight >= self.args.max_queued_requests:
            raise RequestError(
                f"{self.in_flight} requests are in flight (--max-queued-requests); retry later",
                status=429,
                kind="rate_limit_error",
            )


def error_response(e: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    body = {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": e.status}}
    return JSONResponse(body, status_code=e.status, headers=headers)


class Guard:
    """ASGI middleware: the API key and the body-size limit, before any route reads the body."""

    def __init__(self, app: Any, args: ServerArgs) -> None:
        self.app = app
        self.args = args

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_GUARDED):
            refused = self._check(dict(scope["headers"]))
            if refused is not None:
                await error_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, headers: dict[bytes, bytes]) -> Optional[RequestError]:
        key = self.args.api_key
        if key and headers.get(b"authorization") != f"Bearer {key}".encode():
            return RequestError(
                "a valid API key is required (Authorization: Bearer ...)",
                status=401,
                kind="authentication_error",
            )
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.args.max_request_bytes:
            return RequestError(
                f"the request body is {int(length)} bytes; at most {self.args.max_request_bytes}",
                status=413,
            )
        return None


async def read_json(state: ServerState, request: Request) -> Any:
    raw = await request.body()  # chunked bodies carry no content-length: checked here too
    if len(raw) > state.args.max_request_bytes:
        raise RequestError(
            f"the request body is {len(raw)} bytes; at most {state.args.max_request_bytes}",
            status=413,
        )
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None

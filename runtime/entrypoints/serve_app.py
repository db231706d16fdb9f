"""The OpenAI server as a Ray Serve application: each replica owns one engine.

    serve run atomrt.runtime.entrypoints.serve_app:app                  # the defaults
    serve run atomrt.runtime.entrypoints.serve_app:build model=PATH tensor_parallel_size=2
    # serveConfigV2 (RayService):
    #   import_path: atomrt.runtime.entrypoints.serve_app:build
    #   args: {model: PATH, max_num_seqs: 64, min_replicas: 1, max_replicas: 4}

`build(args)` takes the flags of `atomrt serve` as keys (`model`, `config`, `set` (a list),
`tensor_parallel_size`, `executor`, `served_model_name`, `api_key`, `max_queued_requests`,
`shutdown_timeout`, ...: the serve parser checks them, so an unknown key is an error), minus
`host` / `port` (Serve's proxy owns HTTP), and these Serve keys: `num_replicas` (default 1) or
`min_replicas` / `max_replicas` with `target_ongoing_requests` (autoscaling on ongoing requests),
`max_ongoing_requests`, `num_cpus` and `num_gpus` per replica (default: one GPU per engine rank
when the engine runs on CUDA, else none).

A replica starts its engine core (engine_core.py) in `__init__` and is healthy once it is up; its
ranks run on the replica's own resources (`num_gpus` = tensor x data parallel size; the mp
executor spreads them over the GPUs Ray gave the replica), so an engine is placed with its
replica. Serve's graceful shutdown drains the replica as SIGTERM drains `atomrt serve`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from ray import serve

from atomrt.runtime.entrypoints.config_args import config_from_args
from atomrt.runtime.entrypoints.openai.api_server import (
    LIVENESS_S,
    ServerState,
    build_app,
    start_engine,
)

_SERVE_KEYS = (
    "num_replicas",
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "max_ongoing_requests",
    "num_cpus",
    "num_gpus",
)


@serve.ingress()
class OpenAIServer:
    """One replica: the API of `atomrt serve` and the engine core it owns."""

    async def __init__(self, serve_argv: list[str]) -> None:
        from atomrt.runtime.entrypoints.cli import build_parser, server_args_from

        args = build_parser().parse_args(["serve", *serve_argv])
        config = config_from_args(args)
        self.state = ServerState(config, server_args_from(args))
        try:
            ready = await start_engine(self.state, config)  # the tokenizer loads meanwhile
        except BaseException:
            await self.state.client.stop()  # a core already spawned does not outlive the replica
            self.state.client.cleanup()
            raise
        self.state.metrics.startup(ready.capture_seconds, ready.compile_seconds)

    def __serve_build_asgi_app__(self) -> Any:
        return build_app(self.state)

    async def check_health(self) -> None:
        """Serve restarts a replica whose engine stopped or went quiet."""
        if not self.state.client.alive(LIVENESS_S):
            raise RuntimeError(f"the engine is not answering: {self.state.client.fatal}")

    async def __del__(self) -> None:
        """Serve's graceful shutdown: refuse new work, let requests finish, stop the engine."""
        state = self.state
        state.draining = True
        deadline = time.monotonic() + state.args.shutdown_timeout
        while state.in_flight and time.monotonic() < deadline and state.client.fatal is None:
            await asyncio.sleep(0.05)
        await state.client.stop()
        state.client.cleanup()


def _argv(args: dict[str, Any]) -> list[str]:
    """`atomrt serve` flags from `build`'s keys (True: a bare flag; a list: the flag repeated)."""
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if key in ("host", "port"):
            raise ValueError(f"{key}: Ray Serve's proxy owns HTTP; set it in Serve's http_options")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def _options(serve_keys: dict[str, Any], config: Any, shutdown_timeout: float) -> dict[str, Any]:
    pc = config.parallel_config
    on_cuda = config.device == "cuda" or (config.device == "auto" and _has_cuda())
    gpus = serve_keys.get("num_gpus", pc.world_size if on_cuda else 0)
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": serve_keys.get("num_cpus", 1), "num_gpus": gpus},
        "max_ongoing_requests": serve_keys.get("max_ongoing_requests", 256),
        "graceful_shutdown_timeout_s": shutdown_timeout + 10.0,
        "health_check_timeout_s": 2 * LIVENESS_S,
    }
    if "min_replicas" in serve_keys or "max_replicas" in serve_keys:
        options["autoscaling_config"] = {
            "min_replicas": serve_keys.get("min_replicas", 1),
            "max_replicas": serve_keys.get("max_replicas", 1),
            "target_ongoing_requests": serve_keys.get("target_ongoing_requests", 32),
        }
    else:
        options["num_replicas"] = serve_keys.get("num_replicas", 1)
    return options


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def build(args: Optional[dict[str, Any]] = None) -> serve.Application:
    """The Serve application for `args` (serve flags as keys, plus the Serve keys above)."""
    from atomrt.runtime.entrypoints.cli import build_parser, server_args_from

    args = dict(args or {})
    serve_keys = {k: args.pop(k) for k in _SERVE_KEYS if k in args}
    argv = _argv(args)
    try:
        parsed = build_parser().parse_args(["serve", *argv])
    except SystemExit:  # argparse printed which flag; say where it came from
        raise ValueError(f"serve_app.build: bad arguments {args}") from None
    config = config_from_args(parsed)  # checks the engine settings here, not in every replica
    shutdown_timeout = server_args_from(parsed).shutdown_timeout
    deployment = serve.deployment(OpenAIServer, name="atomrt")
    return deployment.options(**_options(serve_keys, config, shutdown_timeout)).bind(argv)


app = build()

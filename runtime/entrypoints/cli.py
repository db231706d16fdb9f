"""The `atomrt` command: `generate`, `serve`, `prewarm` and `bench`.

atomrt generate [--model PATH] --prompt TEXT [--prompt TEXT ...] [--chat] [--config FILE] [--set KEY=VALUE ...]
atomrt serve [--model PATH] [--host 127.0.0.1] [--port 8000] [engine flags ...]
atomrt prewarm [--model PATH] [--config FILE] [--set KEY=VALUE ...]   (runtime/entrypoints/prewarm.py)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any, Optional

from atomrt.runtime.config import ConfigError
from atomrt.runtime.entrypoints.config_args import add_config_args, config_from_args
from atomrt.runtime.envs import ENV


def cmd_generate(args: argparse.Namespace) -> int:
    from atomrt.runtime.entrypoints.llm import LLM
    from atomrt.runtime.sampling_params import SamplingParams

    config = config_from_args(args)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    llm = LLM(config=config)
    try:
        start = time.perf_counter()
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outputs = llm.generate(args.prompt, params)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    num_tokens = 0
    for prompt, out in zip(args.prompt, outputs):
        completion = out.outputs[0]
        num_tokens += len(completion.token_ids)
        print(f"### {prompt}\n{completion.text}\n")
    print(
        f"generated {num_tokens} tokens for {len(outputs)} prompts in {elapsed:.2f} s: "
        f"{num_tokens / max(elapsed, 1e-9):.1f} tokens/s"
    )
    return 0


def server_args_from(args: argparse.Namespace) -> Any:
    """The HTTP settings of `atomrt serve` (a ValueError names a flag out of range)."""
    from atomrt.runtime.entrypoints.openai.server_args import ServerArgs

    for name, value in (
        ("--port", args.port),
        ("--max-queued-requests", args.max_queued_requests),
        ("--max-request-bytes", args.max_request_bytes),
    ):
        if value < 1 or (name == "--port" and value > 65535):
            raise ValueError(f"{name}: out of range, got {value}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout: must be >= 0 seconds, got {args.shutdown_timeout}")
    parsers = ("hermes", "llama3_json", "mistral")  # runtime/entrypoints/openai/tool_parsers.py
    if args.tool_call_parser is not None and args.tool_call_parser not in parsers:
        raise ValueError(
            f"--tool-call-parser: one of {', '.join(parsers)}, got {args.tool_call_parser!r}"
        )
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser NAME")
    return ServerArgs(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key or ENV.api_key or None,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    return run_event_loop(_serve(config, server_args_from(args)))


def run_event_loop(main: Any, uvloop_loop: Optional[bool] = None) -> Any:
    """`asyncio.run(main)`, on uvloop's loop with ATOMRT_SERVE_UVLOOP=1 (`uvloop_loop` overrides
    it): a streamed chunk's callbacks, queue hops and socket write may cost the API process less
    there (uvicorn's own loop="auto" and vLLM's server choose it)."""
    import asyncio

    if not (ENV.serve_uvloop if uvloop_loop is None else uvloop_loop):
        return asyncio.run(main)
    try:
        import uvloop
    except ImportError:
        main.close()
        raise ValueError(
            "ATOMRT_SERVE_UVLOOP=1: uvloop is not installed (pip install uvloop, or unset it)"
        ) from None
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return uvloop.run(main)


async def _serve(config: Any, server_args: Any) -> int:
    """Spawn the engine core first, then import the HTTP stack and serve: the core's imports
    (torch) run beside the API process's own, and the tokenizer loads while the core starts."""
    from atomrt.runtime.entrypoints.engine_client import EngineClient

    client = EngineClient(config, server_args.start_timeout)
    client.spawn()
    try:
        from atomrt.runtime.entrypoints.openai.api_server import serve
    except BaseException:
        await client.stop()
        client.cleanup()
        raise
    return await serve(config, server_args, client=client)


def cmd_prewarm(args: argparse.Namespace) -> int:
    from atomrt.runtime.entrypoints.prewarm import cmd_prewarm as prewarm

    return prewarm(config_from_args(args))


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    if args.what == "startup":
        from atomrt.runtime.bench.startup import main as bench_main
    elif args.what == "latency":
        from atomrt.runtime.bench.latency import main as bench_main
    elif args.what == "throughput":
        from atomrt.runtime.bench.throughput import main as bench_main
    elif args.what == "serve":
        from atomrt.runtime.bench.serve import main as bench_main
    elif args.what == "dp":
        from atomrt.runtime.bench.dp import main as bench_main
    elif args.what == "report":
        from atomrt.runtime.bench.report import main as bench_main
    else:
        from atomrt.runtime.bench.transport import main as bench_main
    return int(bench_main(rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atomrt", description="atomrt LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline for a few prompts")
    add_config_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the model's chat template"
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    srv = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_config_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: --model)"
    )
    srv.add_argument("--api-key", default=None, help="require this key (or set ATOMRT_API_KEY)")
    srv.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests in flight before new ones get 429",
    )
    srv.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger bodies get 413")
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='answer tool_choice "auto" (the default with tools) with the model\'s own calls, '
        "read by --tool-call-parser",
    )
    srv.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls: hermes (Qwen2.5, Qwen3) | llama3_json | mistral",
    )
    prewarm = sub.add_parser(
        "prewarm",
        help="compile every piece of a config into the compile cache, record what it holds, exit",
    )
    add_config_args(prewarm)
    bench = sub.add_parser(
        "bench",
        help="benchmarks: startup | latency | throughput | serve | transport | dp (their own flags "
        "follow); report renders docs/perf.md from their records",
        add_help=False,
    )
    bench.add_argument(
        "what", choices=["startup", "latency", "throughput", "serve", "transport", "dp", "report"]
    )
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(
        level=ENV.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "bench":
            return cmd_bench(args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "prewarm":
            return cmd_prewarm(args)
        return cmd_generate(args)
    except (ConfigError, ValueError) as e:
        print(f"atomrt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

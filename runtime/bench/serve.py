"""Serving benchmark (`atomrt bench serve`): latency and throughput of an OpenAI server under load.

    atomrt bench serve [--url URL | engine flags as for `atomrt serve` (it starts one itself)]
        [--num-prompts 256] [--input-len 32] [--output-len 128] [--dataset sharegpt.json]
        [--concurrency 1,8,64 | --request-rate 2,8,inf] [--compare-offline]
        [--structured-output-ratio 0,1 --json-schema FILE [--compile-stall]]
        [--json PATH] [--plot PATH.png]

Every request is a streamed /v1/completions call, greedy, EOS ignored (a synthetic request makes
exactly `--output-len` tokens; a ShareGPT one its answer's length). Synthetic prompts are
`--input-len` token ids drawn from ids the server's tokenizer produces. One run per concurrency
(that many requests in flight at once) or per request rate (Poisson arrivals, requests/s; `inf`
sends all at once). Per run: requests/s, output tokens/s, and p50 / p90 / p99 of TTFT (time to the
first token), TPOT (time per output token after the first) and ITL (time between streamed chunks).
`--compare-offline` (when the bench starts the server) also runs the same prompts through the
offline engine (same flags) once the server is gone, at each run's concurrency (that many requests
in flight, a finished one replaced by the next; a request-rate run: all at once), and prints the
server's output tokens/s as a fraction of the offline engine's, and the steps each took.

The server's own view of each run comes from its /metrics, read before and after: its mean TTFT
(the request's arrival in the API process to its first token there), the part of it spent queued
(arrival to first scheduled), and the engine steps the run took. Client TTFT less the server's is
the HTTP path; the server's less its queue time is the prefill step and the way back.

Structured outputs (`--structured-output-ratio`, `--json-schema`, `--compile-stall`): each run
again per ratio, that share of its requests constrained to the schema (runtime/bench/structured.py).
A preset's dummy weights have no tokenizer: give the engine one (`--tokenizer embedded`, the
bundled SmolLM2's, or a folder) for structured runs. A run whose requests all fail is reported as
FAILED and left out of the record, whose other figures are written.

The streams are read by a lean asyncio client (runtime/bench/sse_client.py): at tens of thousands
of events a second a general-purpose client's cost per event would be what the bench measures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import httpx
from tqdm import tqdm

from atomrt.distributed.net_utils import get_free_port
from atomrt.runtime.bench import serve_views, structured
from atomrt.runtime.bench.records import add_record_flag, resolve_record_flag, save
from atomrt.runtime.bench.serve_figures import load_name, percentiles_ms, serve_figures
from atomrt.runtime.bench.serve_views import (
    add_server_view,
    offline_tokens_per_s,
    plot,
    scrape,
)
from atomrt.runtime.bench.sse_client import SSEClient, StreamError
from atomrt.runtime.entrypoints.config_args import add_config_args

_SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog while the sun sets over a quiet harbour; "
    "engineers measure latency, throughput and memory on every machine they can find."
)
START_TIMEOUT_S = 1800.0  # a cold compile and capture on a large model
REQUEST_TIMEOUT_S = 600.0  # one streamed request, first byte to last


@dataclass
class Request:
    prompt: Any  # token ids (synthetic) or text (a dataset)
    output_len: int
    schema: Optional[dict] = None  # structured outputs: the output follows this JSON schema


@dataclass
class Outcome:
    ok: bool
    start: float = 0.0  # time.perf_counter() when it was sent
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""  # a structured request's output
    finish_reason: str = ""  # a structured request's


@dataclass
class RunResult:
    concurrency: Optional[int]
    request_rate: Optional[float]
    num_requests: int
    failed: int
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    # each request: [sent (ms after the run's start), TTFT ms, latency ms]; failed ones left out
    requests: list[list[float]] = field(default_factory=list)
    started_monotonic: float = 0.0  # time.monotonic() at the run's start (to line up server logs)
    server_ttft_ms_mean: Optional[float] = None  # the server's /metrics, over this run
    server_queue_ms_mean: Optional[float] = None
    server_steps: Optional[int] = None
    output_tokens: int = 0
    chunks: int = 0  # streamed chunks that carried tokens (text)
    # the API process's CPU (its /metrics' process_cpu_seconds_total) over the run: per output
    # token and per chunk, and the share of one core it used (1.0: the HTTP side is saturated)
    api_cpu_us_per_token: Optional[float] = None
    api_cpu_us_per_chunk: Optional[float] = None
    api_cpu_busy: Optional[float] = None
    offline_output_tokens_per_s: Optional[float] = None
    offline_steps: Optional[int] = None
    server_vs_offline: Optional[float] = None
    structured: Optional[structured.StructuredView] = None  # --structured-output-ratio


def _bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atomrt bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server (else the bench starts one)")
    p.add_argument("--num-prompts", type=int, default=256, help="requests per run")
    p.add_argument("--input-len", type=int, default=32, help="tokens per synthetic prompt")
    p.add_argument("--output-len", type=int, default=128, help="tokens per synthetic request")
    p.add_argument("--dataset", default=None, help="a ShareGPT-format JSON file of conversations")
    p.add_argument("--concurrency", default=None, help="comma list of requests in flight")
    p.add_argument("--request-rate", default=None, help="comma list of requests/s (inf: all)")
    p.add_argument("--compare-offline", action="store_true", help="also time LLM.generate")
    p.add_argument(
        "--structured-output-ratio",
        default=None,
        help="comma list of shares of requests constrained to --json-schema (each run per share)",
    )
    p.add_argument("--json-schema", default=None, help="the JSON schema structured requests follow")
    p.add_argument(
        "--compile-stall",
        action="store_true",
        help="also time running streams while 8 fresh schemas compile",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="where to write the JSON report")
    p.add_argument("--plot", default=None, help="where to write the latency/throughput PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_record_flag(p)
    return p


def _parse(argv: Optional[list[str]]) -> tuple[argparse.Namespace, list[str]]:
    """The bench's own flags, and the engine flags (checked) for the server it starts."""
    p = _bench_parser()
    args, engine_argv = p.parse_known_args(argv)
    engine = argparse.ArgumentParser(prog="atomrt bench serve (engine flags)")
    add_config_args(engine)
    args.device = engine.parse_args(engine_argv).device  # an unknown flag is an error here
    resolve_record_flag(args, p)
    if args.url and engine_argv:
        p.error(f"--url serves its own engine: drop {' '.join(engine_argv)}")
    if args.compare_offline and args.url:
        p.error("--compare-offline needs the engine flags: the bench starts the server itself")
    if (args.structured_output_ratio is None) != (args.json_schema is None):
        p.error("--structured-output-ratio and --json-schema go together")
    if args.compile_stall and args.json_schema is None:
        p.error("--compile-stall measures structured outputs: give --json-schema")
    if (args.concurrency is None) == (args.request_rate is None):
        if args.request_rate is not None:
            p.error("give --concurrency or --request-rate, not both")
        args.concurrency = "1,8,64"
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args, engine_argv


def _numbers(text: str, kind: type) -> list[Any]:
    values = [kind(x) for x in text.split(",") if x.strip()]
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"expected a comma list of positive numbers, got {text!r}")
    return values


# ------------------------------------------------------------------------- the server


class LocalServer:
    """`atomrt serve` in a subprocess on a free port; its output drained to stderr."""

    def __init__(self, engine_argv: list[str]) -> None:
        self.port = get_free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "atomrt.runtime.entrypoints.cli", "serve"]
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port), *engine_argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.ready = threading.Event()
        threading.Thread(target=self._relay, daemon=True).start()
        if not self.ready.wait(START_TIMEOUT_S) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"atomrt serve did not get ready within {START_TIMEOUT_S:.0f} s")

    def _relay(self) -> None:
        for line in self.proc.stdout:
            print(f"[serve] {line}", end="", file=sys.stderr)
            if "atomrt: ready:" in line:
                self.ready.set()
        self.ready.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------------- requests


def build_requests(args: argparse.Namespace, client: httpx.Client) -> list[Request]:
    rng = random.Random(args.seed)
    if args.dataset:
        with open(args.dataset) as f:
            convs = json.load(f)
        out = []
        for conv in convs:
            turns = conv.get("conversations", [])
            if len(turns) < 2 or not turns[0].get("value") or not turns[1].get("value"):
                continue
            answer = client.post("/tokenize", json={"prompt": turns[1]["value"]}).json()
            out.append(Request(turns[0]["value"], max(1, answer["count"])))
        if not out:
            raise ValueError(f"{args.dataset}: no conversation with a prompt and an answer")
        rng.shuffle(out)
        return [out[i % len(out)] for i in range(args.num_prompts)]
    r = client.post("/tokenize", json={"prompt": _SEED_TEXT})
    if r.status_code == 200:
        pool = sorted(set(r.json()["tokens"])) or [0]
    else:  # a model without a tokenizer (dummy weights of a preset): ids every vocabulary has
        try:
            why = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = r.text[:200]
        print(
            f"bench serve: /tokenize answered {r.status_code} ({why}); prompts of token ids "
            "10-499 (give the engine --tokenizer, e.g. 'embedded', for text prompts and "
            "structured outputs)"
        )
        pool = list(range(10, 500))
    return [
        Request([rng.choice(pool) for _ in range(args.input_len)], args.output_len)
        for _ in range(args.num_prompts)
    ]


async def one_request(client: SSEClient, model: str, req: Request) -> Outcome:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.schema is not None:  # room for the schema's output: the grammar's end stops it
        body["structured_outputs"] = {"json": req.schema}
        body["max_tokens"] = 2 * req.output_len
    start = time.perf_counter()
    first = last = 0.0
    out = Outcome(ok=False)
    try:
        async with contextlib.aclosing(client.events("/v1/completions", body)) as events:
            async for data in events:
                if data == b"[DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    return Outcome(ok=False, error=chunk["error"]["message"])
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                # a token's chunk: text, or none yet (a partial character, or a model served
                # without a tokenizer); a closing chunk carries only its finish_reason
                choice = (chunk.get("choices") or [None])[0]
                if req.schema is not None and choice is not None:
                    out.text += choice.get("text") or ""
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                if choice is not None and (
                    choice.get("text") or choice.get("finish_reason") is None
                ):
                    if first == 0.0:
                        first = now
                    else:
                        out.itls.append(now - last)
                    last = now
    except (StreamError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        return Outcome(ok=False, error=f"{type(e).__name__}: {e}")
    except ValueError as e:  # an event that is not JSON
        return Outcome(ok=False, error=f"a streamed event is not JSON: {e}")
    out.ok = first > 0.0
    if not out.ok:
        out.error = "the stream ended without a token"
    out.start = start
    out.ttft = first - start
    out.latency = time.perf_counter() - start
    return out


async def run_load(
    url: str,
    model: str,
    requests: list[Request],
    concurrency: Optional[int],
    rate: Optional[float],
    rng: random.Random,
    progress: bool,
) -> tuple[list[Outcome], float]:
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
    gate = asyncio.Semaphore(concurrency or len(requests))

    async def gated(req: Request) -> Outcome:
        async with gate:
            try:
                result = await asyncio.wait_for(one_request(client, model, req), REQUEST_TIMEOUT_S)
            except asyncio.TimeoutError:
                result = Outcome(ok=False, error=f"no answer within {REQUEST_TIMEOUT_S:.0f} s")
        bar.update(1)
        return result

    async with SSEClient(url) as client:
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.ensure_future(gated(req)))
            if rate is not None and not math.isinf(rate):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        outcomes = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
    bar.close()
    return list(outcomes), start, seconds


def summarize(
    outcomes: list[Outcome],
    start: float,
    seconds: float,
    concurrency: Optional[int],
    rate: Optional[float],
) -> RunResult:
    """The run's figures; `start` is its time.perf_counter() at the first request."""
    ok = [o for o in outcomes if o.ok]
    tokens = sum(o.output_tokens for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    return RunResult(
        concurrency=concurrency,
        request_rate=rate,
        num_requests=len(outcomes),
        failed=len(outcomes) - len(ok),
        seconds=round(seconds, 3),
        requests_per_s=round(len(ok) / seconds, 3),
        output_tokens_per_s=round(tokens / seconds, 2),
        ttft_ms=percentiles_ms([o.ttft for o in ok]),
        tpot_ms=percentiles_ms(tpots),
        itl_ms=percentiles_ms([x for o in ok for x in o.itls]),
        requests=[
            [round(1e3 * (o.start - start), 3), round(1e3 * o.ttft, 3), round(1e3 * o.latency, 3)]
            for o in ok
        ],
        started_monotonic=time.monotonic() - (time.perf_counter() - start),
        output_tokens=tokens,
        chunks=sum(len(o.itls) + 1 for o in ok),
    )


# ------------------------------------------------------------------------- report


def main(argv: Optional[list[str]] = None) -> int:
    args, engine_argv = _parse(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    try:
        loads = (
            [(c, None) for c in _numbers(args.concurrency, int)]
            if args.concurrency
            else [(None, r) for r in _numbers(args.request_rate, float)]
        )
        shares = structured.ratios(args.structured_output_ratio)
    except ValueError as e:
        print(f"atomrt bench serve: error: {e}", file=sys.stderr)
        return 2
    waves = [c for c, _ in loads if c is not None and args.num_prompts < 4 * c]
    if waves:
        print(
            f"bench serve: {args.num_prompts} requests at concurrency {max(waves)} are under four "
            "waves: the ramp up and down weighs on tokens/s (use --num-prompts >= 4x concurrency "
            "for the steady state)",
            file=sys.stderr,
        )
    server = None if args.url else LocalServer(engine_argv)
    url = args.url or server.url
    results: list[RunResult] = []
    stall: Optional[dict] = None
    api: Optional[httpx.Client] = None
    try:
        api = httpx.Client(base_url=url, timeout=60)
        model = api.get("/v1/models").json()["data"][0]["id"]
        requests = build_requests(args, api)
        print(f"server {url}, model {model}, {len(requests)} requests per run")
        rng = random.Random(args.seed)
        asyncio.run(run_load(url, model, requests[:4], 4, None, rng, False))  # warm-up
        schema = structured.load_schema(args.json_schema) if args.json_schema else None
        first: Optional[structured.StructuredView] = None
        if schema is not None:  # every run makes the token counts the requests make constrained
            every = structured.constrain(requests, schema, 1.0, args.seed)
            grammar = structured.scrape_grammar(api)
            probe, _, _ = asyncio.run(run_load(url, model, every, *loads[0], rng, False))
            first = structured.view(1.0, schema, [], grammar, structured.scrape_grammar(api))
            requests = structured.matched(requests, probe)
        for (concurrency, rate), share in itertools.product(loads, shares):
            reqs = (
                requests
                if share is None
                else structured.constrain(requests, schema, share, args.seed)
            )
            before, grammar = scrape(api), structured.scrape_grammar(api)
            outcomes, start, seconds = asyncio.run(
                run_load(url, model, reqs, concurrency, rate, rng, not args.no_progress)
            )
            results.append(summarize(outcomes, start, seconds, concurrency, rate))
            add_server_view(results[-1], before, scrape(api))
            if share is not None:
                pairs = zip(outcomes, reqs)
                texts = [(o.text, o.finish_reason) for o, q in pairs if q.schema is not None]
                after = structured.scrape_grammar(api)
                view = structured.view(share, schema, texts, grammar, after)
                view.compile_first_ms = first.compile_first_ms  # the length probe's compile
                results[-1].structured = view
            if results[-1].failed == results[-1].num_requests:
                print(f"{load_name(results[-1])}: FAILED, every request failed", flush=True)
            else:
                print(serve_views.line(results[-1]), flush=True)
            for o in outcomes:
                if not o.ok:
                    print(f"  failed: {o.error}", file=sys.stderr)
                    break
        if args.compile_stall:
            c = next((c for c, _ in loads if c is not None), 8)
            stall = asyncio.run(
                structured.compile_stall(url, model, requests[0].prompt, c, args.seed)
            )
            print(structured.stall_line(stall, c), flush=True)
    finally:
        if api is not None:
            api.close()
        if server is not None:
            server.stop()
    if args.compare_offline:
        offline = offline_tokens_per_s(
            engine_argv, requests, [r.concurrency for r in results], not args.no_progress
        )
        for r in results:
            rate, r.offline_steps = offline[r.concurrency]
            r.offline_output_tokens_per_s = round(rate, 2)
            r.server_vs_offline = round(r.output_tokens_per_s / rate, 4)
            print(serve_views.line(r))
    if args.json:
        report = {"url": url, "model": model, "args": vars(args), "engine_flags": engine_argv}
        report["runs"] = [asdict(r) for r in results]
        report["compile_stall"] = stall
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot and results:
        plot(results, args.plot)
    measured = [r for r in results if r.failed < r.num_requests]  # a run of failures has none
    if args.record is not None and (measured or stall is not None):
        import torch

        on_gpu = args.device != "cpu" and torch.cuda.is_available()
        figures = serve_figures(measured, model, args, engine_argv, on_gpu, stall)
        argv = sys.argv[1:] if argv is None else argv
        notes = [
            f"{load_name(r)}: every one of its {r.num_requests} requests failed"
            for r in results
            if r not in measured
        ]
        save(args.record, "serve", argv, figures, on_gpu=on_gpu, notes=notes)
    return 0 if all(r.failed == 0 for r in results) else 1

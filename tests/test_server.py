"""`atomrt serve` over real HTTP on 127.0.0.1, driven by the official `openai` client.

One server runs the embedded SmolLM2-135M-Instruct (chat template, real text); others run the tiny
test Llama (fast tokens) for load, cancellation, admission, auth, fuzz and shutdown.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import httpx
import openai
import pytest
from executor_harness import build_tiny_llama, pid_alive, wait_gone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from records_harness import check_records

from atomrt.distributed.messages import CoreOutput
from atomrt.distributed.net_utils import get_free_port
from atomrt.runtime.bench.targets import env_variant
from atomrt.runtime.entrypoints.engine_client import _NOTHING, RequestStream

CPU_FLAGS = ["--device", "cpu", "--enforce-eager", "--set", "cache_config.num_kv_blocks=256"]


class Server:
    def __init__(self, args: list[str], env: Optional[dict[str, str]] = None) -> None:
        self.port = get_free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "atomrt.runtime.entrypoints.cli",
                "serve",
                "--port",
                str(self.port),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:  # drain the output all along: a full pipe would block the server
            for line in self.proc.stdout:
                self.lines.append(line)
                if "atomrt: ready:" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(240) or self.proc.poll() is not None:
            raise AssertionError("the server did not get ready:\n" + "".join(self.lines))
        assert any(self.url in line for line in self.lines if "atomrt: ready:" in line), self.lines
        self.engine_pid = httpx.get(f"{self.url}/health").json()["engine_pid"]

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=kwargs.pop("api_key", "none"),
            max_retries=0,
            **kwargs,
        )

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no metric {name}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_server") / "model")


@pytest.fixture(scope="module")
def smol() -> Iterator[Server]:
    server = Server([*CPU_FLAGS, "--served-model-name", "smol"])
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def tiny_server(tiny) -> Iterator[Server]:
    server = Server(
        ["--model", str(tiny), *CPU_FLAGS, "--max-num-seqs", "64", "--served-model-name", "tiny"]
    )
    yield server
    assert server.stop() == 0


def test_completions_and_chat_through_the_openai_client(smol):
    client = smol.client()
    assert [m.id for m in client.models.list().data] == ["smol"]
    kwargs = dict(model="smol", temperature=0, max_tokens=16)
    whole = client.completions.create(prompt="The capital of France is", **kwargs)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(prompt="The capital of France is", stream=True, **kwargs)
    )
    assert whole.choices[0].text and streamed == whole.choices[0].text
    prompt_tokens = httpx.post(
        f"{smol.url}/tokenize", json={"prompt": "The capital of France is"}
    ).json()["count"]
    assert whole.usage.prompt_tokens == prompt_tokens and whole.usage.completion_tokens == 16

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(messages=messages, **kwargs)
    assert (
        "Paris" in chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
    )
    chunks = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == chat.choices[0].message.content
    )
    assert (
        chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
        and not chunks[-1].choices
    )
    three = client.completions.create(
        prompt="Once upon a time", model="smol", max_tokens=8, n=3, temperature=1.0, seed=5
    )
    assert sorted(c.index for c in three.choices) == [0, 1, 2]
    assert len({c.text for c in three.choices}) > 1  # seeded, distinct samples
    again = client.completions.create(
        prompt="Once upon a time", model="smol", max_tokens=8, n=3, temperature=1.0, seed=5
    )
    assert [c.text for c in again.choices] == [c.text for c in three.choices]  # and reproducible


def test_logprobs_and_errors_in_openai_json(smol):
    client = smol.client()
    out = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smol", prompt="x", temperature=-1)
    assert "temperature" in str(err.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    r = httpx.post(
        f"{smol.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{smol.url}/v1/completions", json={"prompt": "x", "max_tokens": "5"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{smol.url}/v1/completions", json={"prompt": "x" * (2 << 20)})
    assert r.status_code == 413
    r = httpx.post(f"{smol.url}/v1/completions", json={"prompt": "hello " * 9000, "max_tokens": 2})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]  # past max_model_len
    r = httpx.post(f"{smol.url}/v1/completions", json={"prompt": "hello " * 5000, "max_tokens": 2})
    assert (
        r.status_code == 400 and "KV" in r.json()["error"]["message"]
    )  # more than the KV cache holds
    assert httpx.post(f"{smol.url}/detokenize", json={"tokens": [1, 2, 3]}).status_code == 200
    assert httpx.get(f"{smol.url}/version").json()["version"]


async def _stream_one(client: openai.AsyncOpenAI, prompt: list[int], n: int) -> str:
    text = []
    async for chunk in await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True
    ):
        text.append(chunk.choices[0].text)
    return "".join(text)


def test_200_concurrent_streams_lose_and_repeat_nothing(tiny_server):
    prompts = [[5 + i % 50, 9, 11 + i % 7] for i in range(200)]
    sync = tiny_server.client()
    want = {
        tuple(p): sync.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
        .choices[0]
        .text
        for p in {tuple(p) for p in prompts}
    }

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=f"{tiny_server.url}/v1",
            api_key="none",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=300)),
        )
        return await asyncio.gather(*[_stream_one(client, p, 6) for p in prompts])

    got = asyncio.run(run())
    assert got == [want[tuple(p)] for p in prompts]
    assert tiny_server.metric("atomrt:num_requests_running") == 0


def test_a_request_of_several_prompts_answers_each_as_if_alone(tiny_server):
    """A completions request with a list of prompts (one engine request each), n=2, whole and
    streamed: choice i * n + j is prompt i's sample j, with the text that prompt gets alone."""
    client = tiny_server.client()
    prompts = [[5, 6, 7], [9, 11, 13, 15], [20]]
    greedy = dict(model="tiny", max_tokens=6, temperature=0)
    alone = [client.completions.create(prompt=p, **greedy).choices[0].text for p in prompts]
    whole = client.completions.create(prompt=prompts, n=2, **greedy)
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [t for t in alone for _ in range(2)]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, n=2, stream=True, **greedy):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(6)] == [t for t in alone for _ in range(2)]


def test_a_stream_behind_the_engine_merges_what_queued_and_keeps_every_token():
    """`RequestStream.next` merges the outputs of a sample that queued up behind the one it reads
    (one SSE chunk for several steps); randomized interleavings of deliveries and reads, against
    the outputs concatenated by hand."""
    rng = random.Random(0)

    async def one_run() -> bool:
        stream = RequestStream("r")
        outs = [
            CoreOutput("r", token_ids=[i], text=f"<{i}>", logprobs=[{i: -float(i)}])
            for i in range(rng.randrange(1, 40))
        ]
        outs[-1].finished, outs[-1].finish_reason = True, "length"
        # a second sample's outputs and the end behind the first's: never merged into it
        tail = [CoreOutput("r", index=1, token_ids=[99], finished=True, finish_reason="stop"), None]
        pending, got, ended = outs + tail, [], False
        while not ended:
            for _ in range(rng.randrange(0, 4)):  # the reader delivers 0-3 outputs
                if pending:
                    stream.queue.put_nowait(pending.pop(0))
            if stream.queue.qsize() or stream._held is not _NOTHING:
                out = await stream.next()
                ended = out is None
                got += [] if ended else [out]
        first = [o for o in got if o.index == 0]
        assert [t for o in first for t in o.token_ids] == list(range(len(outs)))
        assert "".join(o.text for o in first) == "".join(f"<{i}>" for i in range(len(outs)))
        assert [lp for o in first for lp in o.logprobs] == [
            {i: -float(i)} for i in range(len(outs))
        ]
        assert [o.finished for o in first] == [False] * (len(first) - 1) + [True]
        assert first[-1].finish_reason == "length"
        assert [(o.index, o.token_ids, o.finish_reason) for o in got[len(first) :]] == [
            (1, [99], "stop")
        ]
        return len(first) < len(outs)  # some outputs were merged

    assert sum(asyncio.run(one_run()) for _ in range(200)) > 100


def test_a_cancelled_stream_frees_its_kv_blocks(smol):
    """The 135M model is slow enough on CPU that 400 tokens are still running when the client leaves."""
    with httpx.stream(
        "POST",
        f"{smol.url}/v1/completions",
        json={
            "model": "smol",
            "prompt": "Tell me a story",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        },
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
        assert smol.metric("atomrt:kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 30  # the server notices the client left at its next send
    while time.monotonic() < deadline and smol.metric("atomrt:kv_cache_usage_perc") > 0:
        time.sleep(0.2)
    assert smol.metric("atomrt:kv_cache_usage_perc") == 0
    assert smol.metric("atomrt:num_requests_running") == 0


ODD = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
KEYS = [
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stop",
    "logprobs",
    "top_logprobs",
    "seed",
    "top_k",
    "min_p",
    "presence_penalty",
    "stop_token_ids",
    "model",
    "max_completion_tokens",
]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
    body=st.dictionaries(st.sampled_from(KEYS), ODD, max_size=5),
)
def test_fuzzed_bodies_never_get_a_5xx(tiny_server, path, body):
    body = {"max_tokens": 2, **body} if "max_tokens" not in body else body
    try:
        r = httpx.post(
            f"{tiny_server.url}{path}",
            content=json.dumps(body, allow_nan=True).encode(),
            timeout=60,
        )
    except ValueError:
        return
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_the_server_answers_after_the_fuzz(tiny_server):
    out = tiny_server.client().completions.create(
        model="tiny", prompt=[5, 6], max_tokens=3, temperature=0
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3


def test_api_key_and_a_full_queue(tiny):
    server = Server(
        [
            "--model",
            str(tiny),
            *CPU_FLAGS,
            "--api-key",
            "sesame",
            "--max-queued-requests",
            "2",
            "--max-num-seqs",
            "1",
        ]
    )
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        client = server.client(api_key="sesame")
        assert client.models.list().data
        # one sequence at a time: while the first stream runs its 250 tokens the second waits in
        # the engine, so two requests are in flight and a third is refused
        body = {"model": str(tiny), "prompt": [5, 6], "max_tokens": 250, "ignore_eos": True}
        headers = {"authorization": "Bearer sesame"}
        url = f"{server.url}/v1/completions"
        with (
            httpx.stream("POST", url, json={**body, "stream": True}, headers=headers) as a,
            httpx.stream("POST", url, json={**body, "stream": True}, headers=headers) as b,
        ):
            lines = a.iter_lines()
            next(lines)
            r = httpx.post(url, json=body, headers=headers)
            assert r.status_code == 429 and r.headers["retry-after"], r.text
            assert r.json()["error"]["type"] == "rate_limit_error"
            for stream in (lines, b.iter_lines()):
                assert [x for x in stream if x][-1] == "data: [DONE]"
        r = httpx.post(url, json={**body, "max_tokens": 3}, headers=headers)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        assert server.stop() == 0


def test_sigterm_under_load_drains_and_leaves_no_process(tiny):
    """A short stream is running when SIGTERM comes, behind it 64 streams of 250 tokens that share
    one sequence slot: far more steps than the 3 s drain can run at any CPU speed. The short one
    finishes; the others end with a final error event; the server exits 0 with nothing left."""
    import psutil

    flags = ["--executor", "mp", "--shutdown-timeout", "3", "--max-num-seqs", "2"]
    server = Server(["--model", str(tiny), *CPU_FLAGS, *flags])
    family = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
    assert server.engine_pid in family and len(family) >= 2  # the engine core and its worker
    endings: list[tuple[str, Any]] = []

    async def load() -> None:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        started = asyncio.Event()

        async def one(i: int, max_tokens: int) -> None:
            last = None
            try:
                async for chunk in await client.completions.create(
                    model=str(tiny),
                    prompt=[5, 6 + i % 50],
                    max_tokens=max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    last = chunk
                    started.set()
                endings.append(("done", last.choices[0].finish_reason))
            except openai.APIError as e:  # the final error event of a request cut by the drain
                endings.append(("error", str(e)))

        short = asyncio.ensure_future(one(0, 30))
        await started.wait()
        tasks = [short] + [asyncio.ensure_future(one(i, 250)) for i in range(1, 65)]
        await asyncio.sleep(0.2)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient() as h:  # draining for 3 s: refuses new work, still alive
            r = await h.post(f"{server.url}/v1/completions", json={"prompt": [5], "max_tokens": 1})
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
            assert (await h.get(f"{server.url}/ready")).status_code == 503
            assert (await h.get(f"{server.url}/health")).status_code == 200
        await asyncio.gather(*tasks)

    asyncio.run(load())
    assert server.proc.wait(60) == 0
    kinds = [kind for kind, _ in endings]
    assert len(endings) == 65 and "done" in kinds and "error" in kinds, endings
    assert all(reason == "length" for kind, reason in endings if kind == "done")
    assert all("shutting down" in text for kind, text in endings if kind == "error"), endings
    assert wait_gone(family) == []
    assert not pid_alive(server.proc.pid)


def test_an_engine_failure_ends_requests_clearly_and_exits_nonzero(tiny):
    import psutil

    server = Server(["--model", str(tiny), *CPU_FLAGS, "--executor", "mp"])
    workers = psutil.Process(server.engine_pid).children(recursive=True)
    family = [server.engine_pid] + [p.pid for p in workers]
    body = {"prompt": [5, 6], "max_tokens": 250, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for i, line in enumerate(r.iter_lines()):
            if i == 2:
                for p in workers:
                    p.kill()  # the rank dies mid-request: the engine stops
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "engine" in error["message"], error
    assert server.proc.wait(60) == 1
    time.sleep(0.5)  # the reader takes the last lines
    assert any("the engine stopped" in line for line in server.lines), "".join(server.lines)
    assert wait_gone(family) == []


def test_the_api_process_starts_its_engine_core_before_importing_torch():
    """`atomrt serve` spawns the engine core from modules that import no torch, transformers or
    engine code: those imports (the tokenizer's) run while the core starts, not before it."""
    code = (
        "import sys\n"
        "import atomrt.runtime.entrypoints.cli\n"
        "import atomrt.runtime.entrypoints.openai.api_server\n"
        "print(sorted(m for m in ('torch', 'transformers', 'atomrt.runtime.driver.engine') "
        "if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_serve_spawns_the_engine_core_before_importing_the_http_stack(tiny):
    """`atomrt serve` starts the engine core before it imports FastAPI and uvicorn, so that the
    core's import of torch runs beside them: the spawn, intercepted, sees neither loaded."""
    port = get_free_port("127.0.0.1")
    code = (
        "import sys, multiprocessing.process as p\n"
        "def start(self):\n"
        "    seen = sorted(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules)\n"
        "    print('SPAWNED', self.name, seen, flush=True)\n"
        "    raise SystemExit(3)\n"
        "p.BaseProcess.start = start\n"
        "from atomrt.runtime.entrypoints.cli import main\n"
        f"main(['serve', '--model', {str(tiny)!r}, '--port', '{port}', *{CPU_FLAGS!r}])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "SPAWNED atomrt-engine-core []" in out.stdout, out.stdout + out.stderr


def test_requests_wait_for_the_tokenizer_as_for_the_engine(tiny):
    """A state whose tokenizer is still loading refuses generation, tokenization and /ready as
    starting (503), even with the engine core up."""
    from atomrt.runtime.config import Config
    from atomrt.runtime.entrypoints.openai.api_server import (
        PENDING,
        RequestError,
        ServerArgs,
        ServerState,
        _need_tokenizer,
    )

    state = ServerState(Config(model=str(tiny), device="cpu"), ServerArgs())
    state.client.ready = object()  # as if the core had said it is up
    assert state.serving.tokenizer is PENDING and state.starting
    for refuse in (state.admit, lambda: _need_tokenizer(state)):
        with pytest.raises(RequestError, match="starting") as e:
            refuse()
        assert e.value.status == 503
    state.serving.tokenizer = None  # a model without one: loaded, nothing to load
    assert not state.starting
    state.admit()
    state.client.cleanup()


def test_a_tokenizer_that_does_not_load_ends_serve_clearly(tiny, tmp_path):
    """The tokenizer loads while the engine core starts; when it fails, `atomrt serve` says why
    (no traceback), exits 1 and leaves no engine core behind."""
    import psutil

    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "atomrt.runtime.entrypoints.cli", "serve",
         "--port", str(get_free_port("127.0.0.1")), "--model", str(tiny),
         "--set", f"model_config.tokenizer={empty}", *CPU_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    children: set[int] = set()
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            children.update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    out = proc.communicate()[0]
    assert proc.returncode == 1, out
    assert "atomrt: error:" in out and "tokenizer" in out and "Traceback" not in out, out
    assert children, "no engine core was started"
    assert wait_gone(sorted(children)) == []


@pytest.mark.slow
def test_the_ray_executor_serves(tiny):
    server = Server(["--model", str(tiny), *CPU_FLAGS, "--executor", "ray"])
    try:
        out = server.client().completions.create(
            model=str(tiny), prompt=[5, 6], max_tokens=4, temperature=0
        )
        assert out.usage.completion_tokens == 4
        assert httpx.get(f"{server.url}/ready").status_code == 200
    finally:
        assert server.stop() == 0


def test_bench_serve_against_a_running_server(tiny_server, tmp_path):
    from atomrt.runtime.bench.serve import main as bench_serve

    report, png = tmp_path / "serve.json", tmp_path / "serve.png"
    common = ["--url", tiny_server.url, "--no-progress", "--json", str(report)]
    rc = bench_serve(
        [
            *common,
            "--num-prompts",
            "8",
            "--input-len",
            "6",
            "--output-len",
            "5",
            "--concurrency",
            "1,4",
            "--plot",
            str(png),
            "--record",
            str(tmp_path / "records"),
        ]
    )
    runs = json.loads(report.read_text())["runs"]
    assert rc == 0 and [r["concurrency"] for r in runs] == [1, 4]
    for r in runs:
        assert r["failed"] == 0 and r["num_requests"] == 8
        assert r["output_tokens_per_s"] > 0 and 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert r["tpot_ms"]["p50"] > 0 and r["itl_ms"]["p50"] > 0
        # the server's side of the run, from its /metrics before and after: 8 requests of 5
        # tokens take at least 5 steps (at most 8 x 5: a prefill step makes the first token)
        assert 0 <= r["server_queue_ms_mean"] <= r["server_ttft_ms_mean"]
        assert 5 <= r["server_steps"] <= 40
        # chunks that carried tokens: one per token unless a reader fell behind (merged)
        assert r["output_tokens"] == 40 and 8 <= r["chunks"] <= 40
        assert len(r["requests"]) == 8 and all(0 < ttft <= lat for _, ttft, lat in r["requests"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the record: tokens/s (no offline run against a server it did not start) and the mean
    # request latency of each concurrency
    (record,) = check_records(tmp_path / "records", "serve")
    cases = [", ".join([f"tiny c={c}, 6 → 5 tokens", *env_variant()]) for c in (1, 4)]
    assert [(f.target, f.case) for f in record.figures] == [
        (t, case) for case in cases for t in ("serving", "serving-latency")
    ]
    for r, (rate, latency) in zip(runs, zip(record.figures[0::2], record.figures[1::2])):
        assert (rate.value, rate.anchor, rate.threshold) == (r["output_tokens_per_s"], None, None)
        assert rate.extra["TTFT p50"].value == r["ttft_ms"]["p50"]
        mean = sum(lat for _, _, lat in r["requests"]) / len(r["requests"])
        assert latency.value == pytest.approx(mean, abs=0.1) and latency.unit == "ms"

    sharegpt = tmp_path / "sharegpt.json"
    turns = [{"from": "human", "value": "w5 w6 w7"}, {"from": "gpt", "value": "w8 w9 w10 w11"}]
    sharegpt.write_text(json.dumps([{"conversations": turns}, {"conversations": turns[:1]}]))
    rc = bench_serve(
        [*common, "--num-prompts", "3", "--dataset", str(sharegpt), "--request-rate", "inf"]
    )
    (run,) = json.loads(report.read_text())["runs"]
    assert rc == 0 and run["failed"] == 0 and run["request_rate"] == float("inf")
    assert run["output_tokens_per_s"] > 0  # each request made its answer's 4 tokens


def test_offline_comparison_runs_at_each_concurrency(tiny, monkeypatch):
    """`--compare-offline`'s engine keeps at most the run's concurrency of requests in flight
    (a finished one replaced by the next), as the server's clients do; None: all at once."""
    from atomrt.runtime.bench import serve as bench
    from atomrt.runtime.bench.serve_views import offline_tokens_per_s
    from atomrt.runtime.driver.engine import LLMEngine

    requests = [bench.Request([5 + i, 6, 7, 8], 3 + i % 3) for i in range(10)]
    in_flight: list[int] = []  # requests the engine holds at each step
    step = LLMEngine.step

    def counting_step(self):
        in_flight.append(len(self._requests))
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", counting_step)
    rates = offline_tokens_per_s(
        ["--model", str(tiny), *CPU_FLAGS], requests, [2, 2, None], progress=False
    )
    assert list(rates) == [2, None]
    assert all(rate > 0 and steps > 0 for rate, steps in rates.values())
    # the warm-up's 8 requests, then the run at 2, then the 10 at once
    warm_end = len(in_flight) - in_flight[::-1].index(8)
    at_two = in_flight[warm_end : in_flight.index(10)]
    assert at_two and max(at_two) == 2
    assert max(in_flight) == 10


def test_bench_serve_on_a_model_without_a_tokenizer(tmp_path, capsys):
    """Dummy weights of a preset have no tokenizer: the bench starts the server itself, sends
    prompts of token ids, and counts each streamed chunk (text-less) as a token. Four requests at
    concurrency 2 are two waves: the bench says that the ramp weighs on the figure."""
    from atomrt.runtime.bench.serve import main as bench_serve

    report = tmp_path / "serve.json"
    engine = ["--model", "tiny-qwen3-moe", "--load-format", "dummy", "--device", "cpu"]
    rc = bench_serve(
        [*engine, "--enforce-eager", "--no-progress", "--json", str(report), "--num-prompts", "4"]
        + ["--input-len", "5", "--output-len", "4", "--concurrency", "2"]
        + ["--record", str(tmp_path / "records")]
    )
    (run,) = json.loads(report.read_text())["runs"]
    assert rc == 0 and run["failed"] == 0 and run["num_requests"] == 4
    assert run["output_tokens_per_s"] > 0 and run["itl_ms"]["p50"] > 0
    assert "under four waves" in capsys.readouterr().err
    # the server's engine flags, --model aside, name the case: another config, another row
    (record,) = check_records(tmp_path / "records", "serve")
    flags = "--enforce-eager --load-format dummy --device cpu"  # one order, whatever was typed
    case = ", ".join(["tiny-qwen3-moe c=2, 5 → 4 tokens", flags, *env_variant()])
    assert [(f.target, f.case) for f in record.figures] == [
        ("serving", case),
        ("serving-latency", case),
    ]

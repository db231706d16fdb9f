"""Structured outputs and tool calling through `atomrt serve` with the official `openai` client, on a
tiny random model with a real BPE vocabulary (its own text is noise: what validates is the grammar's
doing).

- `response_format` json_schema (strict) and json_object, vLLM's `structured_outputs`, streamed and
  not, validate; a constraint that does not parse is a 400 naming the field that set it.
- `tool_choice` "required" and a named function return `tool_calls` whose arguments validate
  against the tool's parameters, streamed and not, the streamed deltas in OpenAI's form (a call's
  first delta with id, type and name, then argument fragments; finish_reason "tool_calls") and
  joined equal to the non-streamed calls.
- `tool_choice` "auto" with the server's parser (`--enable-auto-tool-choice --tool-call-parser`):
  the model's text (here forced to a recorded Qwen-style output) becomes the calls.
- A schema whose grammar takes longer than the compile budget fails that request with a 503 and
  Retry-After while another streams on; one that compiles for seconds delays neither GET /health
  nor other requests (the parse and compile run on the engine's compile threads).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from test_server import Server
from test_structured_outputs import _slow_schema

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# A Qwen2.5-style answer that calls both tools (hermes format), as the model writes it
HERMES_OUTPUT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server(tiny_bpe_tools_server: Server) -> Server:
    """The session's tiny BPE server: hermes parser, a 1 s compile budget (conftest.py)."""
    return tiny_bpe_tools_server


def _chat(server: Server, stream: bool = False, **kwargs: Any) -> Any:
    body = dict(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0.0, seed=0)
    return server.client().chat.completions.create(**{**body, **kwargs}, stream=stream)


def _joined(chunks: Any) -> tuple[str, dict[int, dict[str, Any]], list[str]]:
    """A stream's content, its calls joined by index, and its finish reasons."""
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            for tc in d.tool_calls or ():
                call = calls.setdefault(tc.index, {"arguments": ""})
                if tc.id is not None:  # the call's first delta
                    assert "id" not in call and tc.type == "function" and tc.function.name
                    call.update(id=tc.id, name=tc.function.name)
                call["arguments"] += tc.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons


def test_response_format_json_schema_validates(server) -> None:
    schema = SCHEMAS["get_weather"]
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    out = _chat(server, response_format=fmt, temperature=1.0)
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert out.choices[0].finish_reason == "stop"
    content, _, reasons = _joined(_chat(server, True, response_format=fmt, temperature=1.0))
    jsonschema.validate(json.loads(content), schema)
    obj = _chat(server, response_format={"type": "json_object"}, temperature=1.0, max_tokens=400)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = _chat(server, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")


def test_tool_choice_required_and_named_return_valid_calls_streamed_and_not(server) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("required", named):
        out = _chat(server, tools=TOOLS, tool_choice=tool_choice)
        msg = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and msg.tool_calls
        for call in msg.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        content, calls, reasons = _joined(_chat(server, True, tools=TOOLS, tool_choice=tool_choice))
        assert reasons == ["tool_calls"] and not content
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in msg.tool_calls
        ]
    one = _chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1


def test_tool_choice_auto_reads_the_calls_from_the_model_text(server) -> None:
    forced = {"structured_outputs": {"choice": [HERMES_OUTPUT]}}  # the model "writes" it
    out = _chat(server, tools=TOOLS, extra_body=forced)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and msg.content == "Let me check."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert got == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]
    content, calls, reasons = _joined(_chat(server, True, tools=TOOLS, extra_body=forced))
    assert reasons == ["tool_calls"] and content == "Let me check."
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in msg.tool_calls
    ]


def test_bad_constraints_are_400s_naming_their_field(server) -> None:
    cases = [
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            ),
            "response_format",
        ),
        (dict(extra_body={"structured_outputs": {"regex": "a(b"}}), "structured_outputs"),
        (
            dict(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "array", "uniqueItems": True},
                        },
                    }
                ],
                tool_choice="required",
            ),
            "tool_choice",
        ),
        (
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
        ),
        (
            dict(
                response_format={"type": "json_object"},
                extra_body={"structured_outputs": {"regex": "a"}},
            ),
            "structured_outputs",
        ),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(server, **kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)


def test_a_schema_over_the_compile_budget_is_a_503_while_another_streams(server) -> None:
    """A compile that misses the budget is the busy machine's 503 with Retry-After (a retry finds
    it compiled), streamed or not; meanwhile another request streams on."""
    streamed: list[str] = []

    def stream() -> None:
        for chunk in _chat(server, True, max_tokens=120, extra_body={"ignore_eos": True}):
            streamed.extend(c.delta.content or "" for c in chunk.choices)

    t = threading.Thread(target=stream)
    t.start()
    bodies = []
    for stream_it, n in ((True, 900), (False, 901)):
        fmt = {"type": "json_schema", "json_schema": {"name": "slow", "schema": _slow_schema(n)}}
        bodies.append(dict(model="tiny", messages=MESSAGES, max_tokens=8, response_format=fmt))
        r = httpx.post(
            f"{server.url}/v1/chat/completions", json={**bodies[-1], "stream": stream_it}
        )
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        error = r.json()["error"]
        assert "grammar_compile_timeout_s" in error["message"]
        assert error["param"] == "response_format" and error["type"] == "service_unavailable"
    t.join(120)
    assert not t.is_alive() and len("".join(streamed)) > 0
    deadline = time.monotonic() + 180
    for body in bodies:  # a retry finds it compiled (the compile went on)
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        while r.status_code == 503 and time.monotonic() < deadline:
            time.sleep(float(r.headers["retry-after"]))
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text


def test_a_schema_that_compiles_for_seconds_delays_neither_health_nor_others(server) -> None:
    """Its parse and compile run on the engine's compile threads: GET /health and a plain request
    answer while it compiles; a long string bound compiles at once; a bad schema streamed is still
    a 400 naming its field."""
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": _slow_schema(1200)}}
    body = dict(model="tiny", messages=MESSAGES, max_tokens=8, response_format=fmt)
    slow: dict[str, Any] = {}

    def send() -> None:
        start = time.monotonic()
        slow["status"] = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        slow["seconds"] = time.monotonic() - start

    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.3)
    start = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    health_s = time.monotonic() - start
    start = time.monotonic()
    _chat(server, max_tokens=4)
    plain_s = time.monotonic() - start
    long = {"type": "object", "properties": {"u": {"type": "string", "maxLength": 8192}}}
    start = time.monotonic()
    out = _chat(
        server,
        max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "u", "schema": long}},
    )
    long_s = time.monotonic() - start
    t.join(120)
    assert slow["status"].status_code == 503 and slow["seconds"] >= 1.0  # the budget: 1 s
    assert health_s < 0.5 and plain_s < 5.0 and long_s < 5.0, (health_s, plain_s, long_s)
    assert out.choices[0].finish_reason in ("stop", "length")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={**body, "response_format": bad, "stream": True},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "'not' at #" in r.json()["error"]["message"]
    deadline = time.monotonic() + 180
    r = slow["status"]
    while r.status_code == 503 and time.monotonic() < deadline:  # its compile ends, kept
        time.sleep(float(r.headers["retry-after"]))
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_bench_serve_structured_output_ratios_and_compile_stall(server, tmp_path, monkeypatch):
    from atomrt.runtime.bench import structured
    from atomrt.runtime.bench.serve import main as bench_serve

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}}))
    small = lambda i, seed: {"type": "object", "properties": {f"p{i}": {"enum": [i]}}}  # noqa: E731
    monkeypatch.setattr(structured, "stall_schema", small)
    monkeypatch.setattr(structured, "STALL_BASELINE_S", 0.5)
    report = tmp_path / "report.json"
    args = ["--url", server.url, "--no-progress", "--json", str(report), "--num-prompts", "8"]
    args += ["--input-len", "4", "--output-len", "40", "--concurrency", "4"]
    args += ["--structured-output-ratio", "0,1", "--json-schema", str(schema), "--compile-stall"]
    assert bench_serve([*args, "--record", str(tmp_path / "records")]) == 0
    data = json.loads(report.read_text())
    plain, constrained = (r["structured"] for r in data["runs"])
    assert plain["ratio"] == 0 and plain["num_structured"] == 0
    assert constrained["num_structured"] == constrained["num_valid"] == 8
    assert constrained["compile_cached_ms"] is not None and constrained["mask_fill_us_per_row"] > 0
    assert data["compile_stall"]["gaps_during"] >= 0 and data["compile_stall"]["itl_before_ms"] > 0
    from atomrt.runtime.bench.records import load_records

    ((_, record),) = load_records(tmp_path / "records")
    by_target = {f.target: f for f in record.figures}
    ratio_1 = [f for f in record.figures if f.case.endswith("x1") or " x1," in f.case][0]
    assert ratio_1.anchor == data["runs"][0]["output_tokens_per_s"]
    assert ratio_1.threshold.value == 0.95 and ratio_1.extra["valid"].value == 100.0
    assert "structured-outputs" in by_target


def test_bench_structured_outputs_tell_a_cut_output_from_an_invalid_one() -> None:
    """An output that fails the schema because max_tokens cut it counts as cut; any other
    failure is shown with its error and text, so that a grammar letting a wrong token through
    shows in the bench's line."""
    from atomrt.runtime.bench import structured

    schema = {"type": "object", "properties": {"age": {"type": "integer", "maximum": 99}}}
    outputs = [
        ('{"age": 5}', "stop"),
        ('{"age": 1', "length"),  # cut: unfinished JSON
        ('{"age": 150}', "stop"),  # closed, but out of the schema's range
        ('{"age": "x"}', "stop"),
    ]
    valid, cut, first = structured.validate(schema, outputs)
    assert (valid, cut) == (1, 1)
    assert "150 is greater than the maximum of 99" in first and '{"age": 150}' in first
    line = structured.describe(structured.StructuredView(1.0, 4, valid, cut, first))
    assert "1/4 valid (1 cut at max_tokens)" in line and line.endswith(first)
    clean = structured.describe(structured.StructuredView(1.0, 1, 1))
    assert "1/1 valid;" in clean and "cut" not in clean and "invalid" not in clean

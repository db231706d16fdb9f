"""`POST /v1/responses` through `atomrt serve` with the official `openai` client's
`client.responses.create`, streamed and not, on a tiny random model with a real BPE vocabulary:
text (the same tokens as the chat request it means), `text.format` json_schema, function tools
with `tool_choice`, and the stateless refusals (`previous_response_id`, `store`)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from test_server import Server

WEATHER = {
    "type": "function",
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
}
CLOCK = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
    },
}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, CLOCK)}


@pytest.fixture(scope="module")
def server(tiny_bpe_tools_server: Server) -> Server:
    """The session's tiny BPE server with the hermes parser (conftest.py)."""
    return tiny_bpe_tools_server


def _create(server: Server, **kwargs: Any) -> Any:
    body = dict(model="tiny", temperature=0.0, max_output_tokens=12)
    return server.client().responses.create(**{**body, **kwargs})


def _events(stream: Any) -> tuple[list[Any], str, Any]:
    """The events, the joined text deltas and the final response of a stream."""
    events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return events, text, events[-1].response


def test_text_matches_the_chat_request_it_means(server) -> None:
    resp = _create(server, input="Tell me a story", instructions="You are terse.")
    chat = server.client().chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me a story"},
        ],
        temperature=0.0,
        max_tokens=12,
    )
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.store is False and resp.instructions == "You are terse."
    # input as messages, with content parts
    parts = _create(
        server,
        input=[
            {"role": "developer", "content": "You are terse."},
            {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]},
        ],
    )
    assert parts.output_text == resp.output_text


def test_streamed_events_join_to_the_response(server) -> None:
    whole = _create(server, input="Tell me a story", top_p=0.9)
    events, text, final = _events(_create(server, input="Tell me a story", top_p=0.9, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert text == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_text_format_json_schema_validates(server) -> None:
    schema = SCHEMAS["get_weather"]
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}}
    resp = _create(server, input="Weather?", text=fmt, temperature=1.0, max_output_tokens=200)
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"
    _, text, final = _events(
        _create(
            server, input="Weather?", text=fmt, temperature=1.0, max_output_tokens=200, stream=True
        )
    )
    jsonschema.validate(json.loads(text), schema)
    assert final.status == "completed"


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools_and_tool_choice(server, stream: bool) -> None:
    for choice, names in (
        ("required", set(SCHEMAS)),
        ({"type": "function", "name": "get_time"}, {"get_time"}),
    ):
        kwargs = dict(
            input="What is the weather in Paris?",
            tools=[WEATHER, CLOCK],
            tool_choice=choice,
            temperature=1.0,
            max_output_tokens=200,
        )
        if stream:
            events, _, resp = _events(_create(server, stream=True, **kwargs))
            done = [e for e in events if e.type == "response.function_call_arguments.done"]
            assert done and all(e.name in names for e in done)
        else:
            resp = _create(server, **kwargs)
        calls = [item for item in resp.output if item.type == "function_call"]
        assert calls, resp.output
        for call in calls:
            assert call.name in names and call.call_id
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        # the call's answer goes back as input items, statelessly
        follow = _create(
            server,
            input=[
                {"role": "user", "content": "What is the weather in Paris?"},
                {
                    "type": "function_call",
                    "call_id": calls[0].call_id,
                    "name": calls[0].name,
                    "arguments": calls[0].arguments,
                },
                {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"},
            ],
            tools=[WEATHER, CLOCK],
        )
        assert follow.status in ("completed", "incomplete")


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"extra_body": {"zz_nobody": 1}}, "zz_nobody"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
    ],
)
def test_refusals_name_the_field(server, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _create(server, input="Hi", **kwargs)
    error = e.value.body
    assert error["param"] == param and param in error["message"], error

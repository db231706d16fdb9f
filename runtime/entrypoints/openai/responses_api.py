"""OpenAI's Responses API (`POST /v1/responses`) for text, stateless.

A Responses request is read into the chat request it means (`to_chat_body`: `instructions` as
the system message, `input` as messages, `max_output_tokens` as max_tokens, `text.format` as
response_format, flat function `tools` as chat tools) and runs as a chat job; its outputs are
written back as a `response` object, or as the Responses event stream (`response.created` ...
`response.output_text.delta` ... `response.completed`). Nothing is stored: `store` must be
false or absent, and `previous_response_id` and `conversation`, which need stored state, are
refused by name, as is every field this server does not honour.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Optional

from atomrt.distributed.messages import CoreOutput
from atomrt.runtime.entrypoints.openai.protocol import RequestError, refused
from atomrt.runtime.entrypoints.openai.serving import Choice, Job, Serving

# Fields taken, and what a chat request calls them (None: read here, not passed on)
_FIELDS: dict[str, Optional[str]] = {
    "model": "model",
    "input": None,
    "instructions": None,
    "max_output_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stream": "stream",
    "text": None,
    "tools": None,
    "tool_choice": None,
    "parallel_tool_calls": "parallel_tool_calls",
    "store": None,
    "metadata": None,
    "user": None,
    "safety_identifier": None,
    "prompt_cache_key": None,
    "service_tier": None,
    "truncation": None,
    "include": None,
    "background": None,
    "previous_response_id": None,
    "conversation": None,
    "reasoning": None,
    "stream_options": None,
}
# what an error about a chat field names in the Responses request
_CHAT_TO_RESPONSES = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("input: must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where}: must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(
                    f"{where}.role: one of user, system, developer, assistant, got {role!r}",
                    "input",
                )
            role = "system" if role == "developer" else role  # OpenAI's newer name of it
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output)
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
            )
        else:
            raise RequestError(
                f"{where}.type: {kind!r} is not supported (message, function_call, "
                "function_call_output)",
                "input",
            )
    return messages


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content: must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise RequestError(
                f"{where}.content[{j}].type: {kind!r} is not supported (text only)", "input"
            )
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _tools(tools: Any) -> Optional[list[dict[str, Any]]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools: must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestError(
                f"tools[{i}].type: {kind!r} is not supported (function tools only)", "tools"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise RequestError(
        "tool_choice: 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
        "tool_choice",
    )


def _response_format(text: Any) -> Optional[dict[str, Any]]:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise RequestError("text: must be an object", "text")
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise refused(f"text.{unknown[0]}", "not supported")
    if text.get("verbosity") not in (None, "medium"):
        raise refused("text.verbosity", "this server runs no model that takes a verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError(
        f"text.format.type: one of text, json_object, json_schema, got {kind!r}", "text.format"
    )


def to_chat_body(body: Any) -> dict[str, Any]:
    """The chat request a Responses request means; a RequestError names what is refused."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    for name in body:
        if name not in _FIELDS:
            raise refused(name, "not supported by this server's /v1/responses")
    if body.get("previous_response_id") is not None:
        raise refused(
            "previous_response_id",
            "this server stores no responses; send the whole conversation as input",
        )
    if body.get("conversation") is not None:
        raise refused("conversation", "this server stores no conversations")
    if body.get("store") not in (None, False):
        raise refused("store", "this server stores no responses; send store: false")
    if body.get("background") not in (None, False):
        raise refused("background", "background responses need stored state")
    if body.get("include"):
        raise refused("include", "no extra output items are available")
    if body.get("reasoning") is not None:
        raise refused("reasoning", "this server runs no reasoning model")
    if body.get("truncation") not in (None, "disabled"):
        raise refused("truncation", "only 'disabled' (a prompt that is too long is an error)")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise refused("service_tier", "this server has one tier")
    if "input" not in body:
        raise RequestError("input: is required", "input")
    messages = _input_messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions: must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {"messages": messages}
    for name, chat_name in _FIELDS.items():
        if chat_name is not None and body.get(name) is not None:
            chat[chat_name] = body[name]
    if body.get("stream_options") is not None:
        chat["stream_options"] = {
            k: v for k, v in body["stream_options"].items() if k == "include_usage"
        }
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


async def peeked(outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`outputs` once its first item is in: what refuses the request (a constraint that does not
    compile) raises here, before a 200 stream has begun."""
    it = outputs.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        return it

    async def rest() -> AsyncIterator[Any]:
        yield first
        async for item in it:
            yield item

    return rest()


def renamed(e: RequestError) -> RequestError:
    """A chat request's error in the Responses request's words."""
    param = e.param or ""
    head = param.split(".")[0]
    if head not in _CHAT_TO_RESPONSES:
        return e
    new = _CHAT_TO_RESPONSES[head] + param[len(head) :]
    message = str(e)
    if message.startswith(param):
        message = new + message[len(param) :]
    elif message.startswith(head):
        message = _CHAT_TO_RESPONSES[head] + message[len(head) :]
    return RequestError(message, new, e.status, e.kind)


class ResponsesBodies:
    """The `response` object and event stream of one Responses request, from its chat job."""

    def __init__(self, serving: Serving, body: dict[str, Any], job: Job) -> None:
        self.serving = serving
        self.body = body
        self.job = job
        self.id = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._seq = 0

    # ------------------------------------------------------------ the response object

    def _envelope(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        b = self.body
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "model": self.serving.model_name,
            "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": b.get("temperature", 1.0),
            "text": {"format": fmt},
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "top_p": b.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": None,
            "metadata": b.get("metadata") or {},
            "user": b.get("user"),
        }

    def _usage(self) -> dict[str, Any]:
        u = self.job.usage()
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        }

    def _message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.msg_id,
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }

    def _output_items(self, c: Choice) -> list[dict[str, Any]]:
        """The choice's text as a message item, its tool calls as function_call items."""
        parser = self.job.tool_parser
        if parser is None:
            return [self._message_item(c.text)]
        parsed = parser.parse(c.text, final=True)
        items = []
        if parsed.content:
            items.append(self._message_item(parsed.content))
        for call in parsed.calls:
            if call.name is None:
                continue
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": f"call_{uuid.uuid4().hex[:24]}",
                    "name": call.name,
                    "arguments": call.arguments,
                    "status": "completed",
                }
            )
        return items or [self._message_item("")]

    def _status(self, c: Choice) -> str:
        return "incomplete" if c.finish_reason == "length" else "completed"

    def response(self) -> dict[str, Any]:
        c = self.job.choices[0]
        out = self._envelope(self._status(c), self._output_items(c))
        out["usage"] = self._usage()
        return out

    # ------------------------------------------------------------ the event stream

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _part_event(self, kind: str, **fields: Any) -> str:
        """An event about the message's one text part."""
        return self._event(kind, item_id=self.msg_id, output_index=0, content_index=0, **fields)

    async def events(self, outputs: AsyncIterator[tuple[Choice, CoreOutput]]) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._envelope("in_progress", []))
        yield self._event("response.in_progress", response=self._envelope("in_progress", []))
        streamed = self.job.tool_parser is None  # text streams as it comes; tool calls at the end
        if streamed:
            yield self._event(
                "response.output_item.added",
                output_index=0,
                item={**self._message_item("", "in_progress"), "content": []},
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield self._part_event("response.content_part.added", part=part)
        async for _, out in outputs:
            if streamed and out.text:
                yield self._part_event("response.output_text.delta", delta=out.text, logprobs=[])
        c = self.job.choices[0]
        items = self._output_items(c)
        if streamed:
            text = items[0]["content"][0]["text"]
            yield self._part_event("response.output_text.done", text=text, logprobs=[])
            yield self._part_event("response.content_part.done", part=items[0]["content"][0])
            yield self._event("response.output_item.done", output_index=0, item=items[0])
        else:
            for i, item in enumerate(items):
                for chunk in self._whole_item(i, item):
                    yield chunk
        final = self._envelope(self._status(c), items)
        final["usage"] = self._usage()
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield self._event(kind, response=final)

    def _whole_item(self, index: int, item: dict[str, Any]) -> list[str]:
        """The events of an output item that is sent once it is complete."""
        if item["type"] == "message":
            part = item["content"][0]
            start = {**item, "status": "in_progress", "content": []}
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            return [
                self._event("response.output_item.added", output_index=index, item=start),
                self._event("response.content_part.added", **where, part={**part, "text": ""}),
                self._event("response.output_text.delta", **where, delta=part["text"], logprobs=[]),
                self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        start = {**item, "arguments": "", "status": "in_progress"}
        where = {"item_id": item["id"], "output_index": index}
        return [
            self._event("response.output_item.added", output_index=index, item=start),
            self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self._event(
                "response.function_call_arguments.done",
                **where,
                arguments=item["arguments"],
                name=item["name"],
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

"""Tools in chat requests: what `tools` and `tool_choice` must hold, what "required" constrains the
output to, and the calls in a model's text: the parsers `--tool-call-parser` names (vLLM's
names), and the streamed deltas of OpenAI's chunk format.

A parser reads the whole text so far (`parse(text, final)`) and returns the content a client may be
shown and the calls it holds, each possibly unfinished. A call's `arguments` are the model's own
text of the arguments object (arguments written as a JSON string: the string's text, once it is
complete), so the fragments streamed add up to exactly the arguments a non-streamed response
carries; JSON is read string-aware, so a tag inside a string value is text. `ToolCallStream` turns
successive parses into deltas: a call's first delta has its id, type and name, the next ones
argument fragments. What is not a call stays content: JSON that names no function (llama3_json),
and, with a warning logged, a broken call (not JSON, unfinished at the end, no name, arguments that
are not a JSON object): the whole text is then the content, as vLLM's parsers answer.

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, content around them.
- `llama3_json` (Llama 3.1-3.3): the output is one call `{"name": ..., "parameters": {...}}` or
  several separated by `;`, optionally after `<|python_tag|>`; any other output is content.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`, or (later
  Mistral tokenizers) each call as `[TOOL_CALLS]name{...}` or `[TOOL_CALLS]name[ARGS]{...}`; the
  server keeps special tokens in the text for it.
- `json_calls` (not a flag: what `tool_choice: "required"` makes the model write): a JSON array
  of `{"name": ..., "parameters": {...}}`.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

PARSERS = ("hermes", "llama3_json", "mistral")
Json = dict[str, Any]


def check_tools(tools: Optional[list[Json]], tool_choice: Any) -> None:
    """`tools` as OpenAI defines them (functions with names), and a `tool_choice` they allow; a
    ValueError whose message starts with the field."""
    names = []
    for i, tool in enumerate(tools or ()):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f'tools[{i}]: must be {{"type": "function", "function": {{...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name: must be a non-empty string")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema")
        names.append(name)
    if tool_choice in (None, "none", "auto", "required"):
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools")
        return
    if isinstance(tool_choice, str):
        raise ValueError(
            f"tool_choice: 'none', 'auto', 'required' or a function, got {tool_choice!r}"
        )
    function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    if not isinstance(function, dict) or function.get("name") not in names:
        raise ValueError(
            f"tool_choice: names no function of tools ({', '.join(names) or 'none given'})"
        )


def required_calls_schema(tools: list[Json], parallel: Optional[bool]) -> Json:
    """What tool_choice "required" constrains the output to: a JSON array of at least one call
    (at most one without parallel_tool_calls), each `{"name": ..., "parameters": ...}` of a tool."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: Json = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


@dataclass
class Call:
    name: Optional[str]  # None until the name's string is complete
    arguments: str  # the arguments' text so far
    done: bool  # the call's object is complete


@dataclass
class Parsed:
    content: str  # what may be shown as content (a possible tag's start held back until final)
    calls: list[Call] = field(default_factory=list)


def _objects(text: str, arg_keys: tuple[str, ...]) -> list[Call]:
    """The JSON objects at the top level of `text` (one after another, or in an array: a leading
    `[` is skipped), each as a Call: its complete `"name"` string and the raw text of the object
    or array that its first `arg_keys` key holds."""
    body = text.lstrip()
    offset = len(text) - len(body)
    if body[:1] == "[":
        offset += 1
    calls: list[Call] = []
    depth = 0
    start: Optional[int] = None  # the open object's first character
    name: Optional[str] = None
    key: Optional[str] = None  # the key whose value comes next, at depth 1
    args: Optional[list] = None  # [first, end or None] of the arguments' text
    for i, ch, opened in _structure(text, offset):
        if ch == '"':
            if depth == 1 and start is not None:
                word = json.loads(text[opened : i + 1])
                if text[i + 1 :].lstrip()[:1] == ":":
                    key = word
                elif key == "name" and name is None:
                    name = word
                elif key in arg_keys and args is None:  # arguments written as a JSON string
                    args = word
        elif ch in "{[":
            depth += 1
            if depth == 1 and ch == "{":
                start, name, key, args = i, None, None, None
            elif depth == 2 and key in arg_keys and args is None:
                args = [i, None]
        elif ch in "}]":
            depth -= 1
            if depth == 1 and args is not None and args[1] is None:
                args[1] = i + 1
            elif depth == 0 and start is not None:
                calls.append(_call(text, name, args, done=True))
                start = None
            if depth < 0:  # the array's end
                break
        elif ch == "," and depth == 1:
            key = None
    if start is not None:
        calls.append(_call(text, name, args, done=False))
    return calls


def _call(text: str, name: Optional[str], args: Any, done: bool) -> Call:
    if isinstance(args, str):  # a JSON string's text: the arguments, once complete
        return Call(name, args, done)
    if args is None:  # no arguments: an empty object once the call is complete
        return Call(name, "{}" if done else "", done)
    lo, hi = args
    return Call(name, text[lo:hi] if hi is not None else text[lo:].rstrip(), done)


def _content(text: str, tag: str, final: bool) -> str:
    """Text without a call yet, as content: all of it when final; else without a tail that could
    start `tag`, nor the whitespace before it (content before a call ends without it)."""
    if final:
        return text
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            text = text[:-n]
            break
    return text.rstrip()


def _object_end(text: str, start: int) -> Optional[int]:
    """The index after the JSON value that opens at `text[start]` (`{` or `[`), read string-aware;
    None while it is unfinished."""
    depth = 0
    for i, ch, _ in _structure(text, start):
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _structure(text: str, start: int) -> Iterator[tuple[int, str, int]]:
    """What shapes the JSON in `text` from `start`, read string-aware: each bracket and comma
    outside strings as (index, character, -1), and each string's closing quote as (index, '"',
    the index of its opening quote)."""
    in_str, esc, opened = False, False, 0
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                yield i, ch, opened
        elif ch == '"':
            in_str, opened = True, i
        elif ch in "{[]},":
            yield i, ch, -1


def _broken(call: Call) -> Optional[str]:
    """Why a call of a final text is not one (None: it is)."""
    if not call.done:
        return "unfinished"
    if call.name is None:
        return "no function name"
    try:
        args = json.loads(call.arguments)
    except ValueError:
        return "arguments are not JSON"
    return None if isinstance(args, dict) else "arguments are not a JSON object"


def _checked(parser: str, text: str, parsed: Parsed, final: bool) -> Parsed:
    """A final text whose calls are broken is all content (with a warning); else `parsed`."""
    if not final:
        return parsed
    why = next((w for w in map(_broken, parsed.calls) if w is not None), None)
    if why is None:
        return parsed
    logger.warning("%s tool parser: a broken call (%s) is returned as content", parser, why)
    return Parsed(text)


class ToolParser:
    """Base: every parser answers `parse(text, final)`."""

    name = ""

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.OPEN)
        if first < 0:
            return Parsed(_content(text, self.OPEN, final))
        calls: list[Call] = []
        at = first
        while at >= 0:  # each call: its tag, then one JSON object (a tag inside a string is text)
            body = at + len(self.OPEN)
            while body < len(text) and text[body].isspace():
                body += 1
            if body == len(text):
                if final:
                    calls.append(Call(None, "", False))
                break
            if text[body] != "{":
                logger.warning("hermes tool parser: a <tool_call> without JSON is content")
                return Parsed(text if final else _content(text, self.OPEN, final))
            end = _object_end(text, body)
            calls += _objects(text[body:end] if end is not None else text[body:], self.KEYS)
            if end is None:
                break
            at = text.find(self.OPEN, end)
        return _checked(self.name, text, Parsed(text[:first].rstrip(), calls), final)

    KEYS = ("arguments", "parameters")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        if not final and self.TAG.startswith(text):  # the tag may be coming
            return Parsed("")
        body = text[len(self.TAG) :] if text.startswith(self.TAG) else text
        stripped = body.lstrip()
        if not stripped:
            return Parsed("")
        if not stripped.startswith("{"):
            return Parsed(text)
        calls = _objects(body, ("parameters", "arguments"))
        if final and not any(c.name is not None for c in calls):  # JSON, but not a call
            return Parsed(text)
        return _checked(self.name, text, Parsed("", calls), final)


class MistralParser(ToolParser):
    name = "mistral"
    TAG = "[TOOL_CALLS]"

    ARGS = "[ARGS]"
    _NAME = re.compile(r"[A-Za-z0-9_.-]+")

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(self.TAG)
        if at < 0:
            return Parsed(_content(text, self.TAG, final))
        body = text[at + len(self.TAG) :]
        if body.lstrip()[:1] in ("[", "{", ""):  # a JSON array of calls (or not yet known)
            calls = _objects(body, ("arguments",))
        else:  # the later tokenizers' form: each call `name{...}` or `name[ARGS]{...}` after a tag
            calls = [self._named(part) for part in body.split(self.TAG)]
        if final and not calls:
            calls = [Call(None, "", False)]  # the tag without a call
        return _checked(self.name, text, Parsed(text[:at].rstrip(), calls), final)

    def _named(self, part: str) -> Call:
        """One `name{...}` / `name[ARGS]{...}` call: its name once the arguments begin."""
        m = self._NAME.match(part)
        rest = part[m.end() :] if m else part
        if rest.startswith(self.ARGS):
            rest = rest[len(self.ARGS) :]
        elif self.ARGS.startswith(rest) and rest:  # the marker may be coming
            return Call(None, "", False)
        if m is None or not rest.startswith("{"):
            return Call(None, "", False)
        start = len(part) - len(rest)
        end = _object_end(part, start)
        args = part[start:end] if end is not None else part[start:].rstrip()
        return Call(m.group(0), args, end is not None)


class JsonCallsParser(ToolParser):
    """`tool_choice: "required"`: the grammar made the output a JSON array of calls."""

    name = "json_calls"

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", _objects(text, ("parameters",)))


class NamedParser(ToolParser):
    """A named function: the grammar made the whole output its arguments."""

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [Call(self.function, text if final else text.rstrip(), final)])


_BY_NAME = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def make_parser(name: str) -> ToolParser:
    if name not in _BY_NAME:
        raise ValueError(f"--tool-call-parser: one of {', '.join(PARSERS)}, got {name!r}")
    return _BY_NAME[name]()


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls(calls: list[Call], ids: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """The `tool_calls` of a non-streamed message (named, complete calls)."""
    out = []
    for i, c in enumerate(c for c in calls if c.name is not None):
        out.append(
            {
                "id": ids[i] if ids and i < len(ids) else call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
        )
    return out


class ToolCallStream:
    """One choice's streamed deltas: feed the text so far, get the delta fields to send."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content_sent = 0
        self.ids: list[str] = []  # one per call whose header was sent
        self.args_sent: list[int] = []

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        parsed = self.parser.parse(text, final)
        out: dict[str, Any] = {}
        if len(parsed.content) > self.content_sent:
            out["content"] = parsed.content[self.content_sent :]
            self.content_sent = len(parsed.content)
        calls = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break  # later calls wait for this one's name
            if i == len(self.ids):
                self.ids.append(call_id())
                self.args_sent.append(0)
                calls.append(
                    {
                        "index": i,
                        "id": self.ids[i],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            new = call.arguments[self.args_sent[i] :]
            if new and (call.done or final or not _may_shrink(call.arguments)):
                calls.append({"index": i, "function": {"arguments": new}})
                self.args_sent[i] = len(call.arguments)
        if calls:
            out["tool_calls"] = calls
        return out

    @property
    def called(self) -> bool:
        return bool(self.ids)


_TRAILING_SPACE = re.compile(r"\s$")


def _may_shrink(arguments: str) -> bool:
    """An unfinished arguments text ending in whitespace may lose it when the value closes (its
    text then ends at the closing brace): hold such a fragment back."""
    return bool(_TRAILING_SPACE.search(arguments))

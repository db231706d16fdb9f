"""The OpenAI API's request bodies, as atomrt checks them, and their mapping to SamplingParams.

Every field of OpenAI's completions and chat-completions request bodies is declared here, and is
either honoured or refused: a value atomrt cannot honour is a `RequestError` naming the field
(status 400), never a plausible answer without it (`check_supported`). Fields nobody defines are
ignored, with one log line per field name. A field of the wrong type or out of range is a
`RequestError` naming it. Numbers are strict: `"0.5"` is not a temperature, `true` is not a count.
The same models describe the request bodies in the server's OpenAPI document (/openapi.json).
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from atomrt.runtime.entrypoints.openai.errors import Json, RequestError, refused, renamed
from atomrt.runtime.entrypoints.openai.response_format import check_response_format, structural_tag
from atomrt.runtime.entrypoints.openai.tool_parsers import check_tools, required_calls_schema
from atomrt.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Number = Union[int, float]
MAX_LOGIT_BIAS = 100.0  # OpenAI: each value in [-100, 100]


class _Body(BaseModel):
    # extra fields are kept (and logged once per name by `parse`), not an error
    model_config = ConfigDict(strict=True, extra="allow")

    def check_supported(self) -> None:
        """Raise the RequestError of the first field set to something this server cannot honour."""


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None

    def check_supported(self) -> None:
        if self.include_obfuscation:
            raise refused("stream_options.include_obfuscation", "stream chunks are not obfuscated")


class _SamplingFields(_Body):
    """Fields both endpoints share (OpenAI's, then the extensions vLLM users send)."""

    # SamplingParams' field -> this request's, where they differ (errors name the request's)
    ENGINE_NAMES: ClassVar[dict[str, str]] = {}

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    logit_bias: Optional[dict[str, Number]] = None  # token id (as a string) -> [-100, 100]
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # an end-user id: nothing here depends on it
    # extensions (vLLM's names)
    top_k: Optional[int] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    prompt_logprobs: Optional[int] = None
    structured_outputs: Optional[Json] = None  # vLLM's: {json | regex | choice | grammar | ...}

    def check_supported(self) -> None:
        if self.stream_options is not None:
            if not self.stream:
                raise refused("stream_options", "only with stream=true")
            self.stream_options.check_supported()
        if self.stream and self.prompt_logprobs is not None:
            raise refused("prompt_logprobs", "is not returned when streaming; set stream=false")

    def token_bias(self) -> Optional[dict[int, float]]:
        """`logit_bias` with integer keys; a key that is not a token id, or a value outside
        [-100, 100], is a RequestError."""
        if self.logit_bias is None:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not key.isdecimal():
                raise RequestError(f"logit_bias: keys are token ids, got {key!r}", "logit_bias")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise RequestError(
                    f"logit_bias: values must be in [-100, 100], got {value} for token {key}",
                    "logit_bias",
                )
            out[int(key)] = float(value)
        return out

    def constraint(self) -> Optional[Json]:
        """The structured-output constraint this body asks for (the chat endpoint adds
        `response_format` and `tool_choice`)."""
        return self.vllm_structured_outputs()

    def vllm_structured_outputs(self) -> Optional[Json]:
        """`structured_outputs`, its `structural_tag` in vLLM's first form (`structures`,
        `triggers`) as the format xgrammar reads."""
        so = self.structured_outputs
        tag = so.get("structural_tag") if isinstance(so, dict) else None
        if isinstance(tag, dict) and "format" not in tag:
            return {**so, "structural_tag": structural_tag(tag, "structured_outputs")}
        return so

    def constraint_source(self) -> str:
        """The field that set `constraint()`, for errors."""
        return "structured_outputs"

    def sampling_params(
        self, max_tokens: int, logprobs: Optional[int], prompt_logprobs: Optional[int] = None
    ) -> SamplingParams:
        """The engine's SamplingParams; a bad value is a RequestError naming the field."""
        values: dict[str, Any] = dict(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.token_bias(),
            structured_outputs=self.constraint(),
        )
        for name in (
            "temperature",
            "top_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "top_k",
            "min_p",
            "repetition_penalty",
            "stop",
            "stop_token_ids",
            "allowed_token_ids",
            "bad_words",
        ):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        try:
            return SamplingParams(**values)
        except ValueError as e:
            text = renamed(str(e), self.ENGINE_NAMES)
            param = text.split(":", 1)[0]
            if param.startswith("structured_outputs"):  # set by this field
                param = self.constraint_source()
                text = text if param == "structured_outputs" else f"{param}: {text}"
            raise RequestError(text, param=param) from None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False  # the prompt (and with logprobs its tokens' logprobs) before the output
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise refused("suffix", "insertion after a suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise refused(
                "best_of", f"must equal n ({self.n}); ranking extra samples is not supported"
            )

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts to run, one choice group each (a string, or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt: must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[Json]] = None  # an assistant's calls
    tool_call_id: Optional[str] = None  # a tool's answer to that call

    def rendered(self) -> dict[str, Any]:
        """The message as chat templates read it: a call's arguments as a mapping."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                function = dict(call.get("function") or {})
                args = function.get("arguments")
                if isinstance(args, str):
                    try:
                        function["arguments"] = json.loads(args)
                    except ValueError:
                        pass
                calls.append({**call, "function": function})
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    ENGINE_NAMES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}  # SamplingParams'
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True  # extension
    # Accepted, with no effect on the output by their definition: identifiers and labels
    # (`metadata` is kept with stored completions, and nothing is stored), a cache key (the prefix
    # cache needs none).
    metadata: Optional[dict[str, str]] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    parallel_tool_calls: Optional[bool] = None  # false: at most one call
    # Refused unless absent or at the value that asks for nothing (check_supported)
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    modalities: Optional[list[str]] = None
    audio: Optional[Json] = None
    prediction: Optional[Json] = None
    web_search_options: Optional[Json] = None
    response_format: Optional[Json] = None
    tools: Optional[list[Json]] = None
    tool_choice: Optional[Union[str, Json]] = None
    functions: Optional[list[Json]] = None
    function_call: Optional[Union[str, Json]] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    moderation: Optional[Json] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[Json] = None

    def check_supported(self) -> None:
        super().check_supported()
        for name, why in (
            ("audio", "audio output is not supported"),
            ("prediction", "predicted outputs are not supported"),
            ("web_search_options", "web search is not supported"),
            ("moderation", "moderation is not supported"),
            ("reasoning_effort", "this server runs no reasoning model"),
            ("verbosity", "this server runs no model that takes a verbosity"),
        ):
            if getattr(self, name) is not None:
                raise refused(name, why)
        if self.functions:
            raise refused("functions", "deprecated by OpenAI; send tools")
        if self.function_call not in (None, "none"):
            raise refused("function_call", "deprecated by OpenAI; send tool_choice")
        try:
            check_tools(self.tools, self.tool_choice)
        except ValueError as e:
            param = "tools" if str(e).startswith("tools") else "tool_choice"
            raise RequestError(str(e), param) from None
        check_response_format(self.response_format)
        asked = [
            name
            for name, on in (
                ("response_format", self.response_format_constraint() is not None),
                ("structured_outputs", self.structured_outputs is not None),
                ("tool_choice", self.tool_mode() in ("required", "named")),
            )
            if on
        ]
        if len(asked) > 1:
            raise refused(asked[1], f"one constraint per request; {asked[0]} already sets one")
        if self.store:
            raise refused("store", "completions are not stored")
        if self.service_tier not in (None, "auto", "default"):
            raise refused("service_tier", f"{self.service_tier!r}: only 'auto' and 'default'")
        if self.modalities is not None and self.modalities != ["text"]:
            raise refused("modalities", "only ['text']")
        if self.prompt_cache_retention not in (None, "in_memory"):
            raise refused("prompt_cache_retention", "the KV cache is kept in memory only")
        if self.prompt_cache_options not in (None, {"mode": "implicit"}):
            raise refused(
                "prompt_cache_options", "prefix caching is implicit; only mode 'implicit'"
            )

    def conversation(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise RequestError("messages: must hold at least one message", "messages")
        return [m.rendered() for m in self.messages]

    def tool_mode(self) -> Optional[str]:
        """None (no tools, or tool_choice "none"), "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice in (None, "auto"):
            return "auto"
        return "required" if self.tool_choice == "required" else "named"

    def named_function(self) -> dict[str, Any]:
        """tool_choice's function, as `tools` declares it."""
        name = self.tool_choice["function"]["name"]  # type: ignore[index]
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    def response_format_constraint(self) -> Optional[Json]:
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            return {"json": self.response_format["json_schema"].get("schema", {})}
        if kind == "structural_tag":
            return {"structural_tag": structural_tag(self.response_format)}
        return None

    def constraint(self) -> Optional[Json]:
        """`structured_outputs`, `response_format`, or what tool_choice "required" or a named
        function asks for: a JSON array of calls, or the function's arguments."""
        mode = self.tool_mode()
        if mode == "named":
            return {"json": self.named_function().get("parameters") or {"type": "object"}}
        if mode == "required":
            return {"json": required_calls_schema(self.tools, self.parallel_tool_calls)}
        return self.response_format_constraint() or self.vllm_structured_outputs()

    def constraint_source(self) -> str:
        if self.tool_mode() in ("named", "required"):
            return "tool_choice"
        return "response_format" if self.response_format_constraint() else "structured_outputs"

    def num_logprobs(self) -> Optional[int]:
        if not self.logprobs:
            if self.top_logprobs:
                raise RequestError("top_logprobs: needs logprobs=true", "top_logprobs")
            return None
        return self.top_logprobs or 0


class TokenizeRequest(_Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int]


_LOGGED: set[str] = set()  # unknown field names already logged
# Extensions other servers define that would change the output, refused by name rather than ignored
UNSUPPORTED_EXTENSIONS = frozenset(
    {
        "echo",  # on chat completions
        "use_beam_search",
        "length_penalty",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "chat_template",
        "chat_template_kwargs",
        "continue_final_message",
        "truncate_prompt_tokens",
        "logits_processors",
        "return_tokens_as_token_ids",
        "priority",
    }
)


def parse(body_type: type[_Body], data: Any) -> Any:
    """Build a request body from decoded JSON; the first validation error, or the first field
    that cannot be honoured, becomes a RequestError. Unknown fields are logged once per name."""
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object", None)
    try:
        body = body_type.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        # drop the union-member names pydantic puts in the location (temperature.int, ...)
        loc = [str(x) for x in first.get("loc", ()) if not _is_type_name(x)]
        where = ".".join(loc)
        raise RequestError(
            f"{where or 'body'}: {first.get('msg', 'invalid value')}", loc[0] if loc else None
        ) from None
    for name in body.model_extra or ():
        if name in UNSUPPORTED_EXTENSIONS:
            raise refused(name, "is not supported by this server")
        key = f"{body_type.__name__}.{name}"
        if key not in _LOGGED:
            _LOGGED.add(key)
            logger.warning(
                "%s: ignoring the field %r, which this server does not know",
                body_type.__name__,
                name,
            )
    body.check_supported()
    return body


def _is_type_name(part: Any) -> bool:
    return isinstance(part, str) and (
        part in ("int", "float", "str", "bool", "none") or "[" in part or part[:1].isupper()
    )

"""The OpenAI API's request bodies, as atomrt checks them, and their mapping to SamplingParams.

Unknown fields are ignored (clients send extras); a field of the wrong type or out of range is a
`RequestError` naming it, which the server answers with status 400 in OpenAI's error JSON. Numbers
are strict: `"0.5"` is not a temperature, `true` is not a count.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from atomrt.runtime.sampling_params import SamplingParams

Number = Union[int, float]


class RequestError(ValueError):
    """A client mistake: the message names the field; `param` is the field's name."""

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields both endpoints share (OpenAI's, then the extensions vLLM users send)."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # extensions
    top_k: Optional[int] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def sampling_params(self, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
        """The engine's SamplingParams; a bad value is a RequestError naming the field."""
        values: dict[str, Any] = dict(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
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
        ):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        if self.stop is not None:
            values["stop"] = self.stop
        if self.stop_token_ids is not None:
            values["stop_token_ids"] = self.stop_token_ids
        try:
            return SamplingParams(**values)
        except ValueError as e:
            raise RequestError(str(e), param=str(e).split(":", 1)[0]) from None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None

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

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict[str, str]]:
        if not self.messages:
            raise RequestError("messages: must hold at least one message", "messages")
        return [{"role": m.role, "content": m.text()} for m in self.messages]

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


def parse(body_type: type[_Body], data: Any) -> Any:
    """Build a request body from decoded JSON; the first validation error becomes a RequestError."""
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object", None)
    try:
        return body_type.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        # drop the union-member names pydantic puts in the location (temperature.int, ...)
        loc = [str(x) for x in first.get("loc", ()) if not _is_type_name(x)]
        where = ".".join(loc)
        raise RequestError(
            f"{where or 'body'}: {first.get('msg', 'invalid value')}", loc[0] if loc else None
        ) from None


def _is_type_name(part: Any) -> bool:
    return isinstance(part, str) and (
        part in ("int", "float", "str", "bool", "none") or "[" in part or part[:1].isupper()
    )

"""OpenAI response bodies and server-sent-event chunks, built from a finished or running `Job`.

One class per endpoint. `body()` is the non-streamed response; `chunks(outputs)` turns the job's
outputs, as `Serving.outputs` yields them, into `data: {...}` events in OpenAI's chunk format, the
usage chunk last when `stream_options.include_usage` asks for it. The caller adds `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from json.encoder import encode_basestring_ascii
from typing import Any, Optional, Union

from atomrt.distributed.messages import CoreOutput
from atomrt.runtime.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from atomrt.runtime.entrypoints.openai.serving import Choice, Job, Serving, finite
from atomrt.runtime.entrypoints.openai.tool_parsers import ToolCallStream, tool_calls


def sse(data: Union[dict[str, Any], str]) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _string(text: str) -> str:
    """`json.dumps(text)`, the encoder's own escaping without its dispatch."""
    return encode_basestring_ascii(text)


def _reason(finish_reason: Optional[str]) -> str:
    return "null" if finish_reason is None else json.dumps(finish_reason)


class CompletionResponses:
    object_name = "text_completion"

    def __init__(self, serving: Serving, req: CompletionRequest, job: Job) -> None:
        self.serving = serving
        self.req = req
        self.job = job
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._sent_chars = {c: 0 for c in range(len(job.prompts_token_ids) * job.params.n)}

    def _envelope(self, choices: list[dict[str, Any]], obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.serving.model_name,
            "choices": choices,
        }

    def _prompt_logprobs(self, choice: Choice) -> Any:
        """vLLM's `prompt_logprobs`: None, then {token id: {logprob, rank, decoded_token}}."""
        if self.req.prompt_logprobs is None or choice.prompt_logprobs is None:
            return None
        text = self.serving.token_text
        return [
            None
            if row is None
            else {
                str(t): {"logprob": finite(lp), "rank": rank, "decoded_token": text(t)}
                for t, (lp, rank) in row.items()
            }
            for row in choice.prompt_logprobs
        ]

    def _completion(
        self, choice: Choice, text: str, start: int, token_ids: list[int], first: bool
    ) -> tuple[str, Any]:
        """The choice's text and logprobs from output token `start` on (`token_ids`, `text`): with
        `echo`, the first time (`first`), the prompt's text and entries go before them; with
        `max_tokens: 0`, the prompt's alone."""
        job, prefix = self.job, ""
        echo = job.prompt_texts is not None and first
        if echo:
            prefix = job.prompt_texts[job.prompt_of(choice)]
        if job.echo_only:
            text, token_ids = "", []
        logprobs = None
        if self.req.logprobs is not None:
            at = self._sent_chars[choice.index]
            logprobs = self.serving.completion_logprobs(job, choice, start, token_ids, at, echo)
        self._sent_chars[choice.index] += len(prefix) + len(text)
        return prefix + text, logprobs

    def _finish_reason(self, choice: Choice) -> Optional[str]:
        return "length" if self.job.echo_only and choice.finish_reason else choice.finish_reason

    def body(self) -> dict[str, Any]:
        choices = []
        for c in self.job.choices:
            text, logprobs = self._completion(c, c.text, 0, c.token_ids, True)
            choice = {
                "index": c.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": self._finish_reason(c),
                "stop_reason": None if self.job.echo_only else c.stop_reason,
            }
            if self.req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(c)
            choices.append(choice)
        return {**self._envelope(choices, self.object_name), "usage": self.job.usage()}

    def delta(self, choice: Choice, out: CoreOutput, start: int) -> dict[str, Any]:
        text, logprobs = self._completion(choice, out.text, start, out.token_ids, start == 0)
        return {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": self._finish_reason(choice) if out.finished else None,
        }

    def opening(self) -> list[dict[str, Any]]:
        return []

    def plain_delta(self, choice: Choice, out: CoreOutput) -> Optional[str]:
        """`json.dumps(self.delta(...))` formatted directly, where the chunk carries nothing but
        text (no logprobs, echo or tool calls); None elsewhere."""
        if self.req.logprobs is not None or self.job.prompt_texts is not None:
            return None
        reason = _reason(choice.finish_reason if out.finished else None)
        return (
            f'{{"index": {choice.index}, "text": {_string(out.text)}, "logprobs": null, '
            f'"finish_reason": {reason}}}'
        )

    async def chunks(self, outputs: AsyncIterator[tuple[Choice, CoreOutput]]) -> AsyncIterator[str]:
        obj = self.object_name if self.object_name == "text_completion" else "chat.completion.chunk"
        for first in self.opening():
            yield sse(self._envelope([first], obj))
        # each chunk is `sse(self._envelope([delta], obj))`: the envelope's text is made once, the
        # delta's (formatted directly where it is plain text) goes in its choices
        envelope = json.dumps(self._envelope([], obj))  # its last field: "choices": []
        head, tail = f"data: {envelope[:-2]}", "]}\n\n"
        seen = {c.index: 0 for c in self.job.choices}  # tokens already sent, per choice
        async for choice, out in outputs:
            start, seen[choice.index] = seen[choice.index], len(choice.token_ids)
            if out.text or out.token_ids or out.finished:
                delta = self.plain_delta(choice, out)
                if delta is None:
                    delta = json.dumps(self.delta(choice, out, start))
                yield f"{head}{delta}{tail}"
        options = self.req.stream_options
        if options is not None and options.include_usage:
            yield sse({**self._envelope([], obj), "usage": self.job.usage()})


class ChatResponses(CompletionResponses):
    object_name = "chat.completion"

    def __init__(self, serving: Serving, req: ChatCompletionRequest, job: Job) -> None:
        super().__init__(serving, req, job)  # type: ignore[arg-type]
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.top = req.top_logprobs or 0
        self.streams: dict[int, ToolCallStream] = {}  # tools: each choice's calls as deltas

    def _message(self, c: Choice) -> tuple[dict[str, Any], Optional[str]]:
        """A choice's message, its tool calls parsed out, and its finish reason."""
        if self.job.tool_parser is None:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        parsed = self.job.tool_parser.parse(c.text, final=True)
        calls = [call for call in parsed.calls if call.name is not None]
        if not calls:
            return {"role": "assistant", "content": parsed.content}, c.finish_reason
        message = {
            "role": "assistant",
            "content": parsed.content or None,
            "tool_calls": tool_calls(calls),
        }
        return message, "tool_calls" if c.finish_reason == "stop" else c.finish_reason

    def _logprobs(self, choice: Choice, start: int, token_ids: list[int]) -> Any:
        if not self.req.logprobs:
            return None
        return self.serving.chat_logprobs(choice, start, token_ids, self.top)

    def body(self) -> dict[str, Any]:
        choices = []
        for c in self.job.choices:
            message, finish_reason = self._message(c)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(c, 0, c.token_ids),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        body = {**self._envelope(choices, self.object_name), "usage": self.job.usage()}
        if self.req.prompt_logprobs is not None:  # vLLM's: the request's, beside the choices
            body["prompt_logprobs"] = self._prompt_logprobs(self.job.choices[0])
        return body

    def opening(self) -> list[dict[str, Any]]:
        """Each choice's first chunk names the role, as OpenAI's stream does."""
        return [
            {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for c in self.job.choices
        ]

    def plain_delta(self, choice: Choice, out: CoreOutput) -> Optional[str]:
        if self.job.tool_parser is not None or self.req.logprobs:
            return None
        content = f'{{"content": {_string(out.text)}}}' if out.text else "{}"
        reason = _reason(choice.finish_reason if out.finished else None)
        return (
            f'{{"index": {choice.index}, "delta": {content}, "logprobs": null, '
            f'"finish_reason": {reason}}}'
        )

    def delta(self, choice: Choice, out: CoreOutput, start: int) -> dict[str, Any]:
        finish_reason = choice.finish_reason if out.finished else None
        parser = self.job.tool_parser
        stream = (
            None
            if parser is None
            else self.streams.setdefault(choice.index, ToolCallStream(parser))
        )
        if stream is None:
            delta = {"content": out.text} if out.text else {}
        else:  # the content and the calls the text so far holds, as deltas of what was sent
            delta = stream.delta(choice.text, out.finished)
            if stream.called and finish_reason == "stop":
                finish_reason = "tool_calls"
        return {
            "index": choice.index,
            "delta": delta,
            "logprobs": self._logprobs(choice, start, out.token_ids),
            "finish_reason": finish_reason,
        }

"""Turning OpenAI requests into engine requests and engine outputs into OpenAI responses.

`Serving` holds the tokenizer and the engine client. A request becomes one engine request per
prompt (n samples each); its outputs are gathered per choice (`index`) and returned whole, or
streamed as server-sent events in OpenAI's chunk format. A client that goes away aborts its
engine requests (their KV blocks are freed at once).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from atomrt.distributed.messages import CoreOutput
from atomrt.runtime.entrypoints.engine_client import EngineClient, EngineGone, RequestStream
from atomrt.runtime.entrypoints.openai.metrics import ServerMetrics
from atomrt.runtime.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    TokenizeRequest,
    renamed,
)
from atomrt.runtime.entrypoints.openai.tool_parsers import (
    JsonCallsParser,
    NamedParser,
    ToolParser,
    make_parser,
)
from atomrt.runtime.sampling_params import SamplingParams


@dataclass
class Choice:
    """One sample of one prompt, as its outputs arrive."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    # None, then {token id: [logprob, rank]} per prompt token, when the request asked for them
    prompt_logprobs: Optional[list] = None
    num_cached_tokens: int = 0  # of its prompt, from the prefix cache


@dataclass
class Job:
    """The engine requests of one API request (one per prompt) and what they produced."""

    prompts_token_ids: list[list[int]]
    params: SamplingParams
    streams: list[RequestStream] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)
    # completions' `echo`: each prompt's text goes before its choices' text; with `max_tokens: 0`
    # (`echo_only`) the prompt alone (the engine runs one token, which is dropped)
    prompt_texts: Optional[list[str]] = None
    echo_only: bool = False
    tool_parser: Optional[ToolParser] = None  # chat with tools: where the calls are in the text
    # SamplingParams' field -> the request's, where they differ: the engine's errors name the latter
    engine_names: dict[str, str] = field(default_factory=dict)
    constraint_source: str = "structured_outputs"  # the field that set the constraint, if any

    def prompt_of(self, choice: Choice) -> int:
        """The index of the prompt a choice answers."""
        return choice.index // self.params.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return 0 if self.echo_only else sum(len(c.token_ids) for c in self.choices)

    @property
    def finished(self) -> bool:
        return bool(self.choices) and all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> dict[str, Any]:
        prompt, completion = self.num_prompt_tokens, self.num_completion_tokens
        n = self.params.n
        cached = sum(c.num_cached_tokens for c in self.choices if c.index % n == 0)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


_ids = itertools.count()
_PIECE_WINDOW = 6  # tokens of context that decide how a token reads (its leading space, bytes)


class Serving:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        model_name: str,
        metrics: ServerMetrics,
        tool_call_parser: Optional[str] = None,
    ) -> None:
        """`tool_call_parser`: answer tool_choice "auto" with the model's calls, read by this
        parser (None: "auto" is refused)."""
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.tool_call_parser = tool_call_parser

    # ---------------------------------------------------------------- requests in

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(
                f"model: {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                status=404,
                kind="not_found_error",
            )

    def tokenize(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt: this model has no tokenizer, send token ids", "prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def check_prompt(self, token_ids: list[int], max_tokens: int) -> None:
        ready = self.client.ready
        if not token_ids:
            raise RequestError("prompt: is empty; send at least one token", "prompt")
        if ready is not None:
            if len(token_ids) >= ready.max_model_len:
                raise RequestError(
                    f"prompt: has {len(token_ids)} tokens; this model's context is "
                    f"{ready.max_model_len} tokens, which must leave room to generate",
                    "prompt",
                )
            bad = [t for t in token_ids if not 0 <= t < ready.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt: token ids out of range [0, {ready.vocab_size}): {bad[:5]}", "prompt"
                )

    def check_token_fields(self, params: SamplingParams) -> None:
        """Token ids of `logit_bias` and `allowed_token_ids` within the vocabulary."""
        ready = self.client.ready
        if ready is None:
            return
        for name in ("logit_bias", "allowed_token_ids"):
            bad = [t for t in getattr(params, name) or () if t >= ready.vocab_size]
            if bad:
                raise RequestError(
                    f"{name}: token ids out of range [0, {ready.vocab_size}): {bad[:5]}", name
                )

    def max_tokens(self, asked: Optional[int], prompt_len: int) -> int:
        limit = (
            self.client.ready.max_model_len - prompt_len if self.client.ready is not None else 16
        )
        if asked is None:
            return max(1, limit)
        if asked < 1:
            raise RequestError(f"max_tokens: must be >= 1, got {asked}", "max_tokens")
        return asked

    def completion_job(self, req: CompletionRequest) -> Job:
        self.check_model(req.model)
        given = req.prompts()
        prompts = [self.tokenize(p) for p in given]
        echo_only = req.echo and req.max_tokens == 0  # the prompt alone, as vLLM allows
        asked = 1 if echo_only else req.max_tokens
        max_tokens = self.max_tokens(asked, max(len(p) for p in prompts))
        for p in prompts:
            self.check_prompt(p, max_tokens)
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # the prompt's entries come first
            prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
        texts = None
        if req.echo:
            texts = [p if isinstance(p, str) else self._decode(p) for p in given]
        params = req.sampling_params(max_tokens, req.logprobs, prompt_logprobs)
        self.check_token_fields(params)
        return Job(prompts, params, prompt_texts=texts, echo_only=echo_only)

    def _decode(self, token_ids: list[int]) -> str:
        """A token-id prompt's text for `echo`: special tokens skipped, as in the output's text
        (and in `token_pieces`, which `text_offset` counts)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids)

    def chat_job(self, req: ChatCompletionRequest) -> Job:
        self.check_model(req.model)
        if self.tokenizer is None:
            raise RequestError("messages: this model has no tokenizer or chat template", "messages")
        parser = self.tool_parser(req)
        try:
            prompt = self.tokenizer.apply_chat_template(
                req.conversation(), add_generation_prompt=req.add_generation_prompt, tools=req.tools
            )
        except Exception as e:  # a template that cannot render these messages: the client's problem
            raise RequestError(
                f"messages: the chat template could not render them: {e}", "messages"
            ) from None
        tokens = self.tokenize(prompt)
        asked = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        max_tokens = self.max_tokens(asked, len(tokens))
        self.check_prompt(tokens, max_tokens)
        params = req.sampling_params(max_tokens, req.num_logprobs(), req.prompt_logprobs)
        if parser is not None and parser.name == "mistral":  # its [TOOL_CALLS] is special
            params.skip_special_tokens = False
        self.check_token_fields(params)
        source = req.constraint_source()
        return Job(
            [tokens],
            params,
            tool_parser=parser,
            constraint_source=source,
            engine_names=req.ENGINE_NAMES,
        )

    def tool_parser(self, req: ChatCompletionRequest) -> Optional[ToolParser]:
        """Where a chat request's tool calls will be in its output, by its tool_choice."""
        mode = req.tool_mode()
        if mode == "named":
            return NamedParser(req.named_function()["name"])
        if mode == "required":
            return JsonCallsParser()
        if mode == "auto":
            if self.tool_call_parser is None:
                raise RequestError(
                    'tool_choice: "auto" (the default with tools) needs the server started with '
                    '--enable-auto-tool-choice --tool-call-parser NAME; or send "required", "none" '
                    "or a function",
                    "tool_choice",
                )
            return make_parser(self.tool_call_parser)
        return None

    def tokenize_request(self, req: TokenizeRequest) -> list[int]:
        """/tokenize: a prompt's ids, or a conversation's as the chat template renders it."""
        self.check_model(req.model)
        if self.tokenizer is None:
            raise RequestError("prompt: this model has no tokenizer", "prompt")
        if req.messages is not None:
            conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                return list(self.tokenizer.apply_chat_template(conversation))
            except Exception as e:  # a template that cannot render these messages
                raise RequestError(
                    f"messages: the chat template could not render them: {e}", "messages"
                ) from None
        if req.prompt is None:
            raise RequestError("prompt: give a prompt or messages", "prompt")
        return self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)

    def detokenize_request(self, req: DetokenizeRequest) -> str:
        self.check_model(req.model)
        if self.tokenizer is None:
            raise RequestError("tokens: this model has no tokenizer", "tokens")
        vocab = self.client.ready.vocab_size if self.client.ready else None
        if vocab is not None and any(not 0 <= t < vocab for t in req.tokens):
            raise RequestError(f"tokens: token ids out of range [0, {vocab})", "tokens")
        return self.tokenizer.decode(req.tokens)

    def submit(self, job: Job) -> None:
        n = job.params.n
        job.choices = [Choice(i) for i in range(len(job.prompts_token_ids) * n)]
        for prompt in job.prompts_token_ids:
            rid = f"req-{next(_ids)}-{uuid.uuid4().hex[:8]}"
            job.streams.append(self.client.submit(rid, prompt, job.params))
            self.metrics.request_in(len(prompt))

    def abort(self, job: Job) -> None:
        """End the job's engine requests (its client went away); never waits."""
        self.client.abort([s.request_id for s in job.streams])

    # ---------------------------------------------------------------- outputs out

    def outputs(self, job: Job) -> AsyncIterator[tuple[Choice, CoreOutput]]:
        """Every output of the job's engine requests, as (its choice, the output), in arrival order;
        outputs of a sample that queued up while the stream was behind arrive as one."""
        return self._one_stream(job) if len(job.streams) == 1 else self._streams(job)

    async def _streams(self, job: Job) -> AsyncIterator[tuple[Choice, CoreOutput]]:
        getters = {i: asyncio.ensure_future(s.next()) for i, s in enumerate(job.streams)}
        try:
            while getters:
                done, _ = await asyncio.wait(getters.values(), return_when=asyncio.FIRST_COMPLETED)
                for i, fut in list(getters.items()):
                    if fut not in done:
                        continue
                    out = fut.result()
                    if out is None:
                        del getters[i]
                        continue
                    yield self._accept(job, i, out), out
                    if self._ended(job, i, out):
                        del getters[i]
                        continue
                    getters[i] = asyncio.ensure_future(job.streams[i].next())
        finally:
            for fut in getters.values():
                fut.cancel()

    async def _one_stream(self, job: Job) -> AsyncIterator[tuple[Choice, CoreOutput]]:
        """`outputs` of a job with one engine request (one prompt): no task per output."""
        stream = job.streams[0]
        while (out := await stream.next()) is not None:
            yield self._accept(job, 0, out), out
            if self._ended(job, 0, out):
                return

    def _accept(self, job: Job, i: int, out: CoreOutput) -> Choice:
        """The choice `out` (an output of the job's i-th engine request) belongs to, with `out`
        applied; an output that carries an error raises it."""
        if out.error:
            raise (
                EngineGone(out.error) if out.finish_reason == "error" else rejected(job, out.error)
            )
        choice = job.choices[i * job.params.n + out.index]
        self._apply(choice, out, job.streams[i])
        return choice

    def _ended(self, job: Job, i: int, out: CoreOutput) -> bool:
        """Whether the job's i-th engine request ended with `out` (its last sample finished)."""
        if not out.finished:
            return False
        stream = job.streams[i]
        self.client.finished(stream, job.params.n)
        return stream.finished >= job.params.n

    def _apply(self, choice: Choice, out: CoreOutput, stream: RequestStream) -> None:
        if not choice.token_ids and out.token_ids:
            self.metrics.first_token(stream.arrival_time, out)
        elif out.token_ids:
            self.metrics.next_tokens(out)
        choice.text += out.text
        choice.token_ids += out.token_ids
        if out.logprobs:
            choice.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        choice.num_cached_tokens = max(choice.num_cached_tokens, out.num_cached_tokens)
        if out.finished:
            choice.finish_reason = out.finish_reason
            choice.stop_reason = out.stop_reason
            self.metrics.request_done(stream.arrival_time, out, len(choice.token_ids))

    # ---------------------------------------------------------------- logprobs

    def completion_logprobs(
        self,
        job: Job,
        choice: Choice,
        start: int,
        token_ids: list[int],
        text_start: int = 0,
        echo: bool = False,
    ) -> Optional[dict[str, Any]]:
        """The legacy completions `logprobs` object of `token_ids` (the choice's output tokens
        from `start`), preceded with `echo` by its prompt's entries (the first token's null).
        `tokens` are each token's text as it reads in the choice's text (`token_pieces`), and
        `text_offset` where it starts there, `text_start` being the first's."""
        prompt = job.prompts_token_ids[job.prompt_of(choice)]
        ids: list[int] = []
        token_logprobs: list[Optional[float]] = []
        top: list[Optional[dict[str, float]]] = []
        pieces: list[str] = []
        if echo:
            rows = choice.prompt_logprobs or [None] * len(prompt)
            for t, row in zip(prompt, rows):
                ids.append(t)
                token_logprobs.append(None if row is None else finite(row[t][0]))
                top.append(
                    None
                    if row is None
                    else {self.token_text(k): finite(v[0]) for k, v in row.items()}
                )
            pieces += self.token_pieces([], prompt)
        if choice.logprobs and token_ids:
            rows = choice.logprobs[start : start + len(token_ids)]
            for t, row in zip(token_ids, rows):
                ids.append(t)
                token_logprobs.append(finite(row.get(t, float("-inf"))))
                top.append({self.token_text(k): finite(v) for k, v in row.items()})
            pieces += self.token_pieces(prompt + choice.token_ids[:start], token_ids)
        if not ids:
            return None
        offsets, at = [], text_start
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {
            "tokens": [p or self.token_text(t) for p, t in zip(pieces, ids)],
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def token_pieces(self, context: list[int], token_ids: list[int]) -> list[str]:
        """Each token's text as it reads after `context` in the decoded text (a leading space
        included; special tokens, which the text skips, empty): what decoding it adds to the text
        of the tokens before it (a short window of them)."""
        if self.tokenizer is None:
            return [str(t) for t in token_ids]
        seq = list(context[-_PIECE_WINDOW:]) + list(token_ids)
        out = []
        for i in range(len(seq) - len(token_ids), len(seq)):
            window = seq[max(0, i - _PIECE_WINDOW) : i]
            before = self.tokenizer.decode(window)
            after = self.tokenizer.decode(window + [seq[i]])
            out.append(after[len(before) :] if after.startswith(before) else after)
        return out

    def chat_logprobs(
        self, choice: Choice, start: int, token_ids: list[int], top: int
    ) -> Optional[dict[str, Any]]:
        if not token_ids or not choice.logprobs:
            return None
        rows = choice.logprobs[start : start + len(token_ids)]
        content = []
        for t, row in zip(token_ids, rows):
            best = sorted(row.items(), key=lambda kv: -kv[1])[:top]
            content.append(
                {
                    "token": self.token_text(t),
                    "logprob": finite(row.get(t, float("-inf"))),
                    "bytes": None,
                    "top_logprobs": [
                        {"token": self.token_text(k), "logprob": finite(v), "bytes": None}
                        for k, v in best
                    ],
                }
            )
        return {"content": content}

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return str(token_id)
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def rejected(job: Job, error: str) -> RequestError:
    """The client's error for an engine request the engine refused: its structured-output
    constraint (parsed and compiled on the engine's compile threads, never here) names the field
    that set it; one that can never compile is a 400, one that missed the compile budget on a busy
    machine a 503 with Retry-After (the compile goes on and is kept: a retry finds it)."""
    if not error.startswith("structured_outputs"):
        return RequestError(renamed(error, job.engine_names))
    from atomrt.runtime.driver.grammar_compiler import compile_timed_out  # an error path only

    source = job.constraint_source
    text = error if source == "structured_outputs" else f"{source}: {error}"
    if compile_timed_out(error):
        return RequestError(text, source, status=503, kind="service_unavailable")
    return RequestError(text, source)


def finite(logprob: float) -> float:
    """JSON has no -Infinity: a masked token's logprob reads as -9999 (vLLM's stand-in)."""
    return max(logprob, -9999.0)

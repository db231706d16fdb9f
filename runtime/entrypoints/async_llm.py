"""`AsyncLLM`: vLLM's asyncio engine, over the engine core the OpenAI server runs on.

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=...))
    async for out in engine.generate(prompt, SamplingParams(...), request_id):
        ...
    await engine.abort(request_id)
    engine.shutdown()

The engine core is a process of its own (runtime/entrypoints/engine_core.py) that steps the
`LLMEngine`; this side tokenizes, sends requests and aborts over ZeroMQ and turns each request's
per-step outputs (runtime/entrypoints/engine_client.py) into `RequestOutput`s of the request's
`output_kind`: CUMULATIVE (vLLM's default: every sample's output so far), DELTA (the new text,
tokens and logprobs) or FINAL_ONLY. Many `generate` streams run at once on one event loop; a
consumer that stops reading (its task cancelled, or the loop left) aborts its request, and the
core frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Iterable
from typing import Any, Optional, Union

from atomrt.runtime.config import Config
from atomrt.runtime.driver.outputs import CompletionOutput, RequestMetrics, RequestOutput
from atomrt.runtime.driver.prompt_logprobs import Logprob
from atomrt.runtime.entrypoints.config_args import EngineArgs
from atomrt.runtime.entrypoints.engine_client import EngineClient, EngineGone, RequestStream
from atomrt.runtime.inputs import PromptType, parse_prompt
from atomrt.runtime.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # the engine core's start-up (compilation and graph capture included)


class AsyncEngineArgs(EngineArgs):
    """vLLM's `AsyncEngineArgs`: `EngineArgs` for `AsyncLLM.from_engine_args`."""


class EngineDeadError(RuntimeError):
    """The engine core stopped; every running and later request fails with it."""


class AsyncLLM:
    def __init__(self, config: Config, log_stats: bool = False) -> None:
        """Spawn the engine core for `config` (now when called inside an event loop, else with
        the first `generate`); the first `generate` (or `wait_until_ready`) waits for it."""
        from atomrt.runtime.entrypoints.llm import load_tokenizer_for

        self.config = config
        self.log_stats = log_stats
        self.client = EngineClient(config, START_TIMEOUT_S)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop yet: the core starts with the first generate
            pass
        else:
            self.client.spawn()  # the core's imports run beside the tokenizer's
        self.tokenizer = load_tokenizer_for(config)
        self._started: Optional[asyncio.Future] = None
        self._closed = False

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        start_engine_loop: bool = True,
        usage_context: Any = None,
        stat_loggers: Any = None,
    ) -> AsyncLLM:
        """vLLM's constructor: an AsyncLLM of `AsyncEngineArgs(model=..., **LLM's keywords)`."""
        if not start_engine_loop:
            raise ValueError("start_engine_loop: the engine core always starts with AsyncLLM")
        if stat_loggers:
            raise ValueError("stat_loggers: not supported; read the server's /metrics instead")
        kwargs = dict(engine_args.kwargs)
        log_stats = not kwargs.pop("disable_log_stats", True)
        config = (
            engine_args._config or EngineArgs(engine_args.model, **kwargs).create_engine_config()
        )
        return cls(config, log_stats)

    # ---------------------------------------------------------------- life cycle

    async def wait_until_ready(self) -> None:
        """Wait (once) for the engine core to be up; EngineDeadError if it failed to start."""
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        if self._started is None:
            self._started = asyncio.ensure_future(self.client.start())
        try:
            await asyncio.shield(self._started)
        except EngineGone as e:
            raise EngineDeadError(str(e)) from None

    @property
    def is_running(self) -> bool:
        return not self._closed and self.client.fatal is None

    @property
    def is_stopped(self) -> bool:
        return self._closed

    @property
    def errored(self) -> bool:
        return self.client.fatal is not None

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError(self.client.fatal or "the engine is running")

    async def check_health(self) -> None:
        """Raise EngineDeadError when the engine core has stopped."""
        if self.client.fatal is not None:
            raise EngineDeadError(self.client.fatal)

    async def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer (None without one)."""
        return self.tokenizer.hf if self.tokenizer is not None else None

    def shutdown(self) -> None:
        """Stop the engine core (bounded) and close the sockets; running streams end with
        EngineDeadError. Callable from inside or outside the event loop."""
        if self._closed:
            return
        self._closed = True
        client = self.client
        if client._reader is not None and not client._reader.done():
            try:
                client._reader.cancel()
            except RuntimeError:  # its loop is closed (asyncio.run returned): nothing runs it
                pass
        proc = client._proc
        if proc is not None and proc.is_alive():
            import zmq

            from atomrt.distributed.messages import CoreShutdown, encode

            try:  # a plain socket over the same handle: this may run outside any event loop
                zmq.Socket.shadow(client._push.underlying).send(
                    encode(CoreShutdown()), flags=zmq.NOBLOCK
                )
            except zmq.ZMQError as e:
                logger.warning("could not send the engine core its shutdown: %s", e)
            proc.join(10.0)
        client.finish_stop("the engine was shut down")
        client.cleanup()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.shutdown()
            except Exception:  # noqa: BLE001 - interpreter teardown: nothing left to report to
                pass

    # ---------------------------------------------------------------- requests

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: Any = None,
        trace_headers: Any = None,
        priority: int = 0,
        data_parallel_rank: Optional[int] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as the engine produces them, in `sampling_params.output_kind`;
        the last one is `finished`. A request the engine refuses raises ValueError (naming the
        field); leaving the loop early, or cancelling its task, aborts the request."""
        for name, value, default in (
            ("lora_request", lora_request, None),
            ("priority", priority, 0),
            ("data_parallel_rank", data_parallel_rank, None),
            ("tokenization_kwargs", tokenization_kwargs, None),
        ):
            if value != default:
                raise ValueError(f"{name}: not supported by atomrt (only {default!r})")
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(
                f"sampling_params: must be a SamplingParams, got {type(sampling_params).__name__}"
            )
        if not isinstance(request_id, str):
            raise ValueError(f"request_id: must be a string, got {request_id!r}")
        await self.wait_until_ready()
        if request_id in self.client.streams:
            raise ValueError(f"request_id {request_id!r} is already running")
        token_ids, text = parse_prompt(prompt, self.tokenizer)
        k = sampling_params.truncate_prompt_tokens
        if k is not None:  # here, so that the outputs report the prompt the engine ran
            token_ids = token_ids[-(self.client.ready.max_model_len if k == -1 else k) :]
        try:
            stream = self.client.submit(request_id, token_ids, sampling_params)
        except EngineGone as e:
            raise EngineDeadError(str(e)) from None
        state = _RequestState(request_id, text, token_ids, sampling_params, stream, self)
        finished = False
        try:
            while not finished:
                out = await stream.next()
                if out is None:  # aborted (abort()), or the engine stopped
                    out = state.ended()
                    if out is None:
                        return
                    yield out
                    return
                if out.error is not None:
                    if out.finish_reason == "error":
                        raise EngineDeadError(out.error)
                    raise ValueError(out.error)
                result = state.apply(out)
                if out.finished:
                    self.client.finished(stream, sampling_params.n)
                finished = state.finished
                if result is not None:
                    yield result
        finally:
            if not finished and request_id in self.client.streams:
                self.client.abort([request_id])  # the consumer stopped reading: free it

    async def abort(self, request_id: Union[str, Iterable[str]]) -> None:
        """End requests now; their `generate` streams give a last output (finish_reason
        "abort") and stop. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        streams = [self.client.streams.get(r) for r in ids]
        self.client.abort(ids)
        for stream in streams:
            if stream is not None:
                stream.queue.put_nowait(None)


class _RequestState:
    """One request's samples so far, turned into RequestOutputs of its output kind."""

    def __init__(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream: RequestStream,
        engine: AsyncLLM,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.kind = params.output_kind
        self.engine = engine
        self.arrival = stream.arrival_time  # monotonic, as the core's times
        # the same instant as wall-clock time: the stream (and the core's scheduling) may be
        # ahead of this state, so not time.time() now
        self.arrival_wall = time.time() - (time.monotonic() - self.arrival)
        self.samples: dict[int, CompletionOutput] = {}
        self.prompt_logprobs: Any = None
        self.num_cached_tokens = 0
        self.first_scheduled: Optional[float] = None
        self.first_token: Optional[float] = None
        self._sent_prompt_logprobs = False

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.params.n and all(c.finished for c in self.samples.values())

    def _wall(self, t: Optional[float]) -> Optional[float]:
        """A core time (monotonic, this host) as wall-clock time, as vLLM reports them."""
        return None if t is None else self.arrival_wall + (t - self.arrival)

    def apply(self, out: Any) -> Optional[RequestOutput]:
        logprobs = self._logprobs(out.logprobs)
        c = self.samples.get(out.index)
        if c is None:
            c = self.samples[out.index] = CompletionOutput(
                out.index, "", [], logprobs=[] if self.params.logprobs is not None else None
            )
        delta = CompletionOutput(
            out.index,
            out.text,
            list(out.token_ids),
            out.finish_reason if out.finished else None,
            logprobs,
            stop_reason=out.stop_reason,
        )
        c.text += out.text
        c.token_ids = c.token_ids + list(out.token_ids)
        if logprobs is not None:
            c.logprobs = (c.logprobs or []) + logprobs
            c.cumulative_logprob = (c.cumulative_logprob or 0.0) + sum(
                row[t].logprob for row, t in zip(logprobs, out.token_ids) if t in row
            )
            delta.cumulative_logprob = c.cumulative_logprob
        if out.finished:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [
                None
                if row is None
                else {
                    int(t): Logprob(lp, rank, self._text(int(t))) for t, (lp, rank) in row.items()
                }
                for row in out.prompt_logprobs
            ]
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.first_scheduled = self.first_scheduled or out.first_scheduled_time
        self.first_token = self.first_token or out.first_token_time
        finished = self.finished
        if self.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.kind is RequestOutputKind.DELTA:
            return self._output([delta], finished)
        return self._output([_copy(c) for _, c in sorted(self.samples.items())], finished)

    def ended(self) -> Optional[RequestOutput]:
        """The last output of a request aborted from outside (None if nothing is left to say)."""
        if self.engine.client.fatal is not None:
            raise EngineDeadError(self.engine.client.fatal)
        open_samples = [i for i in range(self.params.n) if not self._done(i)]
        if not open_samples:
            return None
        deltas = []
        for i in open_samples:
            c = self.samples.setdefault(i, CompletionOutput(i, "", []))
            c.finish_reason = "abort"
            deltas.append(CompletionOutput(i, "", [], "abort"))
        if self.kind is RequestOutputKind.DELTA:
            return self._output(deltas, True)
        return self._output([_copy(c) for _, c in sorted(self.samples.items())], True)

    def _done(self, index: int) -> bool:
        c = self.samples.get(index)
        return c is not None and c.finished

    def _output(self, completions: list[CompletionOutput], finished: bool) -> RequestOutput:
        now = time.time()
        metrics = RequestMetrics(
            arrival_time=self.arrival_wall,
            first_scheduled_time=self._wall(self.first_scheduled),
            first_token_time=self._wall(self.first_token),
            finished_time=now if finished else None,
        )
        prompt_logprobs = self.prompt_logprobs
        if self.kind is RequestOutputKind.DELTA and self._sent_prompt_logprobs:
            prompt_logprobs = None  # a delta stream carries them once, as the engine's does
        self._sent_prompt_logprobs = prompt_logprobs is not None or self._sent_prompt_logprobs
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )

    def _text(self, token_id: int) -> Optional[str]:
        tok = self.engine.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else None

    def _logprobs(self, rows: Optional[list[dict[int, float]]]) -> Optional[list]:
        if rows is None:
            return [] if self.params.logprobs is not None else None
        k = self.params.logprobs or 0
        out = []
        for row in rows:
            ranks = {t: i + 1 for i, t in enumerate(list(row)[:k])}
            out.append(
                {int(t): Logprob(lp, ranks.get(t), self._text(int(t))) for t, lp in row.items()}
            )
        return out


def _copy(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        c.index,
        c.text,
        list(c.token_ids),
        c.finish_reason,
        list(c.logprobs) if c.logprobs is not None else None,
        c.cumulative_logprob,
        c.stop_reason,
    )

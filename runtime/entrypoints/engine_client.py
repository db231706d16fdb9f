"""`EngineClient`: the API process's side of the engine core (runtime/entrypoints/engine_core.py).

It starts the engine-core process, pushes requests and aborts to it, and one reader task turns the
core's per-step `CoreOutputs` into each request's asyncio queue of outputs. It knows whether the
core is alive (its process, and a message within `liveness_s`), ready (started, graphs captured),
and what its last statistics were. Everything here runs on the API's event loop thread.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from atomrt.distributed.core_messages import CoreAddresses
from atomrt.distributed.messages import (
    CoreAbort,
    CoreOutput,
    CoreOutputs,
    CoreReady,
    CoreRequest,
    CoreShutdown,
    CoreStats,
    decode,
    encode,
)
from atomrt.runtime.config import Config
from atomrt.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineGone(RuntimeError):
    """The engine core stopped; the message says why."""


_NOTHING: Any = object()


class OutputQueue:
    """One request's outputs between the reader and the request's one consumer: asyncio.Queue's
    `put_nowait`, `get`, `get_nowait` and `qsize` (unbounded, first in first out) without its loop
    checks and waiter list, on the path of every streamed chunk."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: Optional[asyncio.Future] = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():  # a cancelled get left it done
            waiter.set_result(None)

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items


@dataclass
class RequestStream:
    """One request's outputs as the reader delivers them (`None` ends the stream)."""

    request_id: str
    queue: OutputQueue = field(default_factory=OutputQueue)
    arrival_time: float = field(default_factory=time.monotonic)
    finished: int = 0  # how many of its n samples have finished
    _held: Any = _NOTHING  # read from the queue, not merged into the last output

    async def next(self) -> Optional[CoreOutput]:
        """The next output, with the outputs of the same sample already queued behind it merged in:
        a reader that fell behind the engine sends one chunk for several steps, not one each."""
        out, self._held = self._held, _NOTHING
        if out is _NOTHING:
            out = await self.queue.get()
        while out is not None and not out.finished and out.error is None and self.queue.qsize():
            nxt = self.queue.get_nowait()
            if nxt is None or nxt.index != out.index or nxt.error is not None:
                self._held = nxt
                break
            merge_into(out, nxt)
        return out


def merge_into(out: CoreOutput, later: CoreOutput) -> None:
    """`out` followed by `later`, the same sample's next output, in place."""
    out.token_ids += later.token_ids
    out.text += later.text
    if later.logprobs:
        out.logprobs = (out.logprobs or []) + later.logprobs
    out.finished, out.finish_reason = later.finished, later.finish_reason
    out.stop_reason = later.stop_reason
    if out.first_token_time is None:
        out.first_token_time = later.first_token_time
    if out.first_scheduled_time is None:
        out.first_scheduled_time = later.first_scheduled_time
    if out.prompt_logprobs is None:
        out.prompt_logprobs = later.prompt_logprobs
    out.num_cached_tokens = max(out.num_cached_tokens, later.num_cached_tokens)


def _core_process(config: Config, addresses: CoreAddresses, log_level: str, api_pid: int) -> None:
    """The engine-core process's target, named here so that the API process, which pickles it by
    name, need not import the engine (torch, the models, the compiler) to start one."""
    from atomrt.runtime.entrypoints.engine_core import core_main

    core_main(config, addresses, log_level, api_pid)


class EngineClient:
    def __init__(self, config: Config, start_timeout_s: float, log_level: str = "INFO") -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.log_level = log_level
        self.streams: dict[str, RequestStream] = {}
        self.stats: Optional[CoreStats] = None
        self.ready: Optional[CoreReady] = None
        self.fatal: Optional[str] = None
        self.last_message = 0.0
        self.on_outputs: Optional[Callable[[CoreOutputs], None]] = None  # metrics hook
        self._proc: Any = None
        self._dir = tempfile.mkdtemp(prefix="atomrt-core-")
        self._ctx: Any = None
        self._push: Any = None
        self._pull: Any = None
        self._reader: Optional[asyncio.Task] = None

    # ---------------------------------------------------------------- life cycle

    def spawn(self) -> None:
        """Start the engine-core process without waiting for it (once; `start` waits). A caller
        that spawns before its own imports lets the core's import of torch run beside them."""
        if self._proc is not None:
            return
        import zmq
        import zmq.asyncio

        addresses = CoreAddresses(f"ipc://{self._dir}/requests", f"ipc://{self._dir}/outputs")
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)  # no limit: a send never waits while the core reads
        self._push.bind(addresses.requests)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(addresses.outputs)
        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(
            target=_core_process,
            args=(self.config, addresses, self.log_level, os.getpid()),
            name="atomrt-engine-core",
            daemon=False,
        )
        self._proc.start()

    async def start(self) -> CoreReady:
        """Start the engine-core process (unless `spawn` did) and wait (bounded) until its engine
        is up."""
        self.spawn()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if not self._proc.is_alive():
                raise EngineGone(
                    f"the engine core exited during start-up (code {self._proc.exitcode})"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineGone(
                    f"the engine core did not start within {self.start_timeout_s:.0f} s"
                )
            if await self._pull.poll(min(left, 1.0) * 1000):
                msg = decode(await self._pull.recv())
                if isinstance(msg, CoreReady):
                    if msg.error:
                        raise EngineGone(f"the engine failed to start: {msg.error}")
                    self.ready = msg
                    break
        self.last_message = time.monotonic()
        self._reader = asyncio.get_running_loop().create_task(self._read())
        return self.ready

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engine core (bounded): a shutdown message, then terminate, then kill."""
        if self._reader is not None:
            self._reader.cancel()
        proc = self._proc
        if proc is not None and proc.is_alive():
            try:
                self._send(CoreShutdown())
            except EngineGone as e:  # the core stopped reading: terminate follows
                logger.warning("could not send the engine core its shutdown: %s", e)
            deadline = time.monotonic() + timeout_s
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.finish_stop(self.fatal or "the server is shutting down")

    def finish_stop(self, reason: str) -> None:
        """After the shutdown message had its time: terminate, then kill, a core still running;
        close the sockets; end every open stream with `reason`."""
        proc = self._proc
        for stop in ("terminate", "kill"):
            if proc is not None and proc.is_alive():
                getattr(proc, stop)()
                proc.join(3.0)
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        self._end_all(reason)

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def alive(self, liveness_s: float) -> bool:
        """The process runs and its loop spoke within `liveness_s` (an idle core speaks twice a second)."""
        return (
            self.fatal is None
            and self._proc is not None
            and self._proc.is_alive()
            and time.monotonic() - self.last_message < liveness_s
        )

    async def wait_dead(self) -> str:
        """Return once the engine core has stopped (its reason)."""
        while self.fatal is None:
            await asyncio.sleep(0.2)
        return self.fatal

    # ---------------------------------------------------------------- requests

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        if self.fatal is not None:
            raise EngineGone(self.fatal)
        self._send(
            CoreRequest(
                request_id=request_id,
                prompt_token_ids=np.asarray(prompt_token_ids, dtype=np.int32),
                sampling_params=params,
            )
        )
        stream = RequestStream(request_id)
        self.streams[request_id] = stream
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (a client went away); their KV blocks are freed at the core's next loop.
        Never waits: it runs where the caller may already be cancelled."""
        live = [r for r in request_ids if self.streams.pop(r, None) is not None]
        if live and self.fatal is None:
            try:
                self._send(CoreAbort(request_ids=live))
            except EngineGone as e:
                logger.warning("could not send an abort of %d requests: %s", len(live), e)

    def _send(self, msg: Any) -> None:
        """Hand `msg` to the core without waiting (the socket has no limit while the core is
        connected); EngineGone when it cannot take it."""
        import zmq

        if self._push is None:
            raise EngineGone("the engine core is not running")
        sent = self._push.send(encode(msg), flags=zmq.NOBLOCK)
        if sent.done() and sent.exception() is not None:
            raise EngineGone(f"the engine core does not take messages: {sent.exception()}")

    # ---------------------------------------------------------------- the reader

    async def _read(self) -> None:
        try:
            while True:
                if not await self._pull.poll(1000):
                    if not self._proc.is_alive():
                        self._die(f"the engine core exited (code {self._proc.exitcode})")
                        return
                    continue
                msg = decode(await self._pull.recv())
                self.last_message = time.monotonic()
                if isinstance(msg, CoreOutputs):
                    self._deliver(msg)
                    if msg.fatal:
                        self._die(msg.fatal)
                        return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a reader that stops must fail the requests, not hang them
            logger.exception("engine client reader failed")
            self._die(f"engine client reader failed: {e}")

    def _deliver(self, msg: CoreOutputs) -> None:
        self.stats = msg.stats
        if self.on_outputs is not None:
            self.on_outputs(msg)
        for out in msg.outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.queue.put_nowait(out)
            if out.error is not None:  # rejected by the engine, or the engine stopped
                self.streams.pop(out.request_id, None)
                stream.queue.put_nowait(None)

    def finished(self, stream: RequestStream, n: int) -> None:
        """One sample of the request finished; the last one ends its stream."""
        stream.finished += 1
        if stream.finished >= n:
            self.streams.pop(stream.request_id, None)

    def _die(self, reason: str) -> None:
        self.fatal = reason
        logger.error("engine core stopped: %s", reason)
        self._end_all(reason)

    def _end_all(self, reason: str) -> None:
        for stream in list(self.streams.values()):
            stream.queue.put_nowait(
                CoreOutput(
                    request_id=stream.request_id, finished=True, finish_reason="error", error=reason
                )
            )
            stream.queue.put_nowait(None)
        self.streams.clear()

    def cleanup(self) -> None:
        try:
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)
        except OSError:
            pass

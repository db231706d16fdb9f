"""The engine core: one process that owns the `LLMEngine` and steps it, fed over ZeroMQ.

The API server (runtime/entrypoints/openai/) never waits on a step: it tokenizes, pushes a
`CoreRequest` (or a `CoreAbort`) to this process, and reads `CoreOutputs` back, one message per
engine step with every request's new tokens and the engine's statistics. Both directions are
ZeroMQ PUSH/PULL over ipc://, msgpack-encoded (distributed/messages.py).

The loop: take what arrived (waiting for it only when the engine is idle), add and abort, step,
send the step's outputs. An idle engine sends its statistics every `STATS_PERIOD_S` so the API
knows the loop is alive. A request the engine rejects comes back as an output with `error` set (finish_reason "rejected"),
at add_request or later (a structured-output grammar that did not compile within its budget).
If the engine dies, a last `CoreOutputs` carries `fatal` and the process exits with status 1.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Any, Optional

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
from atomrt.runtime.driver.engine import LLMEngine
from atomrt.runtime.driver.outputs import CompletionOutput, RequestOutput, wall_offset
from atomrt.runtime.entrypoints.llm import load_tokenizer_for

logger = logging.getLogger(__name__)

STATS_PERIOD_S = 0.5  # an idle engine core says it is alive this often
POLL_S = 0.05  # how long an idle loop waits for a request before looking again


def core_main(config: Config, addresses: CoreAddresses, log_level: str, api_pid: int) -> None:
    """Target of the engine-core process; `api_pid` is the API process, which it outlives not."""
    import zmq

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when this one stops
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(addresses.requests)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(addresses.outputs)
    try:
        engine = LLMEngine(config, load_tokenizer_for(config))
    except BaseException as e:  # start-up failed: say why, then leave
        push.send(encode(CoreReady(error=f"{type(e).__name__}: {e}")))
        push.close()
        pull.close()
        raise SystemExit(1) from None
    info = engine.info
    push.send(
        encode(
            CoreReady(
                pid=os.getpid(),
                max_model_len=engine.max_model_len,
                vocab_size=info.vocab_size,
                num_kv_blocks=info.num_kv_blocks,
                capture_seconds=info.capture_seconds,
                compile_seconds=info.compile_seconds,
            )
        )
    )
    core = EngineCore(engine, push)
    try:
        core.run(pull, api_pid)
    finally:
        engine.shutdown()
        push.close()
        pull.close()
    raise SystemExit(0 if core.fatal is None else 1)


class EngineCore:
    def __init__(self, engine: LLMEngine, push: Any) -> None:
        self.engine = engine
        self.push = push
        self.fatal: Optional[str] = None

    def run(self, pull: Any, api_pid: int) -> None:
        """Until a CoreShutdown, the engine's death, or the API process's exit."""
        import zmq

        last_stats = 0.0
        while True:
            idle = not self.engine.has_unfinished()
            if pull.poll(POLL_S * 1000 if idle else 0):
                while True:
                    try:
                        msg = decode(pull.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    if isinstance(msg, CoreShutdown):
                        return
                    self._handle(msg)
            elif idle:
                if os.getppid() != api_pid:
                    logger.warning("the API process is gone; stopping the engine")
                    return
                if time.monotonic() - last_stats > STATS_PERIOD_S:
                    self._send([])
                    last_stats = time.monotonic()
                continue
            if self.engine.has_unfinished():
                if not self._step():
                    return
                last_stats = time.monotonic()

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, CoreAbort):
            for rid in msg.request_ids:
                self.engine.abort(rid)
        elif isinstance(msg, CoreRequest):
            try:
                self.engine.add_request(
                    list(msg.prompt_token_ids.tolist()),
                    msg.sampling_params,
                    msg.request_id,
                    stream=True,
                )
            except ValueError as e:
                self._send(
                    [
                        CoreOutput(
                            request_id=msg.request_id,
                            finished=True,
                            finish_reason="rejected",
                            error=str(e),
                        )
                    ]
                )

    def _step(self) -> bool:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - reported to the API, which fails every request
            if self.engine.dead is None:
                logger.warning("engine step failed and was discarded: %s", e)
                return True
            self.fatal = self.engine.dead
            logger.error("%s\n%s", self.fatal, traceback.format_exc())
            self._send([], fatal=self.fatal)
            return False
        mono = -wall_offset()  # one clock reading for the step's outputs
        self._send([c for o in outputs for c in core_outputs(o, mono)])
        return True

    def _send(self, outputs: list[CoreOutput], fatal: Optional[str] = None) -> None:
        self.push.send(encode(CoreOutputs(outputs=outputs, stats=self.stats(), fatal=fatal)))

    def stats(self) -> CoreStats:
        return core_stats(self.engine)


def core_stats(engine: LLMEngine) -> CoreStats:
    """The engine's state after a step, as /metrics and /health read it."""
    schedulers = engine.schedulers
    blocks = sum(s.block_manager.num_blocks for s in schedulers)
    used = sum(s.block_manager.num_used_blocks for s in schedulers)
    grammar = engine.grammars.stats() if engine.grammars is not None else {}
    stats = CoreStats(
        **grammar,
        time=time.time(),
        num_running=sum(len(s.running) for s in schedulers),
        num_waiting=sum(len(s.waiting) for s in schedulers),
        kv_cache_usage=used / blocks if blocks else 0.0,
        num_preemptions=sum(s.num_preemptions for s in schedulers),
        steps_eager=engine.stats.steps["eager"],
        steps_req_graph=engine.stats.steps["req_graph"],
        steps_token_graph=engine.stats.steps["token_graph"],
        padded_tokens=engine.stats.padded_tokens,
    )
    spec = engine.stats.spec_decode
    if spec is not None:
        stats.spec_num_drafts = spec.num_drafts
        stats.spec_num_draft_tokens = spec.num_draft_tokens
        stats.spec_num_accepted_tokens = spec.num_accepted_tokens
        stats.spec_accepted_per_position = list(spec.accepted_per_position)
    return stats


def core_outputs(out: RequestOutput, mono: Optional[float] = None) -> list[CoreOutput]:
    """One request's delta from a step (every request the core runs is streamed), one CoreOutput
    per sample in it, `finished` when that sample is. `mono`: -`wall_offset()`,
    once for a step's outputs."""
    if mono is None:
        mono = -wall_offset()  # the API process measures on the monotonic clock
    return [_core_output(out, c, mono) for c in out.outputs]


def _core_output(out: RequestOutput, c: CompletionOutput, mono: float) -> CoreOutput:
    m = out.metrics
    return CoreOutput(  # positional, in CoreOutput's field order (about half the time of keywords)
        out.request_id,
        c.index,
        list(c.token_ids),
        c.text,
        [{int(k): float(v.logprob) for k, v in row.items()} for row in c.logprobs]
        if c.logprobs
        else None,
        c.finished or out.error is not None,
        "rejected" if out.error else c.finish_reason,
        c.stop_reason
        if c.stop_reason is None or isinstance(c.stop_reason, (int, str))
        else str(c.stop_reason),
        len(out.prompt_token_ids),
        m.first_scheduled_time + mono if m and m.first_scheduled_time is not None else None,
        m.first_token_time + mono if m and m.first_token_time is not None else None,
        out.error,
        out.num_cached_tokens or 0,
        [
            None if row is None else {t: [lp.logprob, lp.rank] for t, lp in row.items()}
            for row in out.prompt_logprobs
        ]
        if out.prompt_logprobs is not None
        else None,
    )

"""The per-step hot path between the driver and the workers: ZeroMQ, msgpack, no Ray.

Hot path: `PlanPublisher.publish`, `PlanSubscriber.recv`, `ResultPusher.push`,
`ResultCollector.recv`. What may live here: sockets, the ready handshake, the step-number check.

    driver                                    every worker (dp, tp)
    PUB   plan    ── StepPlan / Flush / Hello ──▶  SUB   (checks steps are contiguous from 0)
          plan    ── GrammarBitmask ────────────▶  SUB   (TP rank 0 of its DP rank only)
    PULL  ready   ◀──────── Ready ───────     PUSH  (handshake only)
    PULL  result  ◀────── StepResult ────     PUSH  (TP rank 0 of each DP rank)

Across nodes (tcp://) every socket speaks ZeroMQ CURVE; on one node (ipc://) the sockets live in a
private directory (distributed/zmq_sockets.py: addresses, keys, binding, bounded waits, errors).

ZeroMQ PUB drops what it sends before a subscriber's connection is up ("slow joiner"). So before
step 0 the driver publishes `Hello` probes until every expected worker has answered `Ready` over
the ready channel; only then is a plan published. PUB/SUB high-water marks are unlimited, so a
slow worker delays, never loses, a plan.

Every wait has a timeout; a `TransportTimeout` names the rank (or "driver") and the phase. A
hot-path receiver may spin before it blocks (`spin_s`: `parallel_config.transport_spin_us`, by
default "auto", 2 ms on a CUDA engine with at least 4 cores, else 0; resolved by
`ParallelConfig.resolved_spin_s`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional, Union

import zmq

from atomrt.distributed.messages import (
    Flush,
    GrammarBitmask,
    Hello,
    Ready,
    StepPlan,
    StepResult,
    decode,
    encode,
    wire_prefix,
)
from atomrt.distributed.zap import ADMISSION
from atomrt.distributed.zmq_sockets import (
    CurveKeys,
    StepGapError,
    TransportAddresses,
    TransportError,
    TransportTimeout,
    _bind,
    _connect,
    _deadline,
    _Inbox,
    _poll_ms,
    _release,
    _socket,
    _wait_ms,
)

__all__ = [  # the four endpoints, and (re-exported) the addresses, keys and errors they take
    "CurveKeys",
    "PlanPublisher",
    "PlanSubscriber",
    "ResultCollector",
    "ResultPusher",
    "StepGapError",
    "TransportAddresses",
    "TransportError",
    "TransportTimeout",
]

logger = logging.getLogger(__name__)

_HELLO_PERIOD_S = 0.01  # how often the driver re-publishes the probe during the handshake


# ------------------------------------------------------------------------------------------- driver


class PlanPublisher:
    """Driver side: binds the plan PUB and the ready PULL; publishes plans after the handshake."""

    def __init__(self, addresses: TransportAddresses, num_subscribers: int) -> None:
        if num_subscribers < 1:
            raise ValueError(f"num_subscribers: need at least 1, got {num_subscribers}")
        self.addresses = addresses
        self.num_subscribers = num_subscribers
        self._curve = addresses.curve
        if self._curve is not None:  # ZAP answers before the first client can connect
            ADMISSION.admit(self._curve.client_public)
        self._pub = _socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)  # never drop a plan for a slow subscriber
        self._ready = _socket(zmq.PULL)
        try:
            _bind(self._pub, addresses.plan, "plan PUB", self._curve)
            _bind(self._ready, addresses.ready, "ready PULL", self._curve)
        except TransportError:
            self.close()
            raise
        self.ready_ranks: dict[int, int] = {}  # rank -> pid
        self.next_step = 0
        self._nonce = int.from_bytes(os.urandom(4), "little")

    def wait_ready(self, timeout: float) -> dict[int, int]:
        """Probe until every subscriber (ranks 0..num_subscribers-1) answered; returns rank -> pid."""
        deadline = _deadline(timeout)
        hello = encode(Hello(instance=self.addresses.instance, nonce=self._nonce))
        while len(self.ready_ranks) < self.num_subscribers:
            self._pub.send(hello)
            if self._ready.poll(_poll_ms(deadline, _HELLO_PERIOD_S)):
                while self._ready.poll(0):
                    msg = decode(self._ready.recv())
                    if isinstance(msg, Ready) and msg.nonce == self._nonce:
                        if not 0 <= msg.rank < self.num_subscribers:
                            raise TransportError(
                                f"driver: handshake: Ready from rank {msg.rank}, expected ranks "
                                f"0..{self.num_subscribers - 1}"
                            )
                        self.ready_ranks[msg.rank] = msg.pid
            if time.monotonic() >= deadline and len(self.ready_ranks) < self.num_subscribers:
                missing = sorted(set(range(self.num_subscribers)) - set(self.ready_ranks))
                raise TransportTimeout(
                    f"driver: handshake: {len(self.ready_ranks)} of {self.num_subscribers} workers ready "
                    f"after {timeout:.1f} s; missing ranks {missing} (plan address {self.addresses.plan})"
                )
        return dict(self.ready_ranks)

    def publish(self, plan: StepPlan) -> None:
        """Send one plan to every worker. Steps must go 0, 1, 2, ... (the workers check it too)."""
        if len(self.ready_ranks) < self.num_subscribers:
            raise TransportError(
                "driver: publish before wait_ready(): a slow subscriber would lose the plan"
            )
        if plan.step != self.next_step:
            raise StepGapError(
                f"driver: publishing step {plan.step}, but the next step is {self.next_step}"
            )
        self._pub.send(encode(plan), copy=False)
        self.next_step += 1

    def publish_grammar(self, masks: GrammarBitmask) -> None:
        """Send a published step's grammar masks; only its DP rank's sampling worker gets them."""
        if not 0 <= masks.step < self.next_step:
            raise TransportError(
                f"driver: grammar masks of step {masks.step}, but only steps "
                f"0..{self.next_step - 1} were published"
            )
        self._pub.send(encode(masks), copy=False)

    def publish_flush(self, step: int) -> None:
        """Ask for pipelined step `step`'s result now; takes no step number."""
        if not 0 <= step < self.next_step:
            raise TransportError(
                f"driver: flush of step {step}, but only steps 0..{self.next_step - 1} were published"
            )
        self._pub.send(encode(Flush(step)))

    def close(self) -> None:
        self._pub.close()
        self._ready.close()
        self._curve = _release(self._curve)


class ResultCollector:
    """Driver side: binds the result PULL."""

    def __init__(self, addresses: TransportAddresses, spin_s: float = 0.0) -> None:
        self.addresses = addresses
        self._curve = addresses.curve
        if self._curve is not None:
            ADMISSION.admit(self._curve.client_public)
        pull = _socket(zmq.PULL)
        try:
            _bind(pull, addresses.result, "result PULL", self._curve)
        except TransportError:
            self._curve = _release(self._curve)
            raise
        self._pull = _Inbox(pull, spin_s)

    def recv(self, timeout: Optional[float]) -> StepResult:
        """The next result from any DP rank."""
        data = self._pull.recv(_wait_ms(timeout))
        if data is None:
            raise TransportTimeout(f"driver: collect results: no StepResult within {timeout:.1f} s")
        msg = decode(data)
        if not isinstance(msg, StepResult):
            raise TransportError(
                f"driver: collect results: expected a StepResult, got {type(msg).__name__}"
            )
        return msg

    def collect(self, step: int, dp_ranks: int, timeout: float) -> list[StepResult]:
        """One result per DP rank for `step`, ordered by DP rank. A worker's error raises."""
        deadline = _deadline(timeout)
        got: dict[int, StepResult] = {}
        while len(got) < dp_ranks:
            data = self._pull.recv(_poll_ms(deadline))
            if data is None:
                missing = sorted(set(range(dp_ranks)) - set(got))
                raise TransportTimeout(
                    f"driver: collect results of step {step}: no StepResult from DP ranks {missing} "
                    f"within {timeout:.1f} s"
                )
            r = decode(data)
            if not isinstance(r, StepResult) or r.step != step:
                what = f"step {r.step}" if isinstance(r, StepResult) else type(r).__name__
                raise TransportError(
                    f"driver: collect results of step {step}: got {what} from the result channel"
                )
            if r.error is not None:
                raise TransportError(f"DP rank {r.dp_rank} failed at step {step}: {r.error}")
            got[r.dp_rank] = r
        return [got[i] for i in range(dp_ranks)]

    def close(self) -> None:
        self._pull.close()
        self._curve = _release(self._curve)


# ------------------------------------------------------------------------------------------- worker


class PlanSubscriber:
    """Worker side: SUB to plans; answers the driver's handshake; checks step numbers.

    It subscribes by each message's leading bytes (`wire_prefix`): plans, flushes and probes, and,
    on a DP rank's sampling worker (`grammar_dp_rank`), that rank's grammar masks; the PUB socket
    sends no other rank's masks down this connection."""

    def __init__(
        self,
        addresses: TransportAddresses,
        rank: int,
        first_step: int = 0,
        spin_s: float = 0.0,
        grammar_dp_rank: Optional[int] = None,
    ) -> None:
        self.addresses = addresses
        self.rank = rank
        self.expected_step = first_step
        sub = _socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        for cls in (StepPlan, Flush, Hello):
            sub.setsockopt(zmq.SUBSCRIBE, wire_prefix(cls))
        if grammar_dp_rank is not None:
            sub.setsockopt(zmq.SUBSCRIBE, wire_prefix(GrammarBitmask, grammar_dp_rank))
        _connect(sub, addresses.plan, addresses.curve)
        self._sub = _Inbox(sub, spin_s)
        self._ready = _socket(zmq.PUSH)
        _connect(self._ready, addresses.ready, addresses.curve)
        self._answered: set[int] = set()

    def recv(self, timeout: Optional[float]) -> Union[StepPlan, Flush, GrammarBitmask]:
        """The next plan (or flush, or grammar masks). Answers handshake probes while waiting; a
        skipped step raises StepGapError."""
        deadline = _deadline(timeout)
        wait_ms = _wait_ms(timeout)
        while True:
            data = self._sub.recv(wait_ms)
            if data is None:
                raise TransportTimeout(
                    f"rank {self.rank}: receive plan: no StepPlan for step {self.expected_step} within "
                    f"{timeout:.1f} s from {self.addresses.plan}"
                )
            msg = decode(data)
            if isinstance(msg, StepPlan):
                return self._check_step(msg)
            if isinstance(msg, (Flush, GrammarBitmask)):
                return msg
            if isinstance(msg, Hello):
                self._answer(msg)
                wait_ms = _poll_ms(deadline)
                continue
            raise TransportError(
                f"rank {self.rank}: receive plan: unexpected {type(msg).__name__} on the plan channel"
            )

    def _answer(self, hello: Hello) -> None:
        if hello.instance != self.addresses.instance or hello.nonce in self._answered:
            return
        self._answered.add(hello.nonce)
        self._ready.send(encode(Ready(rank=self.rank, nonce=hello.nonce, pid=os.getpid())))

    def _check_step(self, plan: StepPlan) -> StepPlan:
        if plan.step != self.expected_step:
            raise StepGapError(
                f"rank {self.rank}: receive plan: got step {plan.step}, expected step {self.expected_step} "
                f"({'a plan was lost' if plan.step > self.expected_step else 'a plan was repeated'})"
            )
        self.expected_step += 1
        return plan

    def close(self) -> None:
        self._sub.close()
        self._ready.close()


class ResultPusher:
    """Worker side (TP rank 0 of each DP rank): PUSH results to the driver."""

    def __init__(self, addresses: TransportAddresses, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self._push = _socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        _connect(self._push, addresses.result, addresses.curve)

    def push(self, result: StepResult) -> None:
        self._push.send(encode(result), copy=False)

    def close(self) -> None:
        self._push.close()

"""The per-step hot path between the driver and the workers: ZeroMQ, msgpack, no Ray.

Hot path: `PlanPublisher.publish`, `PlanSubscriber.recv`, `ResultPusher.push`,
`ResultCollector.recv`. What may live here: sockets, the ready handshake, the step-number check.

    driver                                    every worker (dp, tp)
    PUB   plan    ── StepPlan / Flush / Hello ──▶  SUB   (checks steps are contiguous from 0)
          plan    ── GrammarBitmask ────────────▶  SUB   (TP rank 0 of its DP rank only)
    PULL  ready   ◀──────── Ready ───────     PUSH  (handshake only)
    PULL  result  ◀────── StepResult ────     PUSH  (TP rank 0 of each DP rank)

Across nodes (tcp://) every socket speaks ZeroMQ CURVE: the driver's are servers holding a key pair
made for this engine instance, every worker's are clients holding the instance's one client key pair
(handed to them with the addresses, through Ray), and the driver's ZAP handler admits only that
client key. A peer without the keys completes no handshake, so it can neither read a plan (plans
carry prompt token ids) nor push a result. On one node (ipc://) the sockets live in a private
directory (mode 0700) and skip CURVE: nothing else can reach them, and the hot path pays nothing.

ZeroMQ PUB drops what it sends before a subscriber's connection is up ("slow joiner"). So before
step 0 the driver publishes `Hello` probes until every expected worker has answered `Ready` over
the ready channel; only then is a plan published. PUB/SUB high-water marks are unlimited, so a
slow worker delays, never loses, a plan.

Every wait has a timeout; a `TransportTimeout` names the rank (or "driver") and the phase. On the
hot path a wait is one recv() bounded by ZMQ_RCVTIMEO (`_Inbox`), not a poll() then a recv().
With `spin_s` > 0 a hot-path receiver first polls without blocking for up to that long: a process
that sleeps in recv() pays the kernel's wake-up on every message, one that spins does not, at the
price of a busy core while it waits (`parallel_config.transport_spin_us`: by default "auto", 2 ms on
a CUDA engine with at least 4 cores, else 0; resolved by `ParallelConfig.resolved_spin_s`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

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
from atomrt.distributed.net_utils import (
    get_free_port,
    get_host_ip,
    ipc_address,
    make_ipc_dir,
    new_instance_id,
    tcp_address,
)
from atomrt.distributed.zap import ADMISSION, ZAP_DOMAIN

logger = logging.getLogger(__name__)

_HELLO_PERIOD_S = 0.01  # how often the driver re-publishes the probe during the handshake
_LINGER_MS = 100  # what close() waits for unsent messages
_MAX_RCVTIMEO_MS = 2**31 - 1  # ZMQ_RCVTIMEO is an int; a longer wait is "forever"


class TransportError(RuntimeError):
    """A protocol violation on the step channel (wrong step, wrong message type)."""


class TransportTimeout(TimeoutError):
    """A wait on the step channel ran out; the message names the rank and the phase."""


class StepGapError(TransportError):
    """A worker got a plan whose step number is not the next one: a plan was lost or duplicated."""


@dataclass(frozen=True)
class CurveKeys:
    """The CURVE keys of one engine instance's tcp:// step channel (z85 text), made by its driver.

    `server_secret` never leaves the driver; workers get the rest (`for_workers`)."""

    server_public: str
    client_public: str
    client_secret: str = field(repr=False)
    server_secret: str = field(default="", repr=False)

    @classmethod
    def make(cls) -> CurveKeys:
        if not zmq.has("curve"):
            raise TransportError(
                f"the tcp:// step channel needs ZeroMQ CURVE, and this libzmq ({zmq.zmq_version()}) "
                "was built without it: install pyzmq's wheel from PyPI (it bundles a libzmq with "
                "CURVE), or keep every rank on the driver's node (parallel_config.transport=ipc)"
            )
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(
            server_public.decode(),
            client_public.decode(),
            client_secret.decode(),
            server_secret.decode(),
        )

    def for_workers(self) -> dict[str, str]:
        return {
            "server_public": self.server_public,
            "client_public": self.client_public,
            "client_secret": self.client_secret,
        }


@dataclass(frozen=True)
class TransportAddresses:
    """Where one engine instance's sockets live, and (tcp://) the CURVE keys that guard them.

    `to_dict()` is what the driver hands to its workers: plain strings, but on tcp:// it carries
    the instance's client secret key, so it goes to the engine's own workers only (over Ray or the
    mp pipe), never to a log.
    """

    plan: str  # driver PUB / worker SUB
    ready: str  # worker PUSH / driver PULL (handshake)
    result: str  # worker PUSH / driver PULL
    instance: str
    ipc_dir: str = ""  # "" for tcp://; the driver removes it on cleanup()
    curve: Optional[CurveKeys] = None  # tcp:// only

    @classmethod
    def make(cls, local: bool, host_ip: str = "", instance: str = "") -> TransportAddresses:
        """ipc:// in a private temp dir when every rank is on this node, else tcp:// on its IP,
        with fresh CURVE keys.

        tcp ports are picked free now and bound by the driver right after; `host_ip` defaults to
        this node's detected address (pass ENV.host_ip to override).
        """
        instance = instance or new_instance_id()
        if local:
            d = make_ipc_dir(instance)
            return cls(
                ipc_address(d, "plan"),
                ipc_address(d, "ready"),
                ipc_address(d, "result"),
                instance,
                d,
            )
        keys = CurveKeys.make()
        ip = get_host_ip(host_ip)
        ports = [get_free_port(ip) for _ in range(3)]
        while len(set(ports)) < 3:  # the OS may hand back a just-released port
            ports = [get_free_port(ip) for _ in range(3)]
        return cls(*(tcp_address(ip, p) for p in ports), instance=instance, curve=keys)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "ready": self.ready,
            "result": self.result,
            "instance": self.instance,
            "ipc_dir": self.ipc_dir,
            "curve": self.curve.for_workers() if self.curve is not None else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransportAddresses:
        curve = d.get("curve")
        return cls(**{**d, "curve": CurveKeys(**curve) if curve else None})

    def cleanup(self) -> None:
        """Remove the ipc socket directory (driver side, after its sockets are closed)."""
        if self.ipc_dir and os.path.isdir(self.ipc_dir):
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _release(curve: Optional[CurveKeys]) -> None:
    """A driver socket set closed: its client key no longer admits (returns None to clear it)."""
    if curve is not None:
        ADMISSION.revoke(curve.client_public)


def _socket(kind: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, _LINGER_MS)
    return sock


def _bind(sock: zmq.Socket, address: str, what: str, curve: Optional[CurveKeys]) -> None:
    """Bind a driver socket; with `curve`, as a CURVE server whose clients ZAP checks."""
    if curve is not None:
        if not curve.server_secret:
            sock.close(0)
            raise TransportError(
                f"driver: the {what} socket needs the CURVE server secret key, which only the "
                "driver's TransportAddresses.make() holds (a worker's copy has none)"
            )
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.server_secret.encode())
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        sock.close(0)
        raise TransportError(f"driver: cannot bind the {what} socket to {address}: {e}") from e


def _connect(sock: zmq.Socket, address: str, curve: Optional[CurveKeys]) -> None:
    """Connect a worker socket; with `curve`, as a CURVE client of the driver."""
    if curve is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.client_public.encode())
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.client_secret.encode())
    sock.connect(address)


def _deadline(timeout: Optional[float]) -> float:
    return float("inf") if timeout is None else time.monotonic() + timeout


def _wait_ms(timeout: Optional[float]) -> int:
    return -1 if timeout is None else max(0, int(timeout * 1000))


def _poll_ms(deadline: float, cap_s: Optional[float] = None) -> int:
    left = deadline - time.monotonic()
    if cap_s is not None:
        left = min(left, cap_s)
    return -1 if left == float("inf") else max(0, int(left * 1000))


class _Inbox:
    """A receiving socket whose `recv` waits at most `timeout_ms` through ZMQ_RCVTIMEO, not poll().

    The option is set only when the wait changes (the step loop passes the same one every step), so
    a message costs one recv() call, and one already queued costs no wait at all.
    """

    def __init__(self, sock: zmq.Socket, spin_s: float = 0.0) -> None:
        self.sock = sock
        self.spin_s = spin_s
        self._timeout_ms = -1  # ZMQ's default: wait forever

    def recv(self, timeout_ms: int) -> Optional[bytes]:
        """The next message, or None when `timeout_ms` (-1: forever) passed without one (after
        spinning up to `spin_s`, then blocking; a spin longer than the timeout is cut to it)."""
        if self.spin_s:
            spin = self.spin_s if timeout_ms < 0 else min(self.spin_s, timeout_ms / 1000)
            end = time.perf_counter() + spin
            while True:
                try:
                    return self.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    if time.perf_counter() >= end:
                        break
        if timeout_ms != self._timeout_ms:
            self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms if timeout_ms <= _MAX_RCVTIMEO_MS else -1)
            self._timeout_ms = timeout_ms
        try:
            return self.sock.recv()
        except zmq.Again:
            return None

    def close(self) -> None:
        self.sock.close()


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

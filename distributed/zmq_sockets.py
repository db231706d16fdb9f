"""The sockets of the step channel (distributed/transport.py): where an engine instance's sockets
live (`TransportAddresses`), the CURVE keys that guard them across nodes (`CurveKeys`), how a driver
socket binds and a worker socket connects, the bounded waits, and the channel's errors.

Across nodes (tcp://) every socket speaks ZeroMQ CURVE: the driver's are servers holding a key pair
made for this engine instance, every worker's are clients holding the instance's one client key pair
(handed to them with the addresses, through Ray), and the driver's ZAP handler admits only that
client key. A peer without the keys completes no handshake, so it can neither read a plan (plans
carry prompt token ids) nor push a result. On one node (ipc://) the sockets live in a private
directory (mode 0700) and skip CURVE: nothing else can reach them, and the hot path pays nothing.

On the hot path a wait is one recv() bounded by ZMQ_RCVTIMEO (`_Inbox`), not a poll() then a
recv(). With `spin_s` > 0 a hot-path receiver first polls without blocking for up to that long: a
process that sleeps in recv() pays the kernel's wake-up on every message, one that spins does not,
at the price of a busy core while it waits.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq

from atomrt.distributed.net_utils import (
    get_free_port,
    get_host_ip,
    ipc_address,
    make_ipc_dir,
    new_instance_id,
    tcp_address,
)
from atomrt.distributed.zap import ADMISSION, ZAP_DOMAIN

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

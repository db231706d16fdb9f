"""The tcp:// step channel is authenticated (ZeroMQ CURVE + ZAP), with real sockets and a real engine.

A rogue peer on the network (no keys, or the driver's public key but a key pair of its own) is
refused at the handshake: it reads no plan and its results never reach the driver, while the
engine's own workers keep stepping. The ipc:// channel stays as it was (no CURVE).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Optional

import pytest
import zmq
from executor_harness import COMMON, GREEDY, PROMPTS, build_tiny_llama, greedy_tokens
from test_transport import _plan

from atomrt.distributed.messages import StepResult, encode
from atomrt.distributed.transport import (
    PlanPublisher,
    PlanSubscriber,
    ResultCollector,
    ResultPusher,
    TransportAddresses,
    TransportError,
    TransportTimeout,
)
from atomrt.distributed.zap import ADMISSION

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class _Rogue:
    """A socket on the channel's address: plain (no CURVE) or a CURVE client with the driver's
    public key but a key pair of its own. It watches its own handshakes through a monitor."""

    def __init__(self, kind: int, address: str, server_public: Optional[str]) -> None:
        self.sock = zmq.Context.instance().socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.SUB:
            self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if server_public is not None:
            public, secret = zmq.curve_keypair()
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, server_public.encode())
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self.monitor = self.sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        self.sock.connect(address)

    def handshake_events(self) -> set[int]:
        from zmq.utils.monitor import recv_monitor_message

        events = set()
        while self.monitor.poll(0):
            events.add(recv_monitor_message(self.monitor)["event"])
        return events

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


def _rogues(addresses: TransportAddresses) -> list[_Rogue]:
    public = addresses.curve.server_public
    return [
        _Rogue(zmq.SUB, addresses.plan, None),
        _Rogue(zmq.SUB, addresses.plan, public),
        _Rogue(zmq.PUSH, addresses.result, None),
        _Rogue(zmq.PUSH, addresses.result, public),
        _Rogue(zmq.PUSH, addresses.ready, public),
    ]


def _attack(rogues: list[_Rogue], stop: threading.Event) -> dict[int, int]:
    """Until `stop`: every rogue PUSH sends forged results, every rogue SUB tries to read; returns
    how many messages each rogue received."""
    forged = encode(StepResult(step=0, dp_rank=0, error="forged by a rogue peer"))
    received = {i: 0 for i in range(len(rogues))}
    while not stop.is_set():
        for i, rogue in enumerate(rogues):
            if rogue.sock.type == zmq.PUSH:
                try:
                    rogue.sock.send(forged, zmq.NOBLOCK)
                except zmq.Again:  # no peer admitted it: nothing to send to
                    pass
            else:
                while rogue.sock.poll(0):
                    rogue.sock.recv()
                    received[i] += 1
        time.sleep(0.01)
    return received


def _wait_for_failed_handshakes(rogues: list[_Rogue], timeout: float = 10.0) -> list[set[int]]:
    """Every rogue's monitor events once each has seen its handshake fail."""
    seen: list[set[int]] = [set() for _ in rogues]
    failed = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    failed |= zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for events, rogue in zip(seen, rogues):
            events |= rogue.handshake_events()
        if all(any(e & failed for e in events) for events in seen):
            break
        time.sleep(0.05)
    return seen


def test_tcp_keys_are_per_instance_and_the_server_secret_stays_with_the_driver():
    a = TransportAddresses.make(local=False, host_ip="127.0.0.1")
    b = TransportAddresses.make(local=False, host_ip="127.0.0.1")
    assert a.curve is not None and b.curve is not None
    assert a.curve.server_public != b.curve.server_public
    assert a.curve.client_public != b.curve.client_public
    sent = a.to_dict()
    assert a.curve.server_secret and a.curve.server_secret not in repr(sent)
    assert a.curve.client_secret not in repr(a)  # never in a log line
    worker_copy = TransportAddresses.from_dict(sent)
    assert worker_copy.curve.server_secret == "" and worker_copy.curve.client_secret
    with pytest.raises(TransportError, match="server secret"):
        PlanPublisher(worker_copy, num_subscribers=1)  # a worker's copy cannot act as the driver
    local = TransportAddresses.make(local=True)
    try:
        assert local.curve is None and local.to_dict()["curve"] is None  # ipc://: no CURVE
    finally:
        local.cleanup()


def test_rogue_peers_are_refused_and_the_channel_carries_on():
    addresses = TransportAddresses.make(local=False, host_ip="127.0.0.1")
    worker_addresses = TransportAddresses.from_dict(addresses.to_dict())
    pub = PlanPublisher(addresses, num_subscribers=1)
    col = ResultCollector(addresses)
    refused_before = ADMISSION.refused
    rogues = _rogues(addresses)
    stop = threading.Event()
    outcome: dict = {}
    attacker = threading.Thread(target=lambda: outcome.update(received=_attack(rogues, stop)))
    attacker.start()
    sub = PlanSubscriber(worker_addresses, rank=0)
    pusher = ResultPusher(worker_addresses, dp_rank=0)
    got: list[int] = []

    def worker() -> None:
        for _ in range(20):
            plan = sub.recv(timeout=10)
            got.append(plan.step)
            pusher.push(StepResult(step=plan.step, dp_rank=0))

    try:
        events = _wait_for_failed_handshakes(rogues)
        thread = threading.Thread(target=worker)
        thread.start()
        pub.wait_ready(timeout=10)
        for step in range(20):
            pub.publish(_plan(step))
            (res,) = col.collect(step, dp_ranks=1, timeout=10)
            assert res.step == step and res.error is None  # never a forged result
        thread.join(10)
        assert got == list(range(20))
        with pytest.raises(TransportTimeout):  # nothing else reached the driver
            col.recv(timeout=0.5)
    finally:
        stop.set()
        attacker.join(10)
        for rogue in rogues:
            rogue.close()
        sub.close()
        pusher.close()
        pub.close()
        col.close()
    assert outcome["received"] == {i: 0 for i in range(len(rogues))}, "a rogue read a plan"
    for seen in events:
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in seen, f"a rogue completed a handshake: {seen}"
        assert seen, "a rogue never reached the driver's socket"
    # the CURVE rogues were turned away by the driver's ZAP handler, not by a wrong address
    assert ADMISSION.refused - refused_before >= 3


def test_a_peer_holding_the_keys_is_admitted():
    """The control for the test above: the same sockets, given the engine's keys, connect."""
    addresses = TransportAddresses.make(local=False, host_ip="127.0.0.1")
    pub = PlanPublisher(addresses, num_subscribers=1)
    sub = PlanSubscriber(TransportAddresses.from_dict(addresses.to_dict()), rank=0)
    try:
        done = threading.Thread(target=lambda: sub.recv(timeout=10))
        done.start()
        pub.wait_ready(timeout=10)
        pub.publish(_plan(0))
        done.join(10)
        assert sub.expected_step == 1
    finally:
        sub.close()
        pub.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def test_engine_over_tcp_refuses_rogues_and_carries_on(tiny_model: Path) -> None:
    """A Ray engine stepping over tcp:// while rogue peers try to read plans and push results."""
    import ray

    from atomrt.runtime.entrypoints.llm import LLM

    reference, _ = greedy_tokens(tiny_model, executor="inproc")
    llm = LLM(str(tiny_model), executor="ray", transport="tcp", **COMMON)
    stop = threading.Event()
    outcome: dict = {}
    try:
        addresses = llm.engine.executor.channel.addresses
        assert addresses.plan.startswith("tcp://") and addresses.curve is not None
        rogues = _rogues(addresses)
        attacker = threading.Thread(target=lambda: outcome.update(received=_attack(rogues, stop)))
        attacker.start()
        try:
            events = _wait_for_failed_handshakes(rogues)
            first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
            second = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]
        finally:
            stop.set()
            attacker.join(10)
            for rogue in rogues:
                rogue.close()
    finally:
        llm.shutdown()
    assert not ray.is_initialized()
    assert first == reference and second == reference[:2]
    assert outcome["received"] == {i: 0 for i in range(len(rogues))}
    assert all(seen and zmq.EVENT_HANDSHAKE_SUCCEEDED not in seen for seen in events), events


def test_the_authenticator_starts_again_right_after_it_stopped():
    """The last channel of the process closing stops the ZAP handler; a channel opened right after
    starts a new one, whose bind must wait until the old one's endpoint is released."""
    for i in range(30):
        ADMISSION.admit(f"client-key-{i}")
        ADMISSION.revoke(f"client-key-{i}")

"""The ZeroMQ step channel, with real sockets: handshake, late joiners, step checks, timeouts."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from records_harness import check_records

from atomrt.distributed.messages import RankBatch, StepPlan, StepResult
from atomrt.distributed.transport import (
    PlanPublisher,
    PlanSubscriber,
    ResultCollector,
    ResultPusher,
    StepGapError,
    TransportAddresses,
    TransportError,
    TransportTimeout,
)
from atomrt.runtime.bench.targets import env_variant
from atomrt.runtime.decision import ForwardDecision, ForwardKind


@pytest.fixture(params=["ipc", "tcp"])
def addresses(request):
    addr = TransportAddresses.make(local=request.param == "ipc", host_ip="127.0.0.1")
    yield addr
    addr.cleanup()


def _plan(step: int, bs: int = 4) -> StepPlan:
    rb = RankBatch(
        seq_ids=np.arange(bs, dtype=np.int64),
        num_new_tokens=np.ones(bs, np.int32),
        num_computed_tokens=np.full(bs, step, np.int32),
        input_ids=np.full(bs, step, np.int32),
        sample_mask=np.ones(bs, np.bool_),
    )
    decision = ForwardDecision(
        ForwardKind.EAGER,
        running_bs=bs,
        running_tokens=bs,
        is_prefill=False,
        dp_num_tokens=(bs,),
        dp_padded_tokens=(bs,),
    )
    return StepPlan(step=step, decision=decision, ranks=[rb])


def _receive_all(
    addr: TransportAddresses, rank: int, n: int, out: dict, start_delay: float = 0.0
) -> None:
    time.sleep(start_delay)
    sub = PlanSubscriber(addr, rank)
    try:
        out[rank] = [sub.recv(timeout=10).step for _ in range(n)]
    except Exception as e:  # reported by the test thread below
        out[rank] = e
    finally:
        sub.close()


def test_addresses_are_per_instance():
    a = TransportAddresses.make(local=True)
    b = TransportAddresses.make(local=True)
    try:
        assert a.plan.startswith("ipc://") and a.plan != b.plan and a.instance != b.instance
        assert TransportAddresses.from_dict(json.loads(json.dumps(a.to_dict()))) == a
        t = TransportAddresses.make(local=False, host_ip="127.0.0.1")
        assert t.plan.startswith("tcp://127.0.0.1:") and len({t.plan, t.ready, t.result}) == 3
    finally:
        a.cleanup()
        b.cleanup()


def test_late_joining_subscribers_lose_no_plan(addresses):
    n_sub, n_steps = 3, 30
    pub = PlanPublisher(addresses, num_subscribers=n_sub)
    got: dict = {}
    threads = [
        threading.Thread(target=_receive_all, args=(addresses, r, n_steps, got, 0.2 * r))
        for r in range(n_sub)
    ]
    for t in threads:
        t.start()
    try:
        pids = pub.wait_ready(timeout=10)
        assert sorted(pids) == [0, 1, 2]
        for step in range(n_steps):
            pub.publish(_plan(step))
        for t in threads:
            t.join(10)
        assert got == {r: list(range(n_steps)) for r in range(n_sub)}
    finally:
        pub.close()


_CHILD = r"""
import json, sys
from atomrt.distributed.messages import StepResult
from atomrt.distributed.transport import PlanSubscriber, ResultPusher, TransportAddresses
addr = TransportAddresses.from_dict(json.loads(sys.argv[1]))
sub, push = PlanSubscriber(addr, rank=1), ResultPusher(addr, dp_rank=0)
while True:
    plan = sub.recv(timeout=20)
    if plan.shutdown:
        break
    rb = plan.ranks[0]
    push.push(StepResult(step=plan.step, dp_rank=0, seq_ids=rb.seq_ids, sampled_token_ids=rb.input_ids + 1))
sub.close(); push.close()
"""


def test_plans_and_results_flow_to_a_subprocess(addresses):
    pub = PlanPublisher(addresses, num_subscribers=2)
    col = ResultCollector(addresses)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(addresses.to_dict())])
    got: dict = {}
    local = threading.Thread(target=_receive_all, args=(addresses, 0, 6, got))
    local.start()
    try:
        pub.wait_ready(timeout=30)
        for step in range(5):
            pub.publish(_plan(step))
            (res,) = col.collect(step, dp_ranks=1, timeout=10)
            assert res.step == step and res.sampled_token_ids.tolist() == [step + 1] * 4
        pub.publish(StepPlan(step=5, shutdown=True))
        assert child.wait(timeout=20) == 0
        local.join(10)
        assert got[0] == list(range(6))
    finally:
        if child.poll() is None:
            child.kill()
        pub.close()
        col.close()


def test_skipped_step_is_an_error(addresses):
    pub = PlanPublisher(addresses, num_subscribers=1)
    sub = PlanSubscriber(addresses, rank=0)
    try:
        ready = threading.Thread(target=pub.wait_ready, args=(10,))
        ready.start()
        with pytest.raises(TransportTimeout):  # answers the probe while waiting for step 0
            while ready.is_alive():
                sub.recv(timeout=0.3)
        ready.join()
        pub.publish(_plan(0))
        assert sub.recv(timeout=5).step == 0
        with pytest.raises(StepGapError, match="publishing step 2"):
            pub.publish(_plan(2))  # the driver refuses to skip
        pub.next_step = 2  # a lost plan, as a worker would see it
        pub.publish(_plan(2))
        with pytest.raises(
            StepGapError, match=r"rank 0: receive plan: got step 2, expected step 1"
        ):
            sub.recv(timeout=5)
    finally:
        pub.close()
        sub.close()


def test_publish_before_handshake_is_refused(addresses):
    pub = PlanPublisher(addresses, num_subscribers=1)
    try:
        with pytest.raises(TransportError, match="before wait_ready"):
            pub.publish(_plan(0))
    finally:
        pub.close()


def test_timeouts_name_rank_and_phase(addresses):
    pub = PlanPublisher(addresses, num_subscribers=2)
    col = ResultCollector(addresses)
    sub = PlanSubscriber(addresses, rank=1)
    try:
        t0 = time.monotonic()
        answering = threading.Thread(
            target=_swallow, args=(sub.recv, 0.8)
        )  # rank 1 answers the probe
        answering.start()
        with pytest.raises(
            TransportTimeout, match=r"handshake: 1 of 2 workers ready .* missing ranks \[0\]"
        ):
            pub.wait_ready(timeout=0.5)
        assert time.monotonic() - t0 < 3
        answering.join()
        with pytest.raises(TransportTimeout, match=r"rank 1: receive plan: no StepPlan for step 0"):
            sub.recv(timeout=0.05)
        with pytest.raises(
            TransportTimeout, match=r"driver: collect results of step 7: .*DP ranks \[0, 1\]"
        ):
            col.collect(7, dp_ranks=2, timeout=0.05)
    finally:
        pub.close()
        col.close()
        sub.close()


def _swallow(fn, *args):
    try:
        fn(*args)
    except TransportTimeout:
        pass


def test_worker_error_reaches_the_driver(addresses):
    col = ResultCollector(addresses)
    push = ResultPusher(addresses, dp_rank=1)
    try:
        push.push(StepResult(step=0, dp_rank=0))
        push.push(StepResult(step=0, dp_rank=1, error="CUDA out of memory"))
        with pytest.raises(TransportError, match="DP rank 1 failed at step 0: CUDA out of memory"):
            col.collect(0, dp_ranks=2, timeout=5)
    finally:
        col.close()
        push.close()


@pytest.mark.parametrize("spin_s", [0.0, 0.02], ids=["sleep", "spin"])
def test_each_wait_follows_its_own_timeout(addresses, spin_s):
    """Waits are recv() with ZMQ_RCVTIMEO, set when the timeout changes: each call gets its own.
    A spinning receiver (transport_spin_us) polls first, never past the timeout, then sleeps."""
    pub = PlanPublisher(addresses, num_subscribers=1)
    col = ResultCollector(addresses, spin_s=spin_s)
    sub = PlanSubscriber(addresses, rank=0, spin_s=spin_s)
    push = ResultPusher(addresses, dp_rank=0)
    try:
        for timeout in (0.05, 0.3, 0.05):
            t0 = time.monotonic()
            with pytest.raises(TransportTimeout, match=f"within {timeout:.1f} s"):
                col.recv(timeout)
            assert timeout - 0.01 <= time.monotonic() - t0 < timeout + 1.0
        ready = threading.Thread(target=pub.wait_ready, args=(10,))
        ready.start()
        with pytest.raises(TransportTimeout):  # answers the probe, then times out on step 0
            while ready.is_alive():
                sub.recv(timeout=0.3)
        ready.join()
        pub.publish(_plan(0))
        pub.publish(_plan(1))
        assert sub.recv(timeout=1e9).step == 0  # longer than ZMQ_RCVTIMEO can hold: no limit
        time.sleep(0.2)
        assert sub.recv(timeout=0).step == 1  # already queued: no wait needed
        push.push(StepResult(step=1, dp_rank=0))
        assert col.recv(timeout=None).step == 1
        with pytest.raises(TransportTimeout, match="no StepPlan for step 2"):
            sub.recv(timeout=0)
    finally:
        pub.close()
        col.close()
        sub.close()
        push.close()


def test_transport_bench_runs(tmp_path):
    from atomrt.runtime.bench.transport import main, run_bench

    r = run_bench(steps=50, bs=8, warmup=5)
    assert r.steps == 50 and 0 < r.bare_median_us and 0 < r.median_us <= r.p99_us
    assert 0 < r.result_bytes < r.plan_bytes < 1024
    from atomrt.runtime.bench.transport import LEGS

    # every leg was stamped (a zero stamp would give a leg of about the clock's whole reading), in
    # the order of a round trip. A leg within one process is ordered; the two between processes
    # start at a stamp taken after the send returned, and the receiver, woken on the sender's
    # core, can stamp its receive first: those may read below zero, never by a round trip.
    assert list(r.legs_us) == [name for name, _, _ in LEGS]
    across = {"to worker", "to driver"}
    for name, v in r.legs_us.items():
        low = -r.p99_us if name in across else 0
        assert low <= v < r.p99_us, (name, r.legs_us, r.p99_us)
    assert r.legs_us["driver encode+send"] > 0 and r.legs_us["worker decode"] > 0
    # `atomrt bench transport` spinning, its result as JSON and as a record
    out, records = tmp_path / "transport.json", tmp_path / "records"
    main(
        ["--steps", "50", "--bs", "8", "--spin-us", "500", "--json", str(out)]
        + ["--record", str(records)]
    )
    spun = json.loads(out.read_text())
    assert spun["spin_us"] == 500 and 0 < spun["median_us"] <= spun["p99_us"]
    ((f,),) = [r.figures for r in check_records(records, "transport")]
    case = ", ".join(["bs=8 ipc, spin 500 µs", *env_variant()])
    assert (f.target, f.case, f.unit) == ("transport", case, "µs")
    assert (f.value, f.anchor) == (round(spun["median_us"], 1), round(spun["bare_median_us"], 1))
    assert f.threshold.value == 100 and f.met == (f.value <= 100)

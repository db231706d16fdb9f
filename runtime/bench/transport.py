"""Round-trip cost of one step on the transport: driver -> worker -> driver, no model.

`python -m atomrt.runtime.bench.transport [--steps N] [--bs 256] [--tcp] [--spin-us S]` prints one line:
the median and p99 of (encode + publish, worker receive + decode + result encode + push,
driver receive + decode) for a `bs`-request decode plan. Target: median <= 100 us on one node.
A second line splits the median into its legs, from CLOCK_MONOTONIC stamps the driver and the
worker take (one clock for every process of the machine): the driver's encode + send, the plan's
way to the worker's recv() returning, the worker's decode, its result encode + push, the result's
way back, and the driver's decode.
The worker is a separate process, as in the engine. Beside it, the floor on this machine now: the
median of a bare pyzmq PUB -> SUB -> PUSH -> PULL round trip of bytes of the same sizes (no codec,
no checks), so that a number taken on a busy machine can still be read. `--spin-us` sets both
receivers' `transport_spin_us` (the bare round trip always sleeps in recv()).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from atomrt.distributed.messages import RankBatch, StepPlan, StepResult, decode, encode
from atomrt.distributed.transport import (
    PlanPublisher,
    PlanSubscriber,
    ResultCollector,
    ResultPusher,
    TransportAddresses,
)
from atomrt.runtime.bench import goals, records
from atomrt.runtime.bench.records import add_record_flag, resolve_record_flag, save
from atomrt.runtime.bench.targets import env_variant, row_case
from atomrt.runtime.decision import ForwardDecision, ForwardKind


@dataclass
class BenchResult:
    steps: int
    bs: int
    median_us: float
    p99_us: float
    plan_bytes: int
    result_bytes: int
    bare_median_us: float  # bare pyzmq round trip of plan_bytes out, result_bytes back
    spin_us: float = 0.0
    legs_us: dict = field(default_factory=dict)  # leg name -> median us (see LEGS)


# The legs of one round trip, in order: (name, index of the stamp it starts at, index it ends at) in
# the stamps [driver before encode, driver after send, worker recv returned, worker decoded, worker
# pushed, driver recv returned, driver decoded]. The two legs between processes start at a stamp
# taken after the send returned: a receiver woken on the sender's core can stamp first, so on a
# crowded machine their medians can read a little below zero.
LEGS = (
    ("driver encode+send", 0, 1),
    ("to worker", 1, 2),
    ("worker decode", 2, 3),
    ("worker result encode+push", 3, 4),
    ("to driver", 4, 5),
    ("driver decode", 5, 6),
)


def decode_plan(step: int, bs: int) -> StepPlan:
    """A decode step as the driver would send it: one new token per sequence, a few new blocks."""
    rng = np.random.default_rng(step)
    updated = np.arange(
        step % 16, bs, 16
    )  # one sequence in 16 gets a new block: 16 updates at bs=256
    rb = RankBatch(
        seq_ids=np.arange(bs, dtype=np.int64),
        num_new_tokens=np.ones(bs, np.int32),
        num_computed_tokens=np.full(bs, 1000 + step, np.int32),
        input_ids=rng.integers(0, 50000, bs).astype(np.int32),
        new_block_seq_ids=updated.astype(np.int64),
        new_block_starts=np.full(updated.shape[0], 63, np.int32),
        num_new_blocks=np.ones(updated.shape[0], np.int32),
        new_block_ids=updated.astype(np.int32),
        sample_mask=np.ones(bs, np.bool_),
    )
    decision = ForwardDecision(
        ForwardKind.REQ_GRAPH,
        running_bs=bs,
        running_tokens=bs,
        is_prefill=False,
        req_key=(bs, 0),
        dp_num_tokens=(bs,),
        dp_padded_tokens=(bs,),
    )
    return StepPlan(step=step, decision=decision, ranks=[rb])


def _echo_worker(addresses: dict, spin_s: float, stamps_path: str, steps: int) -> None:
    """Echo every plan back as a result. The first `steps` plans' (recv returned, decoded, pushed)
    monotonic-ns stamps go to `stamps_path` at shutdown (int64 [steps, 3])."""
    addr = TransportAddresses.from_dict(addresses)
    sub, push = PlanSubscriber(addr, rank=0, spin_s=spin_s), ResultPusher(addr, dp_rank=0)
    stamps = np.zeros((steps, 3), np.int64)
    inbox, clock = sub._sub, time.monotonic_ns
    try:
        plan = sub.recv(
            timeout=60
        )  # step 0, after the handshake's probes; from here on only plans come
        while True:
            if plan.shutdown:
                np.save(stamps_path, stamps)
                return
            rb = plan.ranks[0]
            push.push(
                StepResult(
                    step=plan.step, dp_rank=0, seq_ids=rb.seq_ids, sampled_token_ids=rb.input_ids
                )
            )
            if plan.step < steps:
                stamps[plan.step, 2] = clock()
            data = inbox.recv(60_000)  # the hot path of PlanSubscriber.recv, stamped in between
            t_recv = clock()
            if data is None:
                raise TimeoutError("transport_bench worker: no plan within 60 s")
            plan = sub._check_step(decode(data))
            if plan.step < steps:
                stamps[plan.step, :2] = (t_recv, clock())
    finally:
        sub.close()
        push.close()


def run_bench(
    steps: int = 10_000, bs: int = 256, local: bool = True, warmup: int = 200, spin_us: float = 0.0
) -> BenchResult:
    addr = TransportAddresses.make(local=local, host_ip="127.0.0.1" if not local else "")
    pub, col = PlanPublisher(addr, num_subscribers=1), ResultCollector(addr, spin_s=spin_us / 1e6)
    stamps_path = os.path.join(
        tempfile.mkdtemp(prefix="atomrt-transport-bench-"), "worker_stamps.npy"
    )
    worker = mp.get_context("spawn").Process(
        target=_echo_worker,
        args=(addr.to_dict(), spin_us / 1e6, stamps_path, warmup + steps),
        daemon=True,
    )
    worker.start()
    try:
        pub.wait_ready(timeout=60)
        plans = [decode_plan(s, bs) for s in range(16)]  # built ahead: measure the transport only
        # driver stamps per step: before encode, after send, recv returned, decoded (monotonic ns)
        stamps = np.zeros((warmup + steps, 4), np.int64)
        inbox, clock = col._pull, time.monotonic_ns
        for step in range(warmup + steps):
            plan = plans[step % 16]
            plan.step = step
            t0 = clock()
            pub.publish(plan)
            t1 = clock()
            data = inbox.recv(10_000)
            t2 = clock()
            if data is None:
                raise TimeoutError(f"transport_bench: no result for step {step} within 10 s")
            result = decode(data)
            stamps[step] = (t0, t1, t2, clock())
            if result.step != step:
                raise RuntimeError(
                    f"transport_bench: result of step {result.step}, expected {step}"
                )
        pub.publish(StepPlan(step=warmup + steps, shutdown=True))
        worker.join(10)
        worker_stamps = np.load(stamps_path)
    finally:
        if worker.is_alive():
            worker.kill()
        pub.close()
        col.close()
        addr.cleanup()
        shutil.rmtree(os.path.dirname(stamps_path), ignore_errors=True)
    d, w = stamps[warmup:], worker_stamps[warmup:]
    all_stamps = np.concatenate([d[:, :2], w, d[:, 2:]], axis=1)  # in LEGS' order
    times = (d[:, 3] - d[:, 0]) / 1e3
    legs = {
        name: float(np.median(all_stamps[:, b] - all_stamps[:, a]) / 1e3) for name, a, b in LEGS
    }
    rb = plans[0].ranks[0]
    plan_bytes = len(encode(plans[0]))
    result_bytes = len(
        encode(StepResult(step=0, dp_rank=0, seq_ids=rb.seq_ids, sampled_token_ids=rb.input_ids))
    )
    bare = bare_round_trip_us(min(steps, 3000), plan_bytes, result_bytes, local, warmup)
    return BenchResult(
        steps,
        bs,
        float(np.median(times)),
        float(np.percentile(times, 99)),
        plan_bytes,
        result_bytes,
        bare,
        spin_us,
        legs,
    )


def _bare_echo(plan: str, result: str, result_bytes: int) -> None:
    ctx = zmq.Context.instance()
    sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 60_000)
    sub.connect(plan)
    push.connect(result)
    reply = bytes(result_bytes)
    try:
        while sub.recv() != b"stop":
            push.send(reply)
    finally:
        sub.close(0)
        push.close(0)


def bare_round_trip_us(
    steps: int, plan_bytes: int, result_bytes: int, local: bool, warmup: int
) -> float:
    """Median us of a bare pyzmq PUB -> SUB -> PUSH -> PULL round trip, in another process."""
    addr = TransportAddresses.make(local=local, host_ip="127.0.0.1" if not local else "")
    ctx = zmq.Context.instance()
    pub, pull = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    pub.bind(addr.plan)
    pull.bind(addr.result)
    echo = mp.get_context("spawn").Process(
        target=_bare_echo, args=(addr.plan, addr.result, result_bytes), daemon=True
    )
    echo.start()
    try:
        deadline = time.monotonic() + 60
        while not pull.poll(10):  # the slow joiner: probe until the echo answers
            if time.monotonic() > deadline:
                raise TimeoutError(
                    "transport_bench: the bare echo process did not answer within 60 s"
                )
            pub.send(b"probe")
        while pull.poll(50):
            pull.recv()
        pull.setsockopt(zmq.RCVTIMEO, 10_000)
        msg = bytes(plan_bytes)
        times = np.empty(steps, dtype=np.float64)
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            pub.send(msg)
            pull.recv()
            if i >= warmup:
                times[i - warmup] = time.perf_counter() - t0
        pub.send(b"stop")
        echo.join(10)
        return float(np.median(times) * 1e6)
    finally:
        if echo.is_alive():
            echo.kill()
        pub.close(0)
        pull.close(0)
        addr.cleanup()


def transport_figures(r: BenchResult, tcp: bool) -> list[records.Figure]:
    axes = f"bs={r.bs} {'tcp' if tcp else 'ipc'}, spin {r.spin_us:g} µs"
    return [
        records.figure(
            "transport",
            row_case(axes, env_variant()),
            round(r.median_us, 1),
            "µs",
            anchor=round(r.bare_median_us, 1),
            anchor_name="bare pyzmq round trip",
            threshold=goals.threshold("transport"),
            extra={"p99": records.Quantity(round(r.p99_us, 1), "µs")},
        )
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="atomrt bench transport", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--tcp", action="store_true", help="tcp:// on 127.0.0.1 instead of ipc://")
    ap.add_argument(
        "--spin-us", type=float, default=0.0, help="receivers poll this long before sleeping"
    )
    ap.add_argument("--json", default="", help="also write the result here")
    add_record_flag(ap)
    args = ap.parse_args(argv)
    resolve_record_flag(args, ap)
    r = run_bench(args.steps, args.bs, local=not args.tcp, spin_us=args.spin_us)
    print(
        f"transport round trip ({'tcp' if args.tcp else 'ipc'}, spin {r.spin_us:g} us, bs={r.bs}, "
        f"{r.plan_bytes} B plan, {r.steps} steps): median {r.median_us:.1f} us, p99 {r.p99_us:.1f} us "
        f"(target <= 100 us; bare pyzmq round trip of the same sizes here: median {r.bare_median_us:.1f} us)"
    )
    print("legs (median us): " + ", ".join(f"{k} {v:.1f}" for k, v in r.legs_us.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r.__dict__, f)
    if args.record is not None:  # the host's figure: its GPUs name the machine, if it has any
        argv = sys.argv[1:] if argv is None else argv
        save(args.record, "transport", argv, transport_figures(r, args.tcp), on_gpu=True)


if __name__ == "__main__":
    main(sys.argv[1:])

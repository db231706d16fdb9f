"""Round-trip cost of one step on the transport: driver -> worker -> driver, no model.

`python -m atomrt.distributed.transport_bench [--steps N] [--bs 256] [--tcp] [--spin-us S]` prints one line:
the median and p99 of (encode + publish, worker receive + decode + result encode + push,
driver receive + decode) for a `bs`-request decode plan. Target: median <= 100 us on one node.
The worker is a separate process, as in the engine. Beside it, the floor on this machine now: the
median of a bare pyzmq PUB -> SUB -> PUSH -> PULL round trip of bytes of the same sizes (no codec,
no checks), so that a number taken on a busy machine can still be read. `--spin-us` sets both
receivers' `transport_spin_us` (the bare round trip always sleeps in recv()).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass

import numpy as np
import zmq

from atomrt.distributed.messages import RankBatch, StepPlan, StepResult, encode
from atomrt.distributed.transport import PlanPublisher, PlanSubscriber, ResultCollector, ResultPusher, TransportAddresses


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


def decode_plan(step: int, bs: int) -> StepPlan:
    """A decode step as the driver would send it: one new token per sequence, a few new blocks."""
    rng = np.random.default_rng(step)
    rb = RankBatch(
        seq_ids=np.arange(bs, dtype=np.int64),
        num_new_tokens=np.ones(bs, np.int32),
        num_computed_tokens=np.full(bs, 1000 + step, np.int32),
        input_ids=rng.integers(0, 50000, bs).astype(np.int32),
        block_table_updates={s: (63, np.array([s], np.int32)) for s in range(step % 16, bs, 16)},
        sample_mask=np.ones(bs, np.bool_),
    )
    return StepPlan(step=step, mode=2, bucket=bs, running_bs=bs, running_tokens=bs, num_tokens_across_dp=[bs],
                    ranks=[rb])


def _echo_worker(addresses: dict, spin_s: float) -> None:
    addr = TransportAddresses.from_dict(addresses)
    sub, push = PlanSubscriber(addr, rank=0, spin_s=spin_s), ResultPusher(addr, dp_rank=0)
    try:
        while True:
            plan = sub.recv(timeout=60)
            if plan.shutdown:
                return
            rb = plan.ranks[0]
            push.push(StepResult(step=plan.step, dp_rank=0, seq_ids=rb.seq_ids, sampled_token_ids=rb.input_ids))
    finally:
        sub.close()
        push.close()


def run_bench(steps: int = 10_000, bs: int = 256, local: bool = True, warmup: int = 200, spin_us: float = 0.0) -> BenchResult:
    addr = TransportAddresses.make(local=local, host_ip="127.0.0.1" if not local else "")
    pub, col = PlanPublisher(addr, num_subscribers=1), ResultCollector(addr, spin_s=spin_us / 1e6)
    worker = mp.get_context("spawn").Process(target=_echo_worker, args=(addr.to_dict(), spin_us / 1e6), daemon=True)
    worker.start()
    try:
        pub.wait_ready(timeout=60)
        plans = [decode_plan(s, bs) for s in range(16)]  # built ahead: measure the transport only
        times = np.empty(steps, dtype=np.float64)
        for step in range(warmup + steps):
            plan = plans[step % 16]
            plan.step = step
            t0 = time.perf_counter()
            pub.publish(plan)
            col.recv(timeout=10)
            if step >= warmup:
                times[step - warmup] = time.perf_counter() - t0
        pub.publish(StepPlan(step=warmup + steps, shutdown=True))
        worker.join(10)
    finally:
        if worker.is_alive():
            worker.kill()
        pub.close()
        col.close()
        addr.cleanup()
    rb = plans[0].ranks[0]
    plan_bytes = len(encode(plans[0]))
    result_bytes = len(encode(StepResult(step=0, dp_rank=0, seq_ids=rb.seq_ids, sampled_token_ids=rb.input_ids)))
    bare = bare_round_trip_us(min(steps, 3000), plan_bytes, result_bytes, local, warmup)
    return BenchResult(steps, bs, float(np.median(times) * 1e6), float(np.percentile(times, 99) * 1e6),
                       plan_bytes, result_bytes, bare, spin_us)


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


def bare_round_trip_us(steps: int, plan_bytes: int, result_bytes: int, local: bool, warmup: int) -> float:
    """Median us of a bare pyzmq PUB -> SUB -> PUSH -> PULL round trip, in another process."""
    addr = TransportAddresses.make(local=local, host_ip="127.0.0.1" if not local else "")
    ctx = zmq.Context.instance()
    pub, pull = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    pub.bind(addr.plan)
    pull.bind(addr.result)
    echo = mp.get_context("spawn").Process(target=_bare_echo, args=(addr.plan, addr.result, result_bytes), daemon=True)
    echo.start()
    try:
        deadline = time.monotonic() + 60
        while not pull.poll(10):  # the slow joiner: probe until the echo answers
            if time.monotonic() > deadline:
                raise TimeoutError("transport_bench: the bare echo process did not answer within 60 s")
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--tcp", action="store_true", help="tcp:// on 127.0.0.1 instead of ipc://")
    ap.add_argument("--spin-us", type=float, default=0.0, help="receivers poll this long before sleeping")
    ap.add_argument("--json", default="", help="also write the result here")
    args = ap.parse_args(argv)
    r = run_bench(args.steps, args.bs, local=not args.tcp, spin_us=args.spin_us)
    print(f"transport round trip ({'tcp' if args.tcp else 'ipc'}, spin {r.spin_us:g} us, bs={r.bs}, {r.plan_bytes} B plan, "
          f"{r.steps} steps): median {r.median_us:.1f} us, p99 {r.p99_us:.1f} us (target <= 100 us; "
          f"bare pyzmq round trip of the same sizes here: median {r.bare_median_us:.1f} us)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r.__dict__, f)


if __name__ == "__main__":
    main(sys.argv[1:])

"""`WorkerProcess`: one (DP rank, TP rank) in its own process. It joins the distributed world,
builds the `Worker`, answers the driver's control calls, then runs plans from ZeroMQ until the
shutdown plan.

Both executors run the same class, through the same method table (`CONTROL_CALLS`):
- `mp`: `mp_main` is the target of a spawned process; control calls arrive over a Pipe
  (`ControlCall` -> `ControlReply`), then the plan loop runs in the process's main thread.
- `ray`: the class is the actor body (`ray.remote(WorkerProcess)` in
  runtime/executors/ray_executor.py, with `under_ray=True`); the control calls are actor methods,
  the plan loop is one long actor call, and `ping` / `stop` answer beside it.

Control calls, in order: `node_info` (rank 0's answer is the rendezvous), `init_worker` (process
groups, model load), `determine_num_blocks`, `initialize(num_blocks)` (KV cache, capture: every
rank concurrently, so collectives match), then `run_plan_loop(addresses)`.

Hot path: `run_plan_loop`. What may live there: receive a plan, run it, push the result. A
pipelined plan (async scheduling) is launched and its result held until the next message: the
next plan is launched first (so the device never waits for this host), or a `Flush` asks for it.
A step with grammar-constrained rows samples on TP rank 0 once its `GrammarBitmask` arrives (after
the previous step's result is handed back: the driver fills the masks from it).
A rank whose step raises pushes a `StepResult` carrying the error (naming the rank) and leaves the loop.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from atomrt.distributed import parallel_state as ps
from atomrt.distributed.messages import Flush, GrammarBitmask, StepResult
from atomrt.distributed.net_utils import get_free_port, get_host_ip
from atomrt.distributed.transport import (
    PlanSubscriber,
    ResultPusher,
    TransportAddresses,
    TransportTimeout,
)
from atomrt.runtime.config import Config
from atomrt.runtime.envs import ENV
from atomrt.workers.runner.model_runner import resolve_device
from atomrt.workers.worker import PendingStep, Worker, WorkerInfo

logger = logging.getLogger(__name__)

IDLE_POLL_S = (
    1.0  # how often an idle plan loop checks whether it should stop (and stamps its progress)
)
DESTROY_TIMEOUT_S = 5.0  # the bound on destroy_process_group() at shutdown
CONTROL_CALLS = ("node_info", "init_worker", "determine_num_blocks", "initialize")


@dataclass(frozen=True)
class RankSpec:
    """Who a rank is. Global rank = dp_rank * tp_size + tp_rank (TP ranks of one DP rank are adjacent)."""

    dp_rank: int
    tp_rank: int
    dp_size: int
    tp_size: int

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size

    @property
    def name(self) -> str:
        return f"rank {self.rank} (dp {self.dp_rank}, tp {self.tp_rank})"


@dataclass(frozen=True)
class NodeInfo:
    """Where a rank runs: its node's address, a port free there now, its pid, node id, GPUs."""

    node_ip: str
    free_port: int
    pid: int
    node_id: str = ""
    gpu_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ControlCall:
    """mp driver -> rank over the control Pipe: call `WorkerProcess.<method>(*args)`."""

    method: str
    args: tuple = ()


@dataclass(frozen=True)
class ControlReply:
    """mp rank -> driver: the method's return value, or the error text (with traceback)."""

    value: Any = None
    error: Optional[str] = None


class WorkerProcess:
    """One rank's process state: the Worker, its process groups, and the plan loop."""

    def __init__(
        self,
        config: Config,
        spec: RankSpec,
        local_device: Optional[int] = None,
        under_ray: bool = False,
        stamp: Any = None,
    ) -> None:
        """`stamp` (mp): a shared double the process writes its last progress time to; the driver
        reads it (same node, same monotonic clock). Under Ray, `ping` reports the progress age."""
        self.config = config
        self._stamp = stamp
        self.last_progress = time.monotonic()
        self._in_loop = False
        self.spec = spec
        self.under_ray = under_ray
        self.gpu_ids: tuple[str, ...] = ()
        if under_ray:
            import ray

            # Ray sets CUDA_VISIBLE_DEVICES to the GPU it gave this actor: it is local device 0.
            self.gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
            local_device = 0 if self.gpu_ids else None
        self.local_device = local_device
        self.worker: Optional[Worker] = None
        self._distributed = False
        self._cpu_threads = (
            0  # CPU ranks: torch threads per rank (set in every thread that computes)
        )
        self._stop = threading.Event()

    # ---------------------------------------------------------------- control calls

    def node_info(self) -> NodeInfo:
        if self.under_ray:
            import ray

            ip, node_id = ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
        else:
            ip, node_id = get_host_ip(ENV.host_ip), ""
        return NodeInfo(ip, get_free_port(ip), os.getpid(), node_id, self.gpu_ids)

    def init_worker(self, master_addr: str, master_port: int) -> None:
        """Join the world (NCCL on GPU, gloo on CPU), then load the model on this rank's shard."""
        device = resolve_device(self.config, self.local_device)
        if device.type == "cpu":
            # every rank of this node shares its cores; oversubscription slows every collective
            self._cpu_threads = max(1, (os.cpu_count() or 1) // self.spec.world_size)
            torch.set_num_threads(self._cpu_threads)
        s = self.spec
        tp_group = dp_group = None
        if s.world_size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            ps.init_distributed(
                s.world_size,
                s.rank,
                s.dp_size,
                s.tp_size,
                master_addr,
                master_port,
                backend,
                timeout_s=self.config.parallel_config.worker_timeout_s,
            )
            self._distributed = True
            tp_group = ps.get_tp_group().group
            dp_group = ps.get_dp_group().group if s.dp_size > 1 else None
        self.worker = Worker(
            self.config,
            s.dp_rank,
            s.tp_rank,
            self.local_device,
            tp_group,
            progress=self.progress,
            dp_group=dp_group,
        )

    def determine_num_blocks(self) -> int:
        self._bind_device()
        return self.worker.determine_num_blocks()

    def initialize(self, num_blocks: int) -> WorkerInfo:
        self._bind_device()
        return self.worker.initialize(num_blocks)

    def ping(self) -> float:
        """Ray's health check, answered beside the plan loop: seconds since the loop last made
        progress (0 before the loop runs)."""
        return time.monotonic() - self.last_progress if self._in_loop else 0.0

    def progress(self) -> None:
        """The step loop is making progress (idle polls, steps, waits on the device)."""
        self.last_progress = now = time.monotonic()
        if self._stamp is not None:
            self._stamp.value = now

    def stop(self) -> None:
        """Leave the plan loop at its next idle poll (when the driver cannot publish a shutdown plan)."""
        self._stop.set()

    def _bind_device(self) -> None:
        """The current CUDA device and the OpenMP thread count are per thread; a Ray actor serves its
        calls from a thread pool (and Ray sets OMP_NUM_THREADS=1 for the process)."""
        device = self.worker.runner.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif self._cpu_threads:
            torch.set_num_threads(self._cpu_threads)

    # ---------------------------------------------------------------- the plan loop

    def run_plan_loop(
        self, addresses: dict[str, str], keep_going: Optional[Callable[[], bool]] = None
    ) -> None:
        """Receive plans until the shutdown plan (or `keep_going()` turns false while idle); then
        leave the process groups."""
        keep_going = keep_going or (lambda: not self._stop.is_set())
        self.progress()
        self._in_loop = True
        self._bind_device()
        addr = TransportAddresses.from_dict(addresses)
        spin_s = self.config.parallel_config.resolved_spin_s(self.worker.runner.device.type)
        grammar_rank = self.spec.dp_rank if self.spec.tp_rank == 0 else None  # the sampling worker
        sub = PlanSubscriber(addr, self.spec.rank, spin_s=spin_s, grammar_dp_rank=grammar_rank)
        pusher = ResultPusher(addr, self.spec.dp_rank)  # TP ranks != 0 push only their errors
        try:
            self._serve(sub, pusher, keep_going)
        finally:
            sub.close()
            pusher.close()
            self.close()

    def _serve(
        self, sub: PlanSubscriber, pusher: ResultPusher, keep_going: Callable[[], bool]
    ) -> None:
        pending: Optional[PendingStep] = None  # a pipelined step launched and not handed back yet
        held: Any = None  # a message that came while a step waited for its grammar masks

        def hand_back(launched: PendingStep) -> None:
            result = self.worker.finish(launched)
            if result is not None:
                pusher.push(result)

        while True:
            self.progress()
            step = sub.expected_step
            try:
                msg, held = (held, None) if held is not None else (sub.recv(IDLE_POLL_S), None)
                self.progress()  # a plan arrived: a rank then blocked on a stuck peer is not the first stopped
                if isinstance(msg, GrammarBitmask):
                    raise RuntimeError(f"grammar masks of step {msg.step}, but no step waits")
                if isinstance(msg, Flush):
                    if pending is None or pending.step != msg.step:
                        raise RuntimeError(
                            f"flush of step {msg.step}, but the step held is {pending and pending.step}"
                        )
                    hand_back(pending)
                    pending = None
                    continue
                if msg.shutdown:
                    logger.debug("%s: shutdown plan at step %d", self.spec.name, msg.step)
                    return
                launched = self.worker.launch(msg)
                if pending is not None:
                    hand_back(pending)
                    pending = None
                if launched.awaits_grammar:
                    held = self._await_grammar(sub, launched, keep_going)
                if msg.pipelined:
                    pending = launched
                else:
                    hand_back(launched)
            except TransportTimeout:
                if not keep_going():
                    logger.warning("%s: leaving the plan loop: the driver is gone", self.spec.name)
                    return
            except Exception as e:
                text = f"{self.spec.name} failed at step {step}: {type(e).__name__}: {e}"
                logger.error("%s\n%s", text, traceback.format_exc())
                pusher.push(StepResult(step=step, dp_rank=self.spec.dp_rank, error=text))
                raise

    def _await_grammar(
        self, sub: PlanSubscriber, launched: PendingStep, keep_going: Callable[[], bool]
    ) -> Any:
        """Receive the launched step's grammar masks and sample it. Another message first means the
        driver discarded the step: it samples unconstrained (its result is dropped) and that
        message is returned for the loop to handle."""
        while True:
            try:
                msg = sub.recv(timeout=IDLE_POLL_S)
            except TransportTimeout:
                if not keep_going():
                    raise RuntimeError(
                        f"step {launched.step}: the driver went away while the step waited for "
                        "its grammar masks"
                    ) from None
                self.progress()
                continue
            if isinstance(msg, GrammarBitmask) and msg.step == launched.step:
                self.worker.apply_grammar(msg)
                return None
            self.worker.apply_grammar(None)
            return msg

    def close(self, timeout_s: float = DESTROY_TIMEOUT_S) -> None:
        """Leave the process groups; never waits longer than `timeout_s` on destroy_process_group()."""
        self.worker = None
        if self._distributed:
            self._distributed = False
            ps.destroy_distributed(timeout_s)


# --------------------------------------------------------------------------------------------- mp


def mp_main(
    conn: Any, config: Config, spec: RankSpec, local_device: Optional[int], heartbeat: Any
) -> None:
    """Target of one spawned rank process: control calls over `conn`, then the plan loop."""
    parent = os.getppid()

    def parent_alive() -> bool:
        return os.getppid() == parent

    process = WorkerProcess(config, spec, local_device, stamp=heartbeat)
    try:
        while parent_alive():
            if not conn.poll(IDLE_POLL_S):
                continue
            call: ControlCall = conn.recv()
            if call.method == "run_plan_loop":
                conn.send(ControlReply())
                process.run_plan_loop(*call.args, keep_going=parent_alive)
                return
            if call.method not in CONTROL_CALLS:
                conn.send(ControlReply(error=f"{spec.name}: unknown control call {call.method!r}"))
                continue
            try:
                value = getattr(process, call.method)(*call.args)
            except Exception as e:
                conn.send(ControlReply(error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
                continue
            process.progress()  # the driver reads heartbeats from the plan loop's start on
            conn.send(ControlReply(value=value))
    except (EOFError, OSError):
        logger.warning("%s: the driver closed the control pipe; exiting", spec.name)
    finally:
        process.close()

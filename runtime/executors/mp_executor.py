"""`MPExecutor`: one spawned local process per (DP, TP) rank, running workers/process.py.

Control calls (rendezvous, load, KV sizing, capture) go over one Pipe per rank, each wait bounded
by `parallel_config.worker_timeout_s` and watching the process's sentinel, so a rank that dies
during start-up is named at once. Steps go over ZeroMQ ipc:// (runtime/executors/channel.py). Liveness
during steps: `Process.is_alive()` and the progress stamp each rank's plan loop writes to shared memory
(a hung but live process stops stamping).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import signal
import time
from collections.abc import Sequence
from typing import Any, Optional

from atomrt.runtime.config import Config
from atomrt.runtime.executors.base import WorkerError
from atomrt.runtime.executors.channel import PHASES, ChannelExecutor, StepChannel, gather_infos
from atomrt.workers.process import DESTROY_TIMEOUT_S, ControlCall, ControlReply, mp_main

logger = logging.getLogger(__name__)

_KILL_WAIT_S = 2.0  # terminate -> kill: how long each signal gets


class MPExecutor(ChannelExecutor):
    kind = "mp"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.heartbeats: list[Any] = []

    @property
    def worker_pids(self) -> dict[int, int]:
        """Global rank -> pid of its process."""
        return {s.rank: p.pid for s, p in zip(self.specs, self.procs)}

    # ------------------------------------------------------------------------------- start-up

    def start(self) -> Any:
        # multiprocessing joins non-daemon children at interpreter exit, and a rank waits for plans
        # until its parent is gone: without this hook, an exit without shutdown() would hang.
        atexit.register(self.shutdown)
        return super().start()

    def _start(self) -> Any:
        pc = self.config.parallel_config
        ctx = multiprocessing.get_context("spawn")
        devices = self._local_devices()
        for spec, device in zip(self.specs, devices):
            parent, child = ctx.Pipe()
            stamp = ctx.Value("d", time.monotonic(), lock=False)
            proc = ctx.Process(
                target=mp_main,
                args=(child, self.config, spec, device, stamp),
                name=f"atomrt-rank{spec.rank}",
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
            self.heartbeats.append(stamp)
        n = len(self.specs)
        rendezvous = self._call_all("node_info", [()] * n, pc.worker_timeout_s)[0]
        self._call_all(
            "init_worker", [("127.0.0.1", rendezvous.free_port)] * n, pc.worker_timeout_s
        )
        num_blocks = min(self._call_all("determine_num_blocks", [()] * n, pc.compile_timeout_s))
        infos = self._call_all("initialize", [(num_blocks,)] * n, pc.capture_timeout_s)
        spin_s = pc.resolved_spin_s("cpu" if devices[0] is None else "cuda")
        self.channel = StepChannel(
            len(self.specs), pc.data_parallel_size, local=True, spin_s=spin_s
        )
        self._call_all(
            "run_plan_loop", [(self.channel.addresses.to_dict(),)] * n, pc.worker_timeout_s
        )
        self.channel.handshake(pc.worker_timeout_s, self._check_alive)
        logger.info("mp executor: %d ranks up, %d KV blocks each", len(self.specs), num_blocks)
        return gather_infos(infos)

    def _local_devices(self) -> list[Optional[int]]:
        import torch

        if self.config.device == "cpu" or (
            self.config.device == "auto" and not torch.cuda.is_available()
        ):
            return [None] * len(self.specs)
        if torch.cuda.device_count() < len(self.specs):
            raise ValueError(
                f"executor 'mp' puts every rank on this node: {len(self.specs)} ranks need {len(self.specs)} GPUs, "
                f"{torch.cuda.device_count()} visible; lower tensor/data_parallel_size or use executor 'ray'"
            )
        return [s.rank for s in self.specs]

    def _call_all(self, method: str, args: Sequence[tuple], timeout: float) -> list[Any]:
        """Call `method` on every rank at once; each rank's answer, in rank order (a wait bounded by
        `timeout`, with a progress line for the long phases)."""
        phase = PHASES.get(method)
        if phase is not None:
            logger.info(
                "mp executor: %s on %d ranks (limit %.0f s, parallel_config.%s)",
                phase[0],
                len(self.specs),
                timeout,
                phase[1],
            )
        for conn, a in zip(self.conns, args):
            conn.send(ControlCall(method, tuple(a)))
        deadline = time.monotonic() + timeout
        answers: dict[int, Any] = {}
        while len(answers) < len(self.specs):
            waiting = {i: c for i, c in enumerate(self.conns) if i not in answers}
            sentinels = {self.procs[i].sentinel: i for i in waiting}
            ready = multiprocessing.connection.wait(
                list(waiting.values()) + list(sentinels),
                timeout=max(0.0, deadline - time.monotonic()),
            )
            if not ready:
                names = ", ".join(self.specs[i].name for i in waiting)
                knob = (phase or ("", "worker_timeout_s"))[1]
                raise WorkerError(
                    f"{method}: no answer within {timeout:.0f} s from {names} (parallel_config.{knob})"
                )
            for obj in ready:
                if obj in sentinels:
                    i = sentinels[obj]
                    if i not in answers and not self.conns[i].poll(0):  # exited without answering
                        raise WorkerError(f"{self.specs[i].name}: {method}: {self._exit_text(i)}")
                    continue
                i = self.conns.index(obj)
                reply: ControlReply = self.conns[i].recv()
                if reply.error is not None:
                    raise WorkerError(f"{self.specs[i].name}: {method} failed: {reply.error}")
                answers[i] = reply.value
        return [answers[i] for i in range(len(self.specs))]

    # ---------------------------------------------------------------------------------- steps

    def _check_alive(self) -> None:
        """Raise WorkerError naming a rank whose process exited or whose step loop stopped making
        progress. When several stopped (a rank blocked in a collective waits for a stuck peer),
        the one that stopped first is named."""
        hb_timeout = self.config.parallel_config.heartbeat_timeout_s
        now = time.monotonic()
        stuck = []
        for i, (spec, proc) in enumerate(zip(self.specs, self.procs)):
            if not proc.is_alive():
                raise WorkerError(f"{spec.name}: {self._exit_text(i)}")
            age = now - self.heartbeats[i].value
            if age > hb_timeout:
                stuck.append((age, i))
        if stuck:
            age, i = max(stuck)
            raise WorkerError(
                f"{self.specs[i].name}: process {self.procs[i].pid} is alive but its step loop made no progress "
                f"for {age:.1f} s, a missed heartbeat (parallel_config.heartbeat_timeout_s={hb_timeout})"
            )

    def _exit_text(self, i: int) -> str:
        proc = self.procs[i]
        proc.join(0.5)
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        return f"worker process {proc.pid} {how}"

    # ------------------------------------------------------------------------------- shutdown

    def _stop(self, graceful: bool) -> None:
        """Shutdown plan (graceful), then terminate and kill: bounded, and idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if graceful and self.channel is not None:
            try:
                self.channel.publish_shutdown()
            except Exception as e:  # sockets already gone: fall through to terminate
                logger.warning("mp executor: could not publish the shutdown plan: %s", e)
            deadline = time.monotonic() + DESTROY_TIMEOUT_S + 2.0
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for stop in ("terminate", "kill"):
            alive = [p for p in self.procs if p.is_alive()]
            for proc in alive:
                getattr(proc, stop)()
            for proc in alive:
                proc.join(_KILL_WAIT_S)
        left = [p.pid for p in self.procs if p.is_alive()]
        if left:
            logger.error("mp executor: worker processes %s survived SIGKILL", left)
        for conn in self.conns:
            conn.close()
        if self.channel is not None:
            self.channel.close()

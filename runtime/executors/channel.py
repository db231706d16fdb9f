"""The driver's side of the per-step hot path, shared by the `mp` and `ray` executors
(`StepChannel`), and their common base class (`ChannelExecutor`).

Hot path: `StepChannel.publish` (one plan on the ZeroMQ PUB) and `StepChannel.collect` (one
`StepResult` per DP rank from the PULL). What may live here: the publish, a bounded poll loop, and a
call to the executor's liveness check when no result has arrived for `LIVENESS_POLL_S` (never a
Ray call per step).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Optional

from atomrt.distributed.messages import GrammarBitmask, StepPlan, StepResult
from atomrt.distributed.transport import (
    PlanPublisher,
    ResultCollector,
    TransportAddresses,
    TransportTimeout,
)
from atomrt.runtime.config import Config
from atomrt.runtime.executors.base import Executor, WorkerError
from atomrt.workers.process import RankSpec
from atomrt.workers.worker import WorkerInfo

logger = logging.getLogger(__name__)

LIVENESS_POLL_S = 0.5  # no result for this long: check that every rank is still alive
_DEATH_GRACE_S = 2.0  # after a rank reports an error, how long to look for a peer that died
# Start-up control calls that take long: what the progress line calls them, and the knob bounding them.
PHASES = {
    "init_worker": ("loading the model", "worker_timeout_s"),
    "determine_num_blocks": ("KV sizing (compiles at levels 1-3)", "compile_timeout_s"),
    "initialize": ("KV cache and CUDA-graph capture", "capture_timeout_s"),
}


def gather_infos(infos: list[WorkerInfo]) -> WorkerInfo:
    """Rank 0's start-up answer, carrying every rank's compile report (ranks in order), and only
    the whole-step TR_HYBRID buckets every rank joined (a step's decision is every rank's)."""
    joined = set(infos[0].token_req_keys)
    for info in infos[1:]:
        joined &= set(info.token_req_keys)
    return dataclasses.replace(
        infos[0],
        compile_reports=tuple(r for info in infos for r in info.compile_reports),
        token_req_keys=tuple(sorted(joined)),
    )


class StepChannel:
    """Driver PUB (plans) + PULL (ready, results) for one engine instance.

    `check_alive()` is the executor's liveness check: it raises `WorkerError` naming a rank that
    died or stopped answering, and returns otherwise.
    """

    def __init__(
        self, world_size: int, dp_size: int, local: bool, host_ip: str = "", spin_s: float = 0.0
    ) -> None:
        self.dp_size = dp_size
        self.addresses = TransportAddresses.make(local, host_ip)
        self.publisher = PlanPublisher(self.addresses, world_size)
        self.collector = ResultCollector(self.addresses, spin_s)
        self.ready = False

    def handshake(self, timeout_s: float, check_alive: Callable[[], None]) -> dict[int, int]:
        """Wait until every rank's SUB receives plans; returns rank -> pid."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pids = self.publisher.wait_ready(
                    min(LIVENESS_POLL_S, max(0.0, deadline - time.monotonic()))
                )
                self.ready = True
                return pids
            except TransportTimeout as e:
                check_alive()
                if time.monotonic() >= deadline:
                    raise WorkerError(
                        f"start-up: transport handshake timed out after {timeout_s:.0f} s: {e}"
                    ) from e

    def publish(self, plan: StepPlan) -> None:
        self.publisher.publish(plan)

    def publish_grammar(self, masks: GrammarBitmask) -> None:
        self.publisher.publish_grammar(masks)

    def flush(self, step: int) -> None:
        """Ask for pipelined step `step`'s results now (no plan follows it yet)."""
        self.publisher.publish_flush(step)

    def collect(
        self, step: int, timeout_s: float, check_alive: Callable[[], None]
    ) -> list[StepResult]:
        """One result of step `step` per DP rank, in DP order. A dead or failed rank raises WorkerError."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, StepResult] = {}
        while len(got) < self.dp_size:
            try:
                res = self.collector.recv(LIVENESS_POLL_S)
            except TransportTimeout:
                try:
                    check_alive()
                except WorkerError as e:  # say which step the ranks stopped in
                    raise WorkerError(f"step {step}: {e}") from None
                if time.monotonic() >= deadline:
                    missing = sorted(set(range(self.dp_size)) - set(got))
                    raise WorkerError(
                        f"step {step}: no result from DP ranks {missing} within {timeout_s:.0f} s "
                        "(parallel_config.worker_timeout_s) though every rank is alive"
                    ) from None
                continue
            if res.error is not None:
                self._blame_dead_peer(check_alive, res.error)
                raise WorkerError(res.error)
            if res.step < step:  # a step the engine discarded: its result comes late
                logger.debug(
                    "dropping DP rank %d's result of discarded step %d", res.dp_rank, res.step
                )
                continue
            if res.step != step:
                raise WorkerError(
                    f"step {step}: DP rank {res.dp_rank} answered for step {res.step}"
                )
            got[res.dp_rank] = res
        return [got[i] for i in range(self.dp_size)]

    def _blame_dead_peer(self, check_alive: Callable[[], None], error: str) -> None:
        """A rank's collective fails when its peer dies: name the dead peer if there is one."""
        deadline = time.monotonic() + _DEATH_GRACE_S
        while True:
            try:
                check_alive()
            except WorkerError as e:
                raise WorkerError(f"{e} (then: {error})") from None
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def publish_shutdown(self) -> None:
        """The shutdown plan: every rank leaves its loop and its process groups."""
        if self.ready:
            self.publisher.publish(StepPlan(step=self.publisher.next_step, shutdown=True))

    def close(self) -> None:
        self.publisher.close()
        self.collector.close()
        self.addresses.cleanup()


class ChannelExecutor(Executor):
    """An executor whose ranks run in other processes and step over a `StepChannel`.

    Subclasses launch the ranks (`_start`, which sets `self.channel`), check them without blocking
    (`_check_alive`, called when no result arrived for a while) and stop them (`_stop`, bounded
    and idempotent). A failure during a step stops every rank; the executor then refuses steps.
    """

    kind = "channel"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        pc = config.parallel_config
        self.specs = [
            RankSpec(d, t, pc.data_parallel_size, pc.tensor_parallel_size)
            for d in range(pc.data_parallel_size)
            for t in range(pc.tensor_parallel_size)
        ]
        self.channel: Optional[StepChannel] = None
        self._failure: Optional[str] = None
        self._closed = False

    def start(self) -> Any:
        try:
            return self._start()
        except BaseException:
            self._stop(graceful=False)
            raise

    def submit(self, plan: StepPlan) -> None:
        self._channel().publish(plan)

    def send_grammar(self, masks: list[GrammarBitmask]) -> None:
        channel = self._channel()
        for m in masks:
            channel.publish_grammar(m)

    def collect(self, step: int, flush: bool) -> list[StepResult]:
        channel = self._channel()
        try:
            if flush:
                channel.flush(step)
            results = channel.collect(
                step, self.config.parallel_config.worker_timeout_s, self._check_alive
            )
        except WorkerError as e:
            self._failure = str(e)
            self._stop(graceful=False)
            raise
        self._record_probes(results)
        return results

    def _channel(self) -> StepChannel:
        if self._failure is not None or self.channel is None:
            raise WorkerError(f"{self.kind} executor is stopped: {self._failure or 'not started'}")
        return self.channel

    def shutdown(self) -> None:
        self._stop(graceful=self._failure is None)

    @abc.abstractmethod
    def _start(self) -> Any:
        """Launch every rank, size the KV cache, capture, open the channel; return a WorkerInfo."""

    @abc.abstractmethod
    def _check_alive(self) -> None:
        """Raise WorkerError naming a rank that died or stopped answering; never block."""

    @abc.abstractmethod
    def _stop(self, graceful: bool) -> None:
        """Stop every rank: bounded, idempotent."""

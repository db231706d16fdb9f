"""Executors: how the driver reaches its workers. One interface, three implementations.

- `inproc`: one Worker in the driver's process (TP = DP = 1); plans are passed as objects.
- `mp`: spawned local processes running the same worker loop (runtime/executors/mp_executor.py).
- `ray`: one Ray actor per (DP, TP) rank in a placement group (runtime/executors/ray_executor.py).
Start-up (`start`) is control-plane work; `submit` and `collect` are the per-step hot path. A step
is submitted, then its results collected; under async scheduling the engine submits step N+1 before
it collects step N, and asks for a flush when it collects a pipelined step with nothing submitted
after it.
"""

from __future__ import annotations

import abc
import logging
from collections import deque
from typing import TYPE_CHECKING

from atomrt.distributed.messages import StepPlan, StepResult
from atomrt.runtime.config import Config

if TYPE_CHECKING:
    from atomrt.workers.worker import WorkerInfo

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker failed or stopped answering; the message names the rank and the phase."""


class Executor(abc.ABC):
    def __init__(self, config: Config) -> None:
        self.config = config

    @abc.abstractmethod
    def start(self) -> "WorkerInfo":
        """Launch workers, load the model, size the KV cache (the group's minimum), capture graphs."""

    @abc.abstractmethod
    def submit(self, plan: StepPlan) -> None:
        """Start one step on every worker; its results come from `collect`."""

    @abc.abstractmethod
    def collect(self, step: int, flush: bool) -> list[StepResult]:
        """The results of submitted step `step` (the oldest not collected): one StepResult per DP
        rank, in DP-rank order. `flush`: the step was pipelined and no plan was submitted after it."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; never blocks without a bound."""


class InProcExecutor(Executor):
    def start(self) -> "WorkerInfo":
        from atomrt.workers.worker import Worker

        pc = self.config.parallel_config
        if pc.world_size != 1:
            raise ValueError(
                "parallel_config.executor='inproc' runs one worker; use executor 'mp' or 'ray' for "
                f"tensor_parallel_size={pc.tensor_parallel_size}, data_parallel_size={pc.data_parallel_size}"
            )
        self.worker = Worker(self.config)
        self._submitted: deque = deque()  # PendingSteps not collected yet
        return self.worker.initialize(self.worker.determine_num_blocks())

    def submit(self, plan: StepPlan) -> None:
        self._submitted.append(self.worker.launch(plan))

    def collect(self, step: int, flush: bool) -> list[StepResult]:
        pending = self._submitted.popleft()
        if pending.step != step:
            raise RuntimeError(f"inproc executor: collecting step {step}, but the oldest submitted step is {pending.step}")
        result = self.worker.finish(pending)
        assert result is not None
        return [result]

    def shutdown(self) -> None:
        self.worker = None


def make_executor(config: Config) -> Executor:
    kind = config.parallel_config.executor
    if kind == "inproc":
        return InProcExecutor(config)
    if kind == "mp":
        from atomrt.runtime.executors.mp_executor import MPExecutor

        return MPExecutor(config)
    from atomrt.runtime.executors.ray_executor import RayExecutor

    pc = config.parallel_config
    return RayExecutor(config, placement_strategy=pc.placement_strategy, transport=pc.transport)

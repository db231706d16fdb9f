"""`InProcExecutor`: one Worker in the driver's process (TP = DP = 1); plans are passed as objects."""

from __future__ import annotations

import logging
import time
from collections import deque

from atomrt.distributed.messages import GrammarBitmask, StepPlan, StepResult
from atomrt.runtime.executors.base import Executor, WorkerError
from atomrt.workers.runner.readback import DeviceTimeout
from atomrt.workers.worker import Worker, WorkerInfo

logger = logging.getLogger(__name__)


class InProcExecutor(Executor):
    def start(self) -> WorkerInfo:
        pc = self.config.parallel_config
        if pc.world_size != 1:
            raise ValueError(
                "parallel_config.executor='inproc' runs one worker; use executor 'mp' or 'ray' for "
                f"tensor_parallel_size={pc.tensor_parallel_size}, data_parallel_size={pc.data_parallel_size}"
            )
        self._submitted: deque = deque()  # PendingSteps not collected yet
        t0 = time.monotonic()
        logger.info("inproc executor: loading the model")
        self.worker = Worker(self.config)
        t1 = time.monotonic()
        logger.info(
            "inproc executor: loaded in %.1f s; KV sizing (compiles at levels 1-3)", t1 - t0
        )
        num_blocks = self.worker.determine_num_blocks()
        t2 = time.monotonic()
        logger.info(
            "inproc executor: %d KV blocks, sized in %.1f s; KV cache and CUDA-graph capture",
            num_blocks,
            t2 - t1,
        )
        info = self.worker.initialize(num_blocks)
        logger.info("inproc executor: up in %.1f s", time.monotonic() - t0)
        return info

    def submit(self, plan: StepPlan) -> None:
        self._submitted.append(self.worker.launch(plan))

    def send_grammar(self, masks: list[GrammarBitmask]) -> None:
        for m in masks:
            self.worker.apply_grammar(m)

    def collect(self, step: int, flush: bool) -> list[StepResult]:
        pending = self._submitted.popleft()
        if pending.step != step:
            raise RuntimeError(
                f"inproc executor: collecting step {step}, but the oldest submitted step is {pending.step}"
            )
        try:
            result = self.worker.finish(pending)
        except DeviceTimeout as e:  # a hung device is not a step to retry
            raise WorkerError(str(e)) from e
        assert result is not None
        self._record_probes([result])
        return [result]

    def discard_in_flight(self) -> None:
        self._submitted.clear()

    def shutdown(self) -> None:
        self.worker = None

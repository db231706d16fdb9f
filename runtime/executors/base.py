"""Executors: how the driver reaches its workers. One interface, three implementations.

- `inproc`: one Worker in the driver's process (TP = DP = 1); plans are passed as objects
  (runtime/executors/inproc.py).
- `mp`: spawned local processes running the same worker loop (runtime/executors/mp_executor.py).
- `ray`: one Ray actor per (DP, TP) rank in a placement group (runtime/executors/ray_executor.py).
`make_executor` (runtime/executors/factory.py) picks one from `parallel_config.executor`.
Start-up (`start`) is control-plane work; `submit` and `collect` are the per-step hot path. A step
is submitted, then its results collected; under async scheduling the engine submits step N+1 before
it collects step N, and asks for a flush when it collects a pipelined step with nothing submitted
after it.
"""

from __future__ import annotations

import abc
import logging

from atomrt.distributed.messages import GrammarBitmask, StepPlan, StepResult
from atomrt.runtime.config import Config
from atomrt.workers.worker import WorkerInfo

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker failed or stopped answering; the message names the rank and the phase."""


class Executor(abc.ABC):
    def __init__(self, config: Config) -> None:
        self.config = config

    @abc.abstractmethod
    def start(self) -> WorkerInfo:
        """Launch workers, load the model, size the KV cache (the group's minimum), capture graphs."""

    @abc.abstractmethod
    def submit(self, plan: StepPlan) -> None:
        """Start one step on every worker; its results come from `collect`."""

    @abc.abstractmethod
    def send_grammar(self, masks: list[GrammarBitmask]) -> None:
        """The grammar masks of submitted steps' constrained rows (`RankBatch.grammar_rows`), one
        message per DP rank, each for that rank's sampling worker; a step's masks are sent before
        the next step is submitted."""

    @abc.abstractmethod
    def collect(self, step: int, flush: bool) -> list[StepResult]:
        """The results of submitted step `step` (the oldest not collected): one StepResult per DP
        rank, in DP-rank order. `flush`: the step was pipelined and no plan was submitted after it."""

    def discard_in_flight(self) -> None:
        """Forget every step submitted and not collected (the engine discarded them); results that
        still arrive for them are dropped. The next plan carries `RankBatch.reset`."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; never blocks without a bound."""

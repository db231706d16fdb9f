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
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import numpy as np

from atomrt.distributed.messages import GrammarBitmask, StepPlan, StepResult
from atomrt.runtime.config import Config
from atomrt.workers.probes import check_probe
from atomrt.workers.worker import WorkerInfo

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker failed or stopped answering; the message names the rank and the phase."""


class ProbeCounts:
    """What an open probe counted (workers/probes.py): per probed step and busy DP rank, the array
    its sampling worker sent, in the order the results were collected."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.arrays: list[np.ndarray] = []

    def mean_touched(self) -> tuple[float, ...]:
        """`experts_touched`: per MoE layer, the mean number of distinct experts a counted call
        selected (() for a model without MoE layers)."""
        if self.arrays and all(a.shape[1] == 0 for a in self.arrays):
            return ()  # steps were counted, and the model has no MoE layer
        rows = [a for a in self.arrays if a.shape[0]]
        if not rows:
            raise ValueError(f"probe {self.name!r}: no step was counted")
        return tuple(float(m) for m in np.concatenate(rows).mean(axis=0))


class Executor(abc.ABC):
    def __init__(self, config: Config) -> None:
        self.config = config
        self._probe: Optional[ProbeCounts] = None

    @property
    def probing(self) -> str:
        """The open probe's name, which the engine's plans carry ("" for none)."""
        return "" if self._probe is None else self._probe.name

    @contextmanager
    def probe(self, name: str) -> Iterator[ProbeCounts]:
        """Count probe `name` (workers/probes.py) over the steps planned inside; the steps run
        eagerly. What each collected step counted lands in the yielded `ProbeCounts`."""
        check_probe(name)
        if self._probe is not None:
            raise RuntimeError(f"probe {name!r}: probe {self._probe.name!r} is already open")
        self._probe = counts = ProbeCounts(name)
        try:
            yield counts
        finally:
            self._probe = None

    def _record_probes(self, results: list[StepResult]) -> None:
        """Keep what collected results' probes counted (the open probe's)."""
        if self._probe is not None:
            self._probe.arrays.extend(r.probe for r in results if r.probe is not None)

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

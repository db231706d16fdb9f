"""What the engine counts about its steps: `EngineStats`, for metrics and benchmarks."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.runtime.driver.speculation import SpecDecodeStats

logger = logging.getLogger("atomrt.runtime.driver.engine")  # the engine's lines, as before


@dataclass
class EngineStats:
    """Counters since start (for metrics): steps by kind, and rows run beyond the real ones
    (padding to a graph bucket, and under data parallelism to the group's row count: an idle
    DP rank's whole dummy batch counts as padding); with speculative decoding, drafts and
    acceptance (`spec_decode`)."""

    steps: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in ForwardKind})
    padded_tokens: int = 0
    real_tokens: int = 0  # rows of scheduled work, over every DP rank
    dummy_batches: int = 0  # (step, DP rank) pairs that ran an idle rank's dummy batch
    split_steps: int = 0  # steps run as two microbatches (two-batch overlap)
    spec_decode: Optional[SpecDecodeStats] = None

    def count(self, decision: ForwardDecision) -> int:
        """Count one step; returns its padded rows."""
        self.steps[decision.kind.value] += 1
        self.split_steps += decision.ubatch_rows is not None
        padded = sum(decision.dp_padded_tokens) - sum(decision.dp_num_tokens)
        self.padded_tokens += padded
        self.real_tokens += sum(decision.dp_num_tokens)
        if len(decision.dp_num_tokens) > 1:
            self.dummy_batches += sum(1 for n in decision.dp_num_tokens if n == 0)
        return padded

    @property
    def pad_fraction(self) -> float:
        """Padded rows over all rows run (0 when nothing ran)."""
        total = self.padded_tokens + self.real_tokens
        return self.padded_tokens / total if total else 0.0


def log_startup(seconds: float, phases: tuple[tuple[str, float], ...]) -> None:
    """One line: the executor's start-up and, phase by phase, rank 0's share of it (the rest is
    processes, actors and the groups coming up)."""
    parts = ", ".join(f"{name} {s:.2f} s" for name, s in phases)
    logger.info(
        "workers up in %.2f s; rank 0: %s; other (processes, groups) %.2f s",
        seconds,
        parts or "no phases reported",
        seconds - sum(s for _, s in phases),
    )


def log_summary(stats: EngineStats, num_ranks: int, admission: Any) -> None:
    """At shutdown: the rows data parallelism ran beyond the real ones, and the admission rules'
    holds (`runtime/driver/admission.py`), where they ran."""
    if num_ranks > 1 and stats.real_tokens:
        logger.info(
            "data parallel: %d rows run beyond %d real ones (%.1f%% padding), %d dummy "
            "batches on idle ranks, %d prefill holds",
            stats.padded_tokens,
            stats.real_tokens,
            100 * stats.pad_fraction,
            stats.dummy_batches,
            admission.aligner.num_held_steps if admission.aligner else 0,
        )
    if admission.delay is not None:
        logger.info(
            "scheduler_config.delay_factor held new prompts back in %d (step, rank) pairs",
            admission.delay.num_held_steps,
        )

"""What the engine counts about its steps: `EngineStats`, for metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.runtime.driver.speculation import SpecDecodeStats


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

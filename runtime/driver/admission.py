"""`Admission`: which DP ranks may admit waiting prompts this step, under the optional rules of
`scheduler_config`; every rank when none is on.

- `dp_prefill_align` (runtime/driver/dp_align.py): hold a lone prefill on one DP rank for a few
  steps so prefills of several ranks share one padded step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from atomrt.runtime.driver.dp_align import PrefillAligner, _RankQueue


class Admission:
    def __init__(self, dp_prefill_align: int, dp_size: int) -> None:
        self.aligner: Optional[PrefillAligner] = (
            PrefillAligner(dp_prefill_align, dp_size) if dp_prefill_align and dp_size > 1 else None
        )

    @property
    def num_held_steps(self) -> int:
        """(step, rank) pairs some rule held prompts back, since start."""
        return self.aligner.num_held_steps if self.aligner is not None else 0

    def admits(self, ranks: Sequence[_RankQueue]) -> list[bool]:
        if self.aligner is not None:
            return self.aligner.admits(ranks)
        return [True] * len(ranks)

    def observe(self, outs: Sequence[Any]) -> None:
        """The step just scheduled: `outs` are its SchedulerOutputs, one per rank."""

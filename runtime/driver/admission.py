"""`Admission`: which DP ranks may admit waiting prompts this step, under the optional rules of
`scheduler_config`; every rank when none is on.

- `dp_prefill_align` (runtime/driver/dp_align.py): hold a lone prefill on one DP rank for a few
  steps so prefills of several ranks share one padded step.
- `delay_factor` (`--scheduler-delay-factor`, vLLM's name and meaning), `PrefillDelay` below: while
  sequences are running, hold new prompts until the oldest has waited `delay_factor` times the
  latency of the last step that ran prompts. Prompts that arrive in a burst (a wave of clients
  sending together, each request a few hundred microseconds after the last) then prefill in one
  step instead of being split over several small ones, each of which costs the host a whole step.
  Nothing is held when nothing runs (the step would be the prompts' alone), so an idle engine
  starts a request at once. Off (0) by default: it trades time to first token for fewer, larger
  prefill steps; `atomrt bench serve --scheduler-delay-factor F` measures whether that pays.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from atomrt.runtime.driver.dp_align import PrefillAligner, _RankQueue


class PrefillDelay:
    def __init__(self, delay_factor: float) -> None:
        assert delay_factor > 0
        self.delay_factor = delay_factor
        self.last_prompt_latency = 0.0  # s: from scheduling a step with prompts to the next
        self._prompt_step_at: Optional[float] = None
        self.num_held_steps = 0  # (step, rank) holds since start, for the stats

    def admits(self, ranks: Sequence[_RankQueue], now: float) -> list[bool]:
        if self._prompt_step_at is not None:
            self.last_prompt_latency = now - self._prompt_step_at
            self._prompt_step_at = None
        admit = []
        for rank in ranks:
            held = bool(
                rank.waiting
                and rank.running
                and now - min(s.arrival_time for s in rank.waiting)
                < self.delay_factor * self.last_prompt_latency
            )
            self.num_held_steps += held
            admit.append(not held)
        return admit

    def observe(self, outs: Sequence[Any], now: float) -> None:
        """The step just scheduled: `outs` are its SchedulerOutputs, one per rank."""
        if any(out.is_prefill for out in outs):
            self._prompt_step_at = now


class Admission:
    def __init__(
        self,
        dp_prefill_align: int,
        delay_factor: float,
        dp_size: int,
        clock: Callable[[], float] = time.monotonic,  # the clock of Sequence.arrival_time
    ) -> None:
        self.clock = clock
        self.aligner: Optional[PrefillAligner] = (
            PrefillAligner(dp_prefill_align, dp_size) if dp_prefill_align and dp_size > 1 else None
        )
        self.delay: Optional[PrefillDelay] = (
            PrefillDelay(delay_factor) if delay_factor > 0 else None
        )
        # whether any rule is on: the engine's step skips this object otherwise
        self.active = self.aligner is not None or self.delay is not None

    @property
    def num_held_steps(self) -> int:
        """(step, rank) pairs some rule held prompts back, since start."""
        return sum(r.num_held_steps for r in (self.aligner, self.delay) if r is not None)

    def admits(self, ranks: Sequence[_RankQueue]) -> list[bool]:
        admit = [True] * len(ranks)
        if self.aligner is not None:
            admit = self.aligner.admits(ranks)
        if self.delay is not None:
            now = self.clock()
            admit = [a and d for a, d in zip(admit, self.delay.admits(ranks, now))]
        return admit

    def observe(self, outs: Sequence[Any]) -> None:
        """The step just scheduled: `outs` are its SchedulerOutputs, one per rank."""
        if self.delay is not None:
            self.delay.observe(outs, self.clock())

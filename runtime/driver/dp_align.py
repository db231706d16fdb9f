"""`PrefillAligner`: the optional admission rule `scheduler_config.dp_prefill_align`.

Under data parallelism every DP rank runs the step's padded row count (a MoE layer gathers the
same number of rows from each), so a prefill on one rank while the others decode makes every
rank run the prefill's rows: one rank's 500-token prompt costs the decoding ranks 499 padded rows
each. This rule holds such a *lone* prefill back, for at most `dp_prefill_align` steps, hoping a
prompt arrives on another rank so both prefill in one padded step. It holds nothing when several
ranks have prompts waiting (they already share a step), when no other rank has work (the step
would be the prefill's alone), or once the rank has waited its steps. Off (0) by default: it
trades a prompt's time to first token for fewer padded rows, and `atomrt bench dp
--dp-prefill-align N` measures whether that pays for a load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _RankQueue(Protocol):
    """What the rule reads of a DP rank's scheduler."""

    @property
    def waiting(self) -> Sequence: ...

    @property
    def running(self) -> Sequence: ...


class PrefillAligner:
    def __init__(self, max_hold_steps: int, dp_size: int) -> None:
        assert max_hold_steps >= 0 and dp_size >= 1
        self.max_hold_steps = max_hold_steps
        self.held = [0] * dp_size  # steps each rank's waiting prompts have been held so far
        self.num_held_steps = 0  # (step, rank) holds since start, for the stats

    def admits(self, ranks: Sequence[_RankQueue]) -> list[bool]:
        """Whether each rank may admit waiting prompts this step."""
        admit = [True] * len(ranks)
        if self.max_hold_steps == 0 or len(ranks) == 1:
            return admit
        waiting = [i for i, r in enumerate(ranks) if r.waiting]
        if len(waiting) != 1:  # none waits, or several prefill together anyway
            self.held = [0] * len(ranks)
            return admit
        r = waiting[0]
        others_busy = any(rank.running for i, rank in enumerate(ranks) if i != r)
        if not others_busy or self.held[r] >= self.max_hold_steps:
            self.held[r] = 0
            return admit
        self.held[r] += 1
        self.num_held_steps += 1
        admit[r] = False
        return admit

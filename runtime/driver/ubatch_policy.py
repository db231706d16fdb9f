# Hot path (driver, once per new batch shape): whether ForwardMode's decision splits into two
# microbatches. Pure arithmetic over the DP ranks' batch shapes; no torch, no I/O.
"""`UbatchPolicy`: the two-batch-overlap half of `ForwardMode`'s decision (`parallel_config.enable_tbo`).

Given the decision `ForwardMode` would take unsplit, `apply` returns it split or not, the same for
every DP rank (graphs/ubatch.py has the arithmetic):

- `none`: never splits.
- `prefill`: a prefill or mixed step splits by rows at the midpoint; it runs eagerly (under
  TR_HYBRID too: token graphs have no split recording).
- `all`: as `prefill`, and a decode step whose bucket holds more than two requests splits too: under
  FULL it replays the bucket's TBO graph; a split decode no recording serves (off the ladder,
  under `enforce_eager`, under TR_HYBRID) runs eagerly, its microbatches cut from the scheduled
  requests. A bucket of at most two requests replays its plain graph.
- `auto`: a decode step splits only where the start-up measurement of its bucket (the smallest
  measured size that holds it) found the split faster; prefill steps do not split.

An eager split needs every busy rank to cut its own batch into two microbatches with work in each
(`rank_can_split`); any rank that cannot split makes no rank split.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from atomrt.graphs.buckets import bucket_for
from atomrt.graphs.ubatch import (
    decode_bucket_splits,
    decode_ubatch_request_ranges,
    rank_can_split,
    split_decision,
)
from atomrt.runtime.config import ConfigError
from atomrt.runtime.decision import BatchShape, CapturedBuckets, ForwardDecision, ForwardKind

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoVerdict:
    """`enable_tbo: auto`'s measurement of one decode bucket (the slowest rank's times)."""

    running_bs: int
    unsplit_ms: float
    split_ms: float

    @property
    def splits(self) -> bool:
        return self.split_ms < self.unsplit_ms


def check_tbo(mode: str, arch: Any) -> None:
    """Two-batch overlap needs a mixture-of-experts model (its DP exchanges are what overlaps)."""
    if mode != "none" and not arch.is_moe:
        raise ConfigError(
            f"parallel_config.enable_tbo: {mode!r} needs a mixture-of-experts model; "
            f"{arch.architecture} has no experts (use enable_tbo: none)"
        )


class UbatchPolicy:
    def __init__(self, mode: str, captured: CapturedBuckets) -> None:
        self.mode = mode
        self.plain_keys = frozenset(captured.req_keys)
        self.tbo_keys = frozenset(captured.tbo_req_keys)
        self.verdicts = tuple(
            AutoVerdict(t.running_bs, 1e3 * t.unsplit_s, 1e3 * t.split_s)
            for t in captured.tbo_timings
        )
        self._measured = tuple(v.running_bs for v in self.verdicts)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def splits_decode(self, running_bs: int) -> bool:
        if not decode_bucket_splits(running_bs):
            return False
        if self.mode == "all":
            return True
        if self.mode == "auto":
            bucket = bucket_for(running_bs, self._measured)
            return bucket is not None and self.verdicts[self._measured.index(bucket)].splits
        return False

    def apply(
        self, d: ForwardDecision, busy: Sequence[BatchShape], max_seqs: int, max_tokens: int
    ) -> ForwardDecision:
        """`d` (the unsplit decision of a step with work), split or not; see the module docstring."""
        if d.kind is ForwardKind.REQ_GRAPH:
            key = (d.running_bs, d.draft_num)
            if key in self.tbo_keys and self.splits_decode(d.running_bs):
                return split_decision(d, len(decode_ubatch_request_ranges(d.running_bs).first))
            if key in self.plain_keys:
                return d
            # only a TBO recording holds this bucket, and this step does not split at it
            d = self._eager(d, max_seqs, max_tokens)
        if d.is_prefill:
            wanted = self.mode in ("prefill", "all")
            ubatch_split_bs = None
        else:
            wanted = self.splits_decode(max_seqs)
            ubatch_split_bs = len(decode_ubatch_request_ranges(max_seqs).first)
        q = 1 + d.draft_num
        if not wanted or not all(rank_can_split(b, q) for b in busy):
            return d
        return split_decision(self._eager(d, max_seqs, max_tokens), ubatch_split_bs)

    @staticmethod
    def _eager(d: ForwardDecision, max_seqs: int, max_tokens: int) -> ForwardDecision:
        """`d` (unsplit, before its DP fields) as an eager step: the group's largest sequence and
        row counts, no bucket."""
        return ForwardDecision(ForwardKind.EAGER, max_seqs, max_tokens, d.is_prefill, d.draft_num)

    def describe(self) -> list[str]:
        """One line per measured bucket (auto): its times and whether it splits."""
        return [
            f"decode bucket {v.running_bs}: {v.unsplit_ms:.3f} ms unsplit, {v.split_ms:.3f} ms "
            f"split -> {'split' if v.splits else 'unsplit'}"
            for v in self.verdicts
        ]

    def log_verdicts(self) -> None:
        if self.mode != "auto":
            return
        if not self.verdicts:
            logger.info(
                "two-batch overlap (auto): no decode bucket of more than 2 requests measured"
            )
        for line in self.describe():
            logger.info("two-batch overlap (auto): %s", line)

"""The project's performance goals, read from benchmarks/goals.json (declared by
benchmarks/goals.schema.json).

A goal names a figure's target (its table in docs/perf.md), the axes of the rows it judges and a
`Threshold`. An axis `min_X` (`max_X`) holds for a row whose `X` is at least (at most) its value;
any other axis holds for a row whose axis of that name is equal. A goal with no axes judges every
row of its target. Which rows are judged at all (on a GPU, standard settings) is the subcommand's
call; this module only says what the goal is.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from atomrt.runtime.bench.records import Threshold

logger = logging.getLogger(__name__)

GOALS_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "goals.json"
_THRESHOLD_KEYS = ("target", "op", "value", "of", "note")


@dataclass(frozen=True)
class Goal:
    target: str
    axes: tuple[tuple[str, Any], ...]
    threshold: Threshold
    note: str = ""

    def holds_for(self, axes: dict[str, Any]) -> bool:
        for name, want in self.axes:
            bound, _, axis = name.partition("_")
            if bound in ("min", "max") and axis in axes:
                got = axes[axis]
                if got is None or (got < want if bound == "min" else got > want):
                    return False
            elif axes.get(name) != want:
                return False
        return True


@functools.cache
def load_goals(path: Path = GOALS_FILE) -> tuple[Goal, ...]:
    """Every goal in `path`; none (with a warning) where the file is absent, as in an installed
    package without the repository's benchmarks/ folder."""
    if not path.exists():
        logger.warning("no goals file at %s: figures are recorded without goals", path)
        return ()
    out = []
    for entry in json.loads(path.read_text())["goals"]:
        axes = tuple((k, v) for k, v in entry.items() if k not in _THRESHOLD_KEYS)
        threshold = Threshold(entry["op"], float(entry["value"]), entry["of"])
        out.append(Goal(entry["target"], axes, threshold, entry.get("note", "")))
    return tuple(out)


def of_target(target: str) -> list[Goal]:
    """Every goal of `target`, in the file's order."""
    return [g for g in load_goals() if g.target == target]


def goal(target: str, **axes: Any) -> Optional[Goal]:
    """The first goal of `target` that holds for a row of these axes, or None."""
    return next((g for g in of_target(target) if g.holds_for(axes)), None)


def threshold(target: str, **axes: Any) -> Optional[Threshold]:
    """`goal(...)`'s threshold, or None."""
    found = goal(target, **axes)
    return None if found is None else found.threshold

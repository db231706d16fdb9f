"""Probes: what a worker counts, on request, while the steps of a plan run.

A bench asks for one through its executor (`Executor.probe`, runtime/executors/base.py): while the
probe is open, the engine's plans carry its name (`StepPlan.probe`), their steps run eagerly (a
probe reads the step in Python), and each DP rank's sampling worker sends what it counted back in
its `StepResult.probe`. The same path serves the in-process, `mp` and `ray` executors.

- `experts_touched`: per MoE layer, the distinct routed experts each call of the step selected,
  int32 [calls, layers] (workers/layers/expert_tally.py); a layer that reported no call was
  traced whole and read every expert. A rank with no rows counts nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from torch import nn

from atomrt.workers.layers import expert_tally
from atomrt.workers.layers.moe import FusedMoE
from atomrt.workers.layers.v4_moe import V4MoE

PROBES = ("experts_touched",)


def routed_layers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE layers in order: FusedMoE (DeepSeekMoE's too) and DeepSeek-V4's V4MoE."""
    return [m for m in model.modules() if isinstance(m, (FusedMoE, V4MoE))]


def check_probe(name: str) -> None:
    if name not in PROBES:
        raise ValueError(f"probe: expected one of {PROBES}, got {name!r}")


class ProbedStep:
    """What a probe counted over one step; `counts` is set when the step's forward has run."""

    counts: np.ndarray = np.zeros((0, 0), np.int32)


@contextmanager
def probing(name: str, model: nn.Module) -> Iterator[ProbedStep]:
    """Count probe `name` over the forward passes of `model` run inside."""
    check_probe(name)
    step = ProbedStep()
    tally = expert_tally.ExpertTally(routed_layers(model))
    with expert_tally.counting(tally):
        yield step
    step.counts = tally.step_counts()

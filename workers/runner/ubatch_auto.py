"""`enable_tbo: auto`: measure, at start-up, each decode bucket's step with and without the split.

Run by every rank at once, after capture (the steps exchange rows across DP ranks). For every
capture size that splits (`decode_bucket_splits`), a decode step of that many single-row requests
runs as `ForwardMode` would take it unsplit (request graph, token graph or eager) and split (TBO
graph, else eager), a warm-up then `repeats` timed runs each, the median kept; the times are then
the slowest rank's (a max over the DP and TP groups), so every rank reports the same. The driver
keeps the split where it is faster (runtime/driver/ubatch_policy.py). On CPU nothing is recorded:
both sides run eagerly, the same measurement.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm import tqdm

from atomrt.distributed.messages import WorkerSamplingParams
from atomrt.graphs.ubatch import decode_bucket_splits, uniform_decode_decisions
from atomrt.runtime.decision import CapturedBuckets, ForwardDecision, TboTiming
from atomrt.workers.runner.input_batch import dummy_decode_inputs
from atomrt.workers.runner.sampler import SamplingTensors

if TYPE_CHECKING:
    from atomrt.workers.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def measure_tbo(
    runner: ModelRunner, captured: CapturedBuckets, repeats: int = 3
) -> tuple[TboTiming, ...]:
    """One `TboTiming` per decode bucket that splits, the slowest rank's (see the module
    docstring)."""
    sizes = [bs for bs in sorted(runner.config.capture_sizes or ()) if decode_bucket_splits(bs)]
    if not sizes:
        return ()
    times = []
    for bs in tqdm(sizes, desc="Measuring two-batch overlap", disable=runner.rank != 0):
        plain, split = uniform_decode_decisions(bs, captured, runner.dp.dp_size)
        times.append([_median_step(runner, d, repeats) for d in (plain, split)])
    worst = torch.tensor(times, dtype=torch.float64, device=runner.device)  # [buckets, 2]
    for size, group in ((runner.dp.dp_size, runner.dp.group), (runner.tp.tp_size, runner.tp.group)):
        if size > 1:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return tuple(TboTiming(bs, a, b) for bs, (a, b) in zip(sizes, worst.tolist()))


def _median_step(runner: ModelRunner, decision: ForwardDecision, repeats: int) -> float:
    """Seconds of one decode step of `decision`'s bucket (staging, forward, greedy sampling)."""
    bs = decision.running_bs
    greedy = [WorkerSamplingParams(temperature=0.0)] * bs
    sampling = SamplingTensors.from_params(
        greedy, [[0]] * bs, [[]] * bs, runner.arch.vocab_size, runner.device
    )
    seconds = []
    for i in range(1 + repeats):  # the first is a warm-up
        _sync(runner)
        start = time.perf_counter()
        runner.execute(dummy_decode_inputs(bs, 1 + decision.draft_num), decision, sampling)
        _sync(runner)
        if i:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)

"""Randomized differential of the engine core (tests/workload_harness.py runs and checks it).

Random engines: KV pools from just fitting the longest request to roomy, 1..8 sequences, small
token budgets, chunked prefill, async scheduling on and off, prefix caching on and off, no
speculation or n-gram or draft-model drafts (1..3), in-process and mp executors. Random workloads:
arrivals at random steps and in bursts, n from 1 to 4, greedy, seeded sampled and unseeded sampled requests,
EOS, stop token ids and stop strings, penalties and logprobs now and then, streams and aborts.

Every greedy or seeded sample gives the tokens it gives alone (sample i of a seeded request: the
request seeded `seed + i`), with or without speculation, sync or async; on every case, a request
gets at most one output a step and exactly one `finished` one, the engine never idles while a
request is unfinished, and once arrivals stop every request finishes within a bounded number of
steps. Themed cases make sure tiny pools preempt parent and child samples and that seeded
requests run beside others under each proposer.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from executor_harness import build_target_and_draft
from workload_harness import (
    BLOCK,
    CPU,
    FULL,
    SMALL,
    Alone,
    Coverage,
    Sizes,
    random_config,
    run_workload,
)

from atomrt.runtime.entrypoints.llm import LLM


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    return build_target_and_draft(tmp_path_factory.mktemp("engine_random"))


@pytest.fixture(scope="module")
def alone(models) -> Alone:
    a = Alone(models[0])
    yield a
    a.llm.shutdown()


def _differential(
    models: tuple[Path, Path],
    alone: Alone,
    seed: int,
    workloads: int,
    executor: str = "inproc",
    seeded_share: float = 0.3,
    sizes: Sizes = FULL,
    **forced,
) -> Coverage:
    """`workloads` random workloads on one engine of random_config(seed, **forced)."""
    rng = random.Random(seed)
    config = random_config(rng, models[1], sizes, **forced)
    llm = LLM(str(models[0]), **CPU, executor=executor, worker_timeout_s=90.0, **config)
    coverage = Coverage()
    try:
        for w in range(workloads):
            rng = random.Random(seed * 1000 + w)
            coverage += run_workload(llm, rng, alone, seeded_share, sizes)
    finally:
        llm.shutdown()
    return coverage


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_give_each_sample_its_alone_tokens(models, alone, seed):
    coverage = _differential(models, alone, seed, workloads=5)
    assert coverage.compared_samples > 20


# Seeds whose workloads, before samples stopped waiting on a parent that finished while preempted,
# each left a request stuck for ever (the engine scheduled nothing while it was unfinished).
def test_tiny_pools_preempt_parents_and_children(models, alone):
    """Small requests (n up to 4, a quarter of them done within two tokens) arriving in bursts on
    pools of a few blocks, async scheduling, prefix caching on: samples 1..n-1 wait for their
    parent's prompt blocks while parents and children are preempted and finish in any order."""
    coverage = Coverage()
    for seed in (304, 310, 313):
        coverage += _differential(
            models,
            alone,
            seed,
            workloads=4,
            sizes=SMALL,
            tiny_pool=True,
            enable_prefix_caching=True,
            async_scheduling=True,
        )
    assert coverage.preempted["parent"] and coverage.preempted["child"], coverage.preempted


@pytest.mark.parametrize(
    "spec, async_scheduling", [("ngram", False), ("ngram", True), ("draft", False), ("draft", True)]
)
def test_seeded_samples_alone_and_in_a_batch_under_speculation(
    models, alone, spec, async_scheduling
):
    seed = {"ngram": 400, "draft": 410}[spec] + async_scheduling
    coverage = _differential(
        models,
        alone,
        seed,
        workloads=3,
        seeded_share=0.7,
        spec=spec,
        async_scheduling=async_scheduling,
    )
    assert coverage.seeded_samples > 10, coverage


@pytest.mark.parametrize("seed, spec", [(100, "none"), (101, "ngram")])
def test_random_workloads_through_mp(models, alone, seed, spec):
    _differential(models, alone, seed, workloads=3, executor="mp", spec=spec)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(200, 300))
def test_random_workloads_long(models, alone, seed):
    """Every tenth engine through mp; every fourth small requests on a tiny pool."""
    executor = "mp" if seed % 10 == 0 else "inproc"
    tiny = dict(sizes=SMALL, tiny_pool=True) if seed % 4 == 1 else {}
    _differential(models, alone, seed, workloads=30, executor=executor, **tiny)


def test_preemption_in_a_step_that_schedules_nothing_reaches_the_workers(models, alone):
    """Async scheduling, a pool that just fits: a sequence preempted by a step that schedules
    nothing is rescheduled later with a new block table, which the workers must get whole."""
    from atomrt.runtime.driver.scheduler import Scheduler

    seen = []
    original = Scheduler.schedule

    def schedule(self, admit=True):
        out = original(self, admit)
        if out.is_empty and out.preempted:
            seen.append(out.preempted[0].seq_id)
        return out

    llm = LLM(
        str(models[0]),
        **CPU,
        num_kv_blocks=11,
        block_size=BLOCK,
        max_num_seqs=7,
        max_num_batched_tokens=16,
        async_scheduling=True,
        enable_prefix_caching=False,
    )
    Scheduler.schedule = schedule
    try:
        for seed in range(40):
            run_workload(llm, random.Random(seed), alone)
            if seen:
                break
    finally:
        Scheduler.schedule = original
        llm.shutdown()
    assert seen, "no workload preempted a sequence in an empty step"

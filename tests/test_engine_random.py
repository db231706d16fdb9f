"""Randomized differential: tiny models, KV pools from just-fits to roomy, 1..8 sequences, small
token budgets, async on and off, prefix caching on and off, chunked prefill, random arrivals, streams
and aborts, in-process and mp: every finished request's greedy tokens equal the same request run
alone (an aborted one's are a prefix of them).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from executor_harness import VOCAB, build_tiny_llama

from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import SamplingParams

BLOCK = 4
MAX_NEW = 16
CPU = dict(device="cpu", enforce_eager=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_random") / "model")


class Alone:
    """Each prompt's greedy tokens when it runs by itself: one sequence at a time, a roomy pool,
    synchronous, no prefix cache. Computed once per prompt, for MAX_NEW tokens (a shorter request's
    tokens are a prefix: greedy, ignore_eos)."""

    def __init__(self, model: Path) -> None:
        self.llm = LLM(
            str(model),
            **CPU,
            num_kv_blocks=256,
            block_size=BLOCK,
            max_num_seqs=1,
            enable_prefix_caching=False,
        )
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def tokens(self, prompt: list[int], n: int) -> list[int]:
        key = tuple(prompt)
        if key not in self.cache:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
            self.cache[key] = (
                self.llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            )
        return self.cache[key][:n]


@pytest.fixture(scope="module")
def alone(tiny) -> Alone:
    a = Alone(tiny)
    yield a
    a.llm.shutdown()


def random_config(rng: random.Random) -> dict[str, Any]:
    return dict(
        num_kv_blocks=rng.choice([11, 12, 14, 16, 24, 64]),  # 11 just fits the longest request
        block_size=BLOCK,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.choice([8, 16, 32, 64]),
        async_scheduling=rng.random() < 0.6,
        enable_prefix_caching=rng.random() < 0.5,
        enable_chunked_prefill=True,
    )


def run_workload(llm: LLM, rng: random.Random, alone: Alone) -> int:
    """Random arrivals, streams and aborts on one engine; checks every request against `alone`.
    Returns the number of requests checked."""
    engine = llm.engine
    shared = [rng.randrange(4, VOCAB) for _ in range(8)]
    todo = []
    for _ in range(rng.randint(3, 10)):
        prefix = shared[: rng.randint(1, 8)] if rng.random() < 0.5 else []
        prompt = prefix + [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 20))]
        todo.append((prompt, rng.randint(1, MAX_NEW), rng.random() < 0.3))
    prompts: dict[str, tuple[list[int], int]] = {}
    streamed: dict[str, list[int]] = {}
    final: dict[str, Any] = {}
    aborted: set[str] = set()
    for _ in range(3000):
        if todo and rng.random() < 0.5:
            prompt, n, stream = todo.pop(0)
            rid = engine.add_request(
                prompt,
                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                stream=stream,
            )
            prompts[rid] = (prompt, n)
            if stream:
                streamed[rid] = []
        live = [r for r in prompts if r not in final and r not in aborted]
        if live and rng.random() < 0.04:
            victim = rng.choice(live)
            engine.abort(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.request_id in streamed:
                streamed[out.request_id].extend(out.outputs[0].token_ids)
            if out.finished:
                assert out.request_id not in final, f"request {out.request_id} finished twice"
                final[out.request_id] = out
        if not todo and not engine.has_unfinished():
            break
    else:
        raise AssertionError("the workload did not finish")
    assert set(final) == set(prompts), "a request never got its final output"
    for rid, (prompt, n) in prompts.items():
        completion = final[rid].outputs[0]
        tokens = streamed[rid] if rid in streamed else completion.token_ids
        want = alone.tokens(prompt, n)
        if rid in aborted:
            assert completion.finish_reason == "abort" and tokens == want[: len(tokens)], rid
        else:
            assert completion.finish_reason == "length" and tokens == want, (rid, prompt, n)
    assert all(
        s.block_manager.num_free_blocks == s.block_manager.num_blocks for s in engine.schedulers
    )
    return len(prompts)


def _differential(
    tiny: Path, alone: Alone, seed: int, workloads: int, executor: str = "inproc"
) -> None:
    rng = random.Random(seed)
    config = random_config(rng)
    llm = LLM(str(tiny), **CPU, executor=executor, worker_timeout_s=90.0, **config)
    try:
        for w in range(workloads):
            run_workload(llm, random.Random(seed * 1000 + w), alone)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("seed", range(8))
def test_random_interleavings_give_each_request_its_alone_tokens(tiny, alone, seed):
    _differential(tiny, alone, seed, workloads=10)


@pytest.mark.parametrize("seed", [100, 101])
def test_random_interleavings_through_mp(tiny, alone, seed):
    _differential(tiny, alone, seed, workloads=6, executor="mp")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(200, 260))
def test_random_interleavings_long(tiny, alone, seed):
    _differential(tiny, alone, seed, workloads=40, executor="mp" if seed % 10 == 0 else "inproc")


def test_preemption_in_a_step_that_schedules_nothing_reaches_the_workers(tiny, alone):
    """Async scheduling, a pool that just fits: a sequence preempted by a step that schedules
    nothing is rescheduled later with a new block table, which the workers must get whole."""
    from atomrt.runtime.driver.scheduler import Scheduler

    seen = []
    original = Scheduler.schedule

    def schedule(self):
        out = original(self)
        if out.is_empty and out.preempted:
            seen.append(out.preempted[0].seq_id)
        return out

    llm = LLM(
        str(tiny),
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

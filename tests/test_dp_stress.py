"""Randomly unbalanced load on a data-parallel MoE engine (DP=2 through mp, CPU, gloo): phases
where one rank is idle (only one request in flight), bursts of long prompts, aborts, preemptions
in a small KV cache. Every step of a MoE model is a collective across the DP ranks, an idle rank's
dummy batch included; the run must finish with no hang, every request answered once (finished or
aborted), and every wait bounded (a rank that stopped would fail the step within
worker_timeout_s, naming the rank and the step). 2,000 steps in the `slow` run; a short one by
default.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from executor_harness import wait_gone
from moe_harness import build_moe_folder

from atomrt import SamplingParams
from atomrt.runtime.entrypoints.llm import LLM

VOCAB = 128
LONG = (60, 160)  # a burst's prompt lengths
DRAIN_STEPS = 2000  # after the load stops, the engine must empty within this many steps


@dataclass
class Load:
    submitted: dict[str, int] = field(default_factory=dict)  # request id -> max_tokens
    aborted: set[str] = field(default_factory=set)
    finished: dict[str, object] = field(default_factory=dict)  # request id -> final output
    steps: int = 0
    lone_steps: int = 0  # steps run while the load kept one request in flight


def drive(llm: LLM, num_steps: int, seed: int) -> Load:
    """Step the engine under a random load for `num_steps` steps, then until it is empty."""
    rng = random.Random(seed)
    engine, load = llm.engine, Load()
    lone = False
    ids = iter(range(10**9))

    def add(prompt_len: int) -> None:
        rid, max_tokens = f"r{next(ids)}", rng.randint(1, 12)
        prompt = [rng.randrange(2, VOCAB) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(prompt, params, request_id=rid)
        load.submitted[rid] = max_tokens

    while load.steps < num_steps or engine.has_unfinished():
        assert load.steps < num_steps + DRAIN_STEPS, "the engine did not drain"
        if load.steps < num_steps:
            if load.steps % 20 == 0:
                lone = rng.random() < 0.5  # half the phases keep one rank idle
            in_flight = [r for r in load.submitted if r not in load.finished]
            if lone:
                load.lone_steps += 1
                if len(in_flight) == 0:
                    add(rng.randint(1, 20))
            else:
                if rng.random() < 0.3:
                    add(rng.randint(1, 20))
                if rng.random() < 0.03:  # a burst of long prompts
                    for _ in range(rng.randint(2, 4)):
                        add(rng.randint(*LONG))
            if in_flight and rng.random() < 0.03:
                victim = rng.choice(in_flight)
                engine.abort(victim)
                load.aborted.add(victim)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in load.finished, f"{out.request_id} finished twice"
                load.finished[out.request_id] = out
        load.steps += 1
    return load


def check(load: Load) -> None:
    assert set(load.finished) == set(load.submitted), "a request was lost"
    for rid, out in load.finished.items():
        completion = out.outputs[0]
        if completion.finish_reason == "abort":
            assert rid in load.aborted
            continue
        assert completion.finish_reason == "length", (rid, completion.finish_reason)
        assert len(completion.token_ids) == load.submitted[rid]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_moe_folder(tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.mark.parametrize(
    "num_steps,extra",
    [
        (80, dict(dp_prefill_align=2)),
        pytest.param(2000, {}, marks=pytest.mark.slow),
        pytest.param(2000, dict(async_scheduling=True), marks=pytest.mark.slow),
    ],
    ids=["short-aligned", "2000-steps", "2000-steps-async"],
)
def test_unbalanced_load_finishes_without_hang_or_loss(
    tiny_moe: Path, num_steps: int, extra: dict
) -> None:
    llm = LLM(
        str(tiny_moe),
        executor="mp",
        data_parallel_size=2,
        device="cpu",
        enforce_eager=True,
        num_kv_blocks=24,  # 384 tokens per rank: bursts of long prompts preempt
        max_num_seqs=8,
        max_num_batched_tokens=256,
        worker_timeout_s=60.0,
        **extra,
    )
    try:
        pids = dict(llm.engine.executor.worker_pids)
        load = drive(llm, num_steps, seed=num_steps)
        stats = llm.engine.stats
    finally:
        llm.shutdown()
    check(load)
    assert load.lone_steps > num_steps // 5
    # idle ranks ran dummy batches; padding was counted
    assert stats.dummy_batches > 0 and stats.padded_tokens > 0
    assert wait_gone(pids.values(), timeout_s=5) == []

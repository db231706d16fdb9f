"""Two-batch overlap end to end: the tiny Qwen3-MoE at DP=2 (CPU, gloo, real mp processes and Ray
actors) gives every request the greedy tokens of DP=1 without overlap, with `enable_tbo` none,
prefill and all, over prefill, decode and mixed steps and preemption (a small KV cache and token
budget force them; the test checks they happened, and that the mode split the steps it covers).
On CPU the two microbatches run one after the other through the same interleaved stages as on a
GPU, so each one's all_gather and reduce_scatter across the DP ranks happen in the GPU's order.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from executor_harness import wait_gone
from moe_harness import build_moe_folder

from atomrt import SamplingParams
from atomrt.runtime.entrypoints.llm import LLM

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(2, 128) for _ in range(_rng.randrange(2, 14))] for _ in range(10)]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=_rng.randrange(3, 12), ignore_eos=True)
    for _ in PROMPTS
]
# 16-token steps chunk the prompts beside running decodes (mixed steps); 12 blocks of 4 tokens per
# rank cannot hold five requests at once (preemption).
COMMON = dict(
    device="cpu",
    enforce_eager=True,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=16,
    worker_timeout_s=90.0,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A tiny Qwen3-MoE checkpoint and its DP=1 greedy tokens without two-batch overlap."""
    folder = build_moe_folder(tmp_path_factory.mktemp("qwen3_moe"))
    llm = LLM(str(folder), executor="inproc", num_kv_blocks=64, **COMMON)
    try:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()
    return folder, reference


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=4, logging_level="WARNING", include_dashboard=False)
    yield
    ray.shutdown()


def _observe(llm: LLM) -> dict[str, int]:
    """Counts, filled while the engine runs: mixed steps (a rank runs prompt and decode rows at
    once) and split steps by phase, seen at the scheduler and at ForwardMode."""
    seen = {"mixed": 0, "split_prefill": 0, "split_decode": 0}
    engine = llm.engine
    for sched in engine.schedulers:
        schedule = sched.schedule

        def counted(*args, schedule=schedule, **kwargs):
            out = schedule(*args, **kwargs)
            seen["mixed"] += out.is_prefill and any(r.is_decode for r in out.scheduled)
            return out

        sched.schedule = counted
    decide = engine.forward_mode.decide

    def observed(batches, **kwargs):
        d = decide(batches, **kwargs)
        if d.ubatch_rows is not None:
            seen["split_prefill" if d.is_prefill else "split_decode"] += 1
        return d

    engine.forward_mode.decide = observed
    return seen


# The default run takes both split modes through mp; the Ray layouts are `slow` (Ray DP=2 runs by
# default in test_logit_additions and test_dp_moe, and the split happens inside each rank's forward,
# whatever the executor), as is the mode that splits nothing.
MODES = [
    pytest.param("mp", "all", id="mp-all"),
    pytest.param("mp", "prefill", id="mp-prefill"),
    pytest.param("ray", "prefill", id="ray-prefill", marks=pytest.mark.slow),
    pytest.param("ray", "all", id="ray-all", marks=pytest.mark.slow),
    pytest.param("mp", "none", id="mp-none", marks=pytest.mark.slow),
    pytest.param("ray", "none", id="ray-none", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("executor,tbo", MODES)
def test_dp2_tbo_matches_dp1(model, request, executor: str, tbo: str) -> None:
    folder, reference = model
    if executor == "ray":
        request.getfixturevalue("local_ray")
    llm = LLM(
        str(folder),
        executor=executor,
        data_parallel_size=2,
        enable_tbo=tbo,
        num_kv_blocks=12,
        **COMMON,
    )
    pids = dict(getattr(llm.engine.executor, "worker_pids", {}))
    try:
        seen = _observe(llm)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        stats = llm.engine.stats
        preemptions = sum(s.num_preemptions for s in llm.engine.schedulers)
    finally:
        llm.shutdown()
    assert tokens == reference
    assert preemptions > 0 and seen["mixed"] > 0, (preemptions, seen)
    assert stats.split_steps == seen["split_prefill"] + seen["split_decode"]
    assert (seen["split_prefill"] > 0) == (tbo != "none"), seen
    assert (seen["split_decode"] > 0) == (tbo == "all"), seen
    assert wait_gone(pids.values(), timeout_s=15) == []

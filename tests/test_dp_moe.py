"""Data-parallel attention on a MoE model, end to end (CPU, gloo, real ZeroMQ, real Ray and mp).

Each DP rank has its own scheduler and KV cache; the MoE layers gather every DP rank's rows (padded
to the step's running_tokens), run the experts split over the whole DP x TP world and scatter the
rows back. Every request must get the greedy tokens it gets with DP = 1, whichever rank serves it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from executor_harness import wait_gone
from moe_harness import build_moe_folder

from atomrt.runtime import SamplingParams
from atomrt.runtime.entrypoints.llm import LLM

# Ragged prompts, more than one rank's share, so ranks prefill and decode different shapes and a
# rank runs out of work before the other.
PROMPTS = [
    [3, 17, 42, 99, 5, 8, 61],
    [7, 1, 120],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [50, 51],
    [90, 91, 92, 93, 94],
]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (8, 3, 6, 8, 1)]
COMMON = dict(
    device="cpu", enforce_eager=True, num_kv_blocks=64, max_num_seqs=8, worker_timeout_s=90.0
)


def greedy(model: Path, **kwargs) -> tuple[list[list[int]], dict]:
    llm = LLM(str(model), **{**COMMON, **kwargs})
    try:
        outs = llm.generate(PROMPTS, PARAMS)
        pids = dict(getattr(llm.engine.executor, "worker_pids", {}))
        stats = llm.engine.stats
    finally:
        llm.shutdown()
    assert stats.steps["eager"] > 0
    return [o.outputs[0].token_ids for o in outs], pids


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_moe_folder(tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.fixture(scope="module")
def reference(tiny_moe: Path) -> list[list[int]]:
    tokens, _ = greedy(tiny_moe, executor="inproc")
    assert [len(t) for t in tokens] == [p.max_tokens for p in PARAMS]
    return tokens


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for both Ray layouts (the executor joins it and leaves it running)."""
    import ray

    ray.init(num_cpus=4, logging_level="WARNING", include_dashboard=False)
    yield
    ray.shutdown()


# The default run takes DP=2 x TP=1 through mp and DP=2 x TP=2 through Ray; the other two are `slow`.
@pytest.mark.parametrize(
    "tp", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["dp2xtp1", "dp2xtp2"]
)
def test_mp_dp2_moe_matches_dp1(tiny_moe: Path, reference: list[list[int]], tp: int) -> None:
    tokens, pids = greedy(tiny_moe, executor="mp", data_parallel_size=2, tensor_parallel_size=tp)
    assert tokens == reference
    assert len(pids) == 2 * tp
    assert wait_gone(pids.values(), timeout_s=5) == []


@pytest.mark.parametrize(
    "tp", [pytest.param(1, marks=pytest.mark.slow), 2], ids=["dp2xtp1", "dp2xtp2"]
)
def test_ray_dp2_moe_matches_dp1(
    tiny_moe: Path, reference: list[list[int]], local_ray: None, tp: int
) -> None:
    tokens, pids = greedy(tiny_moe, executor="ray", data_parallel_size=2, tensor_parallel_size=tp)
    assert tokens == reference
    assert len(pids) == 2 * tp
    assert wait_gone(pids.values()) == []

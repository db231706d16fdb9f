"""Data-parallel attention on a MoE model, end to end (CPU, gloo, real ZeroMQ, real Ray and mp).

Each DP rank has its own scheduler and KV cache; the MoE layers gather every DP rank's rows (padded
to the step's running_tokens), run the experts split over the whole DP x TP world and scatter the
rows back. Every request must get the greedy tokens it gets with DP = 1, whichever rank serves it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from executor_harness import wait_gone
from moe_harness import build_moe_folder

from atomrt import SamplingParams
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
def moe(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, list[list[int]]]]:
    """name -> (a tiny checkpoint of moe_harness's config `name`, its DP=1 greedy tokens)."""
    made: dict[str, tuple[Path, list[list[int]]]] = {}

    def get(name: str) -> tuple[Path, list[list[int]]]:
        if name not in made:
            folder = build_moe_folder(tmp_path_factory.mktemp(name), name)
            tokens, _ = greedy(folder, executor="inproc")
            assert [len(t) for t in tokens] == [p.max_tokens for p in PARAMS]
            made[name] = folder, tokens
        return made[name]

    return get


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for both Ray layouts (the executor joins it and leaves it running)."""
    import ray

    ray.init(num_cpus=4, logging_level="WARNING", include_dashboard=False)
    yield
    ray.shutdown()


# (executor, tp, model): the default run takes DP=2 x TP=1 through mp on Qwen3-MoE and DP=2 x TP=2
# through Ray on Qwen2-MoE (its shared expert is TP-split inside each DP rank, its experts over all
# four ranks); the rest are `slow`.
LAYOUTS = [
    pytest.param("mp", 1, "qwen3_moe", id="mp-dp2xtp1-qwen3_moe"),
    pytest.param("ray", 2, "qwen2_moe", id="ray-dp2xtp2-qwen2_moe"),
    pytest.param("mp", 2, "qwen3_moe", id="mp-dp2xtp2-qwen3_moe", marks=pytest.mark.slow),
    pytest.param("ray", 1, "mixtral", id="ray-dp2xtp1-mixtral", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("executor,tp,model", LAYOUTS)
def test_dp2_moe_matches_dp1(moe, request, executor: str, tp: int, model: str) -> None:
    folder, reference = moe(model)
    if executor == "ray":
        request.getfixturevalue("local_ray")
    tokens, pids = greedy(folder, executor=executor, data_parallel_size=2, tensor_parallel_size=tp)
    assert tokens == reference
    assert len(pids) == 2 * tp
    assert wait_gone(pids.values(), timeout_s=15) == []


@pytest.mark.slow
def test_mp_dp2_moe_compiled_level3_matches_dp1(moe) -> None:
    """Level 3 traces the DP collectives and the experts' op into the piecewise graph (Inductor off
    here, for time)."""
    from atomrt.runtime.config import CompilationConfig

    folder, reference = moe("qwen3_moe")
    tokens, _ = greedy(
        folder,
        executor="mp",
        data_parallel_size=2,
        enforce_eager=False,
        compilation_config=CompilationConfig(level=3, use_inductor=False),
        heartbeat_timeout_s=120.0,
    )
    assert tokens == reference


def test_frozen_dp_peer_is_named_with_the_step(moe) -> None:
    """SIGSTOP one DP rank of a MoE engine: the other blocks in the experts' gather waiting for it.
    Nothing hangs: the driver names the stopped rank and the step within the heartbeat timeout."""
    import os
    import signal
    import time

    from atomrt.runtime.executors.base import WorkerError

    folder, _ = moe("qwen3_moe")
    hb = 2.0
    llm = LLM(str(folder), executor="mp", data_parallel_size=2, heartbeat_timeout_s=hb, **COMMON)
    pids = dict(llm.engine.executor.worker_pids)
    try:
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="heartbeat") as err:
            llm.generate(PROMPTS, PARAMS)
        seconds = time.monotonic() - start
    finally:
        llm.shutdown()
    message = str(err.value)
    assert "rank 1 (dp 1, tp 0)" in message and "step 0" in message, message
    assert seconds < hb + 10.0, f"the error took {seconds:.1f} s"
    assert wait_gone(pids.values()) == []

"""GPU tier, 2 GPUs: TP=2 through the Ray executor (one actor per GPU, NCCL) gives TP=2 eager's
greedy tokens in cudagraph modes NONE, FULL and TR_HYBRID; the mp executor too (TR_HYBRID).
Dummy weights of Llama-3.2-1B's shape (32 heads, 8 kv heads: SmolLM2-135M's 9 heads do not split
over 2 ranks), float32 (so that eager and graph kernels agree to well under a greedy near-tie),
token-id prompts (no tokenizer needed on the GPU machine).

Run on the GPU machine: `MARK=multigpu tests/gpu/run_gpu_tier.sh tests/gpu/test_tp_gpu.py`.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.entrypoints.llm import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared executor harness
from executor_harness import wait_gone  # noqa: E402
from test_graph_modes_gpu import check_matches_eager  # noqa: E402

pytestmark = pytest.mark.multigpu

MODEL = dict(
    model="Llama-3.2-1B",
    load_format="dummy",
    dtype="float32",
    device="cuda",
    tensor_parallel_size=2,
    max_model_len=1024,
)
LADDER_TOP = 32  # capture [1..8, 16, 32]
NUM_REQUESTS = 32


def _requests(logprobs=None) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 49000) for _ in range(rng.randrange(1, 100))] for _ in range(NUM_REQUESTS)
    ]
    # staggered lengths: the decode batch shrinks 32 -> 1 through every bucket and between buckets
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=1 + (i * 7) % 30, ignore_eos=True, logprobs=logprobs
        )
        for i in range(NUM_REQUESTS)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def ray_session():
    """One Ray for the module (the executor joins it instead of starting its own)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import ray

    ray.init(num_gpus=2, num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def _run(executor: str, mode, enforce_eager: bool = False, logprobs=None, **settings):
    cc = CompilationConfig(level=0, cudagraph_mode=mode, cuda_graph_sizes=[LADDER_TOP])
    llm = LLM(
        **MODEL,
        executor=executor,
        enforce_eager=enforce_eager,
        compilation_config=cc,
        max_num_seqs=NUM_REQUESTS,
        gpu_memory_utilization=0.5,
        **settings,
    )
    pids = dict(llm.engine.executor.worker_pids)
    try:
        prompts, params = _requests(logprobs)
        outs = llm.generate(prompts, params)
        if logprobs is not None:
            return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]
        return [o.outputs[0].token_ids for o in outs], llm.engine.info
    finally:
        llm.shutdown()
        assert wait_gone(pids.values(), timeout_s=30) == [], (
            "worker processes (and their GPU memory) left"
        )


@pytest.fixture(scope="module")
def eager_tokens(ray_session):
    tokens, info = _run("ray", None, enforce_eager=True)
    assert not info.capture_sizes
    return tokens


@pytest.fixture(scope="module")
def eager_logprobs(ray_session, eager_tokens):
    """Eager's top-2 logprobs per token, for the report of a mismatch (is it a near-tie?); run
    only when a test mismatches. Asking for logprobs leaves greedy's tokens as they are."""
    tokens, logprobs = _run("ray", None, enforce_eager=True, logprobs=2)
    assert tokens == eager_tokens, "eager's greedy tokens changed when logprobs were asked for"
    return logprobs


def _check(tokens, info, mode: str, eager_tokens, request) -> None:
    logprobs = request.getfixturevalue("eager_logprobs") if tokens != eager_tokens else None
    check_matches_eager(tokens, info, mode, eager_tokens, f"TP=2 {mode} vs TP=2 eager", logprobs)


@pytest.mark.parametrize("mode", ["NONE", "FULL", "TR_HYBRID"])
def test_ray_tp2_mode_matches_eager(eager_tokens, mode, request):
    tokens, info = _run("ray", mode)
    _check(tokens, info, mode, eager_tokens, request)


def test_mp_tp2_tr_hybrid_matches_eager(eager_tokens, request):
    tokens, info = _run("mp", "TR_HYBRID")
    _check(tokens, info, "TR_HYBRID", eager_tokens, request)


@pytest.mark.parametrize("mode", ["FULL", "TR_HYBRID"])
def test_ray_tp2_async_scheduling_matches_eager(eager_tokens, mode, request):
    """Pipelined plans over ZeroMQ; both TP ranks feed their own pending tokens (plain greedy)."""
    tokens, info = _run("ray", mode, async_scheduling=True)
    _check(tokens, info, mode, eager_tokens, request)

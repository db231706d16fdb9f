"""GPU tier, 2 GPUs: two-batch overlap (TBO) on a MoE model with data-parallel attention (DP=2,
one GPU per rank, NCCL).

- Per bucket: after the whole ladder is captured under FULL with `enable_tbo: all`, every bucket
  that splits replays its TBO graph (both microbatches' streams forked and joined inside one
  recording) to the logits of the unsplit eager step and of the eager split, in random order, on
  both DP ranks, rank 1 scheduling fewer requests into each bucket than rank 0.
- End to end: FULL, TR_HYBRID (whose split steps run eagerly) and `auto` with TBO give the greedy
  tokens of DP=1 eager without it, through Ray and mp.
- `atomrt bench dp --enable-tbo none,all,auto` on a Qwen3-30B-A3B-shaped model (dummy weights,
  bf16): the A/B in one run; `auto` keeps TBO only where it measured a win, so it is not slower
  than the better of none and all by more than the noise.

float32 dummy weights for the token and logit checks. Run on the GPU machine:
`MARK=multigpu tests/gpu/run_gpu_tier.sh tests/gpu/test_tbo_gpu.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.entrypoints.llm import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared harnesses
from executor_harness import wait_gone  # noqa: E402
from moe_harness import GPU_DP_MODEL, staggered_requests  # noqa: E402

pytestmark = pytest.mark.multigpu

_RANK = r"""
import os, random, sys
from dataclasses import replace
import numpy as np
import torch
import atomrt.distributed.parallel_state as ps
from atomrt.distributed.messages import WorkerSamplingParams
from atomrt.runtime.config import (CacheConfig, CompilationConfig, Config, ModelConfig,
    ParallelConfig, SchedulerConfig)
from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.sampler import SamplingTensors
from atomrt.workers.worker import Worker

rank, port = int(sys.argv[1]), int(sys.argv[2])
LADDER = [1, 2, 3, 4, 5, 7, 8, 16, 32]
torch.cuda.set_device(rank)
ps.init_distributed(2, rank, 2, 1, "127.0.0.1", port, backend="nccl", timeout_s=120)
config = Config(
    model="OLMoE-1B-7B-like",
    device="cuda",
    model_config=ModelConfig(load_format="dummy", dtype="float32", max_model_len=256),
    compilation_config=CompilationConfig(cudagraph_mode="FULL", cudagraph_capture_sizes=LADDER),
    scheduler_config=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024),
    cache_config=CacheConfig(num_kv_blocks=64),
    parallel_config=ParallelConfig(data_parallel_size=2, enable_tbo="all"),
)
worker = Worker(config, rank, 0, rank, ps.get_tp_group().group, dp_group=ps.get_dp_group().group)
info = worker.initialize(64)
runner = worker.runner
tbo_keys = [(b, 0) for b in LADDER if b > 2]
assert list(info.tbo_req_keys) == tbo_keys, info.tbo_req_keys
assert list(info.req_keys) == [(1, 0), (2, 0)], info.req_keys  # `all`: no plain graph that splits
BLOCK = runner.shape.block_size


def inputs(q_lens, computed, seed):
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n = int(cu[-1])
    seq_of_row = np.repeat(np.arange(len(q_lens)), q_lens)
    pos = np.asarray(computed)[seq_of_row] + np.arange(n) - cu[:-1][seq_of_row]
    tables = np.arange(len(q_lens), dtype=np.int32)[:, None]  # sequence s: block s
    rng = np.random.default_rng(seed)
    return StepInputs(
        seq_ids=np.arange(len(q_lens), dtype=np.int64),
        input_ids=rng.integers(2, 50000, n).astype(np.int64),
        positions=pos.astype(np.int64),
        slot_mapping=(tables[seq_of_row, 0] * BLOCK + pos).astype(np.int64),
        cu_seqlens_q=cu,
        context_lens=(np.asarray(computed) + np.asarray(q_lens)).astype(np.int32),
        block_tables=tables,
        sample_seq_idx=np.arange(len(q_lens), dtype=np.int64),
        sample_rows=cu[1:].astype(np.int64) - 1,
    )


def logits(step, decision):
    n = step.num_seqs
    params = [WorkerSamplingParams(temperature=0.0, logprobs=1)] * n  # the sampler sees the logits
    sampling = SamplingTensors.from_params(params, [[0]] * n, [[]] * n, runner.arch.vocab_size, runner.device)
    seen = {}
    sampler = runner.sampler
    runner.sampler = lambda lg, s: (seen.setdefault("logits", lg.clone()), sampler(lg, s))[1]
    try:
        runner.execute(step, decision, sampling)
    finally:
        runner.sampler = sampler
    torch.cuda.synchronize()
    return seen["logits"]


# Context: 32 sequences of 5..12 tokens on each rank (every rank the same rows, eagerly).
lens = [5 + (s * 7) % 8 for s in range(32)]
prefill = inputs(lens, [0] * 32, seed=100 + rank)
rows = sum(lens)
logits(prefill, ForwardDecision(ForwardKind.EAGER, 32, rows, True, dp_num_tokens=(rows, rows),
                                dp_padded_tokens=(rows, rows)))
order = [b for b in LADDER if b > 2]
random.Random(0).shuffle(order)  # the same order on both ranks: their collectives pair up
worst = 0.0
for bs in order:
    real = (bs, max(2, bs // 3))
    step = inputs([1] * real[rank], lens[: real[rank]], seed=bs * 10 + rank)
    dp = dict(dp_num_tokens=real, dp_padded_tokens=(bs, bs))
    eager = ForwardDecision(ForwardKind.EAGER, bs, bs, False, **dp)
    half = bs // 2
    split_eager = replace(eager, ubatch_split_bs=half, ubatch_split_tokens=half)
    graph = replace(split_eager, kind=ForwardKind.REQ_GRAPH, req_key=(bs, 0))
    want = logits(step, eager)
    for name, d in (("eager split", split_eager), ("TBO graph", graph)):
        got = logits(step, d)
        err = (got - want).abs().max().item()
        worst = max(worst, err)
        assert err < 2e-3, (rank, bs, name, err)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), (rank, bs, name)
print(f"rank {rank}: {len(order)} TBO buckets match eager (max |diff| {worst:.2e})", flush=True)
ps.destroy_distributed(timeout_s=10)
os._exit(0)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tbo_graph_per_bucket_matches_eager_on_dp2() -> None:
    from atomrt.distributed.net_utils import get_free_port

    port = get_free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=480)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and "TBO buckets match eager" in out, f"rank {r} failed:\n{out}"


MODEL = GPU_DP_MODEL
NUM_REQUESTS = 32


@pytest.fixture(scope="module")
def ray_session():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import ray

    ray.init(num_gpus=2, num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    return staggered_requests(NUM_REQUESTS, seed=1)


def _run(executor: str, dp: int, mode, tbo: str, enforce_eager: bool = False):
    cc = CompilationConfig(level=0, cudagraph_mode=mode, cuda_graph_sizes=[32])
    llm = LLM(
        **MODEL,
        executor=executor,
        data_parallel_size=dp,
        enforce_eager=enforce_eager,
        enable_tbo=tbo,
        compilation_config=cc,
        max_num_seqs=32,
        max_num_batched_tokens=512,  # several prefill steps, some mixed with decodes
        gpu_memory_utilization=0.5,
    )
    pids = dict(getattr(llm.engine.executor, "worker_pids", {}))
    try:
        prompts, params = _requests()
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return tokens, llm.engine.stats
    finally:
        llm.shutdown()
        assert wait_gone(pids.values(), timeout_s=30) == []


@pytest.fixture(scope="module")
def dp1_eager(ray_session) -> list[list[int]]:
    return _run("inproc", 1, None, "none", enforce_eager=True)[0]


@pytest.mark.parametrize(
    "executor,mode,tbo",
    [
        ("ray", "FULL", "all"),
        ("ray", "TR_HYBRID", "all"),
        ("ray", "FULL", "prefill"),
        ("mp", "FULL", "auto"),
    ],
)
def test_dp2_tbo_matches_dp1(dp1_eager, executor: str, mode: str, tbo: str) -> None:
    tokens, stats = _run(executor, 2, mode, tbo)
    assert tokens == dp1_eager
    if tbo != "auto":
        assert stats.split_steps > 0


def test_bench_dp_tbo_ab(ray_session, tmp_path: Path) -> None:
    """The A/B on a Qwen3-30B-A3B shape at DP=2 under FULL: every mode reports, auto is not worse
    than the better of none and all beyond noise."""
    from atomrt.runtime.bench.dp import main

    out = tmp_path / "tbo.json"
    rc = main(
        [
            "--model",
            "Qwen3-30B-A3B",
            "--load-format",
            "dummy",
            "--device",
            "cuda",
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "128",
            "--layouts",
            "2x1",
            "--executor",
            "ray",
            "--enable-tbo",
            "none,all,auto",
            "--num-requests",
            "32,256",
            "--input-len",
            "256",
            "--output-len",
            "128",
            "--imbalance",
            "0",
            "--set",
            "compilation_config.cudagraph_mode=FULL",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    for n in (32, 256):
        by_mode = {r["enable_tbo"]: r for r in results if r["num_requests"] == n}
        assert set(by_mode) == {"none", "all", "auto"}
        best = max(by_mode["none"]["output_tokens_per_s"], by_mode["all"]["output_tokens_per_s"])
        assert by_mode["auto"]["output_tokens_per_s"] >= 0.9 * best, by_mode
        assert by_mode["auto"]["tbo_auto"], "auto reports its per-bucket measurements"

"""Start-up warms the host-planned attention kernels: a few one-sequence eager batches plan every
compiled variant a step of the engine's limits can (so no prompt compiles one mid-serving), and
running them leaves the KV cache and later tokens as they were. Capture's bucket warm-ups run in
the same compile-ahead pass (one pool for both phases), and leave them alone too."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from executor_harness import COMMON, GREEDY, PROMPTS, build_tiny_llama

from atomrt.graphs.buckets import capture_order
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.workers.kernels.attention import decode_attention
from atomrt.workers.kernels.attention.decode_attention import plan_decode
from atomrt.workers.kernels.attention.variants import (
    launch_variants,
    warmup_decode_seqs,
    warmup_lengths,
)
from atomrt.workers.runner.graph_runner import GraphRunner
from atomrt.workers.runner.kernel_warmup import run_batches, warmup_batches

SMS = 132  # an H100 / H200

# (KV heads, query heads per KV head, head dim, max rows per step, max_model_len)
SHAPES = [
    (3, 3, 64, 8192, 8192),  # SmolLM2-135M
    (8, 4, 128, 8192, 131072),  # Llama-3.1-8B
    (2, 8, 128, 512, 2048),
    (1, 16, 256, 16384, 32768),
    (32, 1, 64, 4096, 4096),  # no GQA
]
ROWS = sorted({*range(1, 70), 100, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1000, 2048, 8192})
KEYS = sorted({*range(1, 1100, 13), *(2**i for i in range(18)), *(3 * 2**i for i in range(16))})


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_the_warmup_batches_cover_every_variant_a_step_can_plan(shape) -> None:
    kv, group, head_dim, max_rows, max_len = shape
    batches = warmup_lengths(kv, group, head_dim, SMS, max_rows, max_len)
    assert all(1 <= rows <= keys <= max_len and rows <= max_rows for rows, keys in batches)
    warmed = set().union(*(launch_variants(1, r, k, kv, group, head_dim, SMS) for r, k in batches))
    assert {v[0] for v in warmed} == {"decode", "paged", "reduce"}
    missed = set()
    for seqs, rows, keys in itertools.product((1, 2, 5, 16, 64), ROWS, KEYS + [max_len]):
        if seqs * rows <= max_rows and rows <= keys <= max_len:
            missed |= launch_variants(seqs, rows, keys, kv, group, head_dim, SMS) - warmed
    assert not missed
    # each batch adds a variant: no more batches than variants
    assert len(batches) <= len(warmed)


@pytest.mark.parametrize(
    "plan",
    [None, (64, 4, 3, True, 4), (64, 8, 3, True, 2)],
    ids=["default", "t64w4s3v", "t64w8s3v"],
)
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: "-".join(map(str, s)))
def test_an_e4m3_cache_warms_its_own_decode_variants(shape, plan, monkeypatch) -> None:
    """With kv_cache_dtype fp8 the warm-up batches launch the e4m3 cache's decode plans at head_dim
    128 (their tiles, warps, stages and V widening, split or not), and every decode variant a step
    of up to 256 sequences can plan over that cache is among them, FP8_PLAN_D128 apart from
    FP8_SPLIT_PLAN_D128 (which only batches of several sequences plan) or not."""
    if plan is not None:
        monkeypatch.setattr(decode_attention, "FP8_PLAN_D128", plan)
    plan_decode.cache_clear()
    try:
        kv, group, head_dim, max_rows, max_len = shape
        one = warmup_lengths(kv, group, head_dim, SMS, max_rows, max_len, fp8_cache=True)
        several = warmup_decode_seqs(kv, group, head_dim, SMS, 256, max_len, fp8_cache=True)
        apart = decode_attention.FP8_PLAN_D128[:4] != decode_attention.FP8_SPLIT_PLAN_D128
        assert bool(several) == apart  # the split plan's variants need no several sequences
        warmed = set().union(
            *(launch_variants(1, r, k, kv, group, head_dim, SMS, True) for r, k in one),
            *(launch_variants(s, 1, k, kv, group, head_dim, SMS, True) for s, k in several),
        )
        bf16 = {v for v in launch_variants(1, 1, max_len, kv, group, head_dim, SMS)}
        e4m3 = {v for v in warmed if v[0] == "decode"}
        assert e4m3 and not e4m3 & bf16
        for seqs, keys in itertools.product((1, 2, 5, 16, 17, 33, 64, 66, 100, 256), KEYS):
            if keys <= max_len:
                found = launch_variants(seqs, 1, keys, kv, group, head_dim, SMS, True)
                assert found <= e4m3, (seqs, keys, found)
    finally:
        plan_decode.cache_clear()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def test_the_warmup_batches_leave_the_kv_cache_and_the_tokens_alone(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), **COMMON)
    try:
        runner = llm.engine.executor.worker.runner
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        cache = {
            name: (t.k_cache.clone(), t.v_cache.clone()) for name, t in runner.kv_cache.items()
        }
        batches = warmup_batches(runner)
        assert (1, 1, 1) in batches and any(rows > 1 for rows, _, _ in batches)
        run_batches(runner, [*batches, (1, 5, 3)])  # and a decode batch of several sequences
        for name, t in runner.kv_cache.items():
            assert torch.equal(t.k_cache, cache[name][0]) and torch.equal(t.v_cache, cache[name][1])
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()
    assert after == before


class _StagedBuckets(GraphRunner):
    """A GraphRunner that lists the buckets it stages (CPU records nothing; its warm-ups run)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.staged: list[tuple[int, int]] = []

    def stage_bucket(self, runner, bs: int, max_q_len: int):
        self.staged.append((bs, max_q_len))
        return super().stage_bucket(runner, bs, max_q_len)


def test_capture_warm_ups_run_once_each_ahead_and_leave_the_kv_cache_alone(
    tiny_model: Path,
) -> None:
    """`warm_up_ahead` (run inside the eager warm-up's compile-ahead pass) stages every capture
    bucket once, in capture's order, marks capture's own pass as done, and changes neither the KV
    cache nor later tokens."""
    llm = LLM(
        str(tiny_model),
        **dict(COMMON, enforce_eager=False),
        compilation_config=CompilationConfig(level=0, cuda_graph_sizes=[4]),
    )
    try:
        runner = llm.engine.executor.worker.runner
        config = runner.config
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        cache = {
            name: (t.k_cache.clone(), t.v_cache.clone()) for name, t in runner.kv_cache.items()
        }
        graphs = _StagedBuckets(config, enabled=True)
        with torch.inference_mode():
            ran = graphs.warm_up_ahead(runner)
        for name, t in runner.kv_cache.items():
            assert torch.equal(t.k_cache, cache[name][0]) and torch.equal(t.v_cache, cache[name][1])
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()
    want = [(bs, q) for bs in capture_order(config.capture_sizes) for q in config.capture_q_lens]
    assert len(want) > 1 and graphs.staged == want and ran == len(want)
    assert graphs.warmed_ahead  # capture runs no compile-ahead pass of its own
    assert after == before
    # a GraphRunner that records nothing warms nothing
    idle = _StagedBuckets(config, enabled=False)
    assert idle.warm_up_ahead(runner) == 0 and not idle.staged and not idle.warmed_ahead


def test_a_packed_steps_unpack_launches_through_launch(tiny_model: Path, monkeypatch) -> None:
    """The unpack at a request graph's head launches through `launch` (kept in a LaunchMemo on
    CUDA), so under `compile_ahead` its compile joins the pool's instead of blocking the pass on the
    main thread; here (Triton's interpreter) it still fills the static buffers from the staged
    step."""
    from atomrt.workers.kernels.unpack_step import unpack_step_kernel
    from atomrt.workers.runner import step_buffers
    from atomrt.workers.runner.input_batch import dummy_decode_inputs

    launched = []
    real_launch = step_buffers.launch

    def seen(kernel, grid, *args, **kwargs):
        launched.append((kernel, grid))
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(step_buffers, "launch", seen)
    llm = LLM(str(tiny_model), **COMMON)
    try:
        runner = llm.engine.executor.worker.runner
        fv = runner.buffers.forward_vars
        packed = step_buffers.PackedStep(
            max_seqs=4, max_rows=4, max_blocks=runner.shape.max_blocks_per_seq, device=runner.device
        )
        inputs = dummy_decode_inputs(3, 1, runner.shape.block_size)
        inputs.positions[:] = [5, 9, 2]
        inputs.input_ids[:] = [7, 8, 9]
        packed.stage(inputs, 4, 4)
        packed.unpack(fv, 4, 4)
        assert fv["input_ids"][:4].tolist() == [7, 8, 9, 0]
        assert fv["positions"][:4].tolist() == [5, 9, 2, 0]
    finally:
        llm.shutdown()
    assert launched == [(unpack_step_kernel, (5,))]

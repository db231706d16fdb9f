"""Start-up warms the host-planned attention kernels: a few one-sequence eager batches plan every
compiled variant a step of the engine's limits can (so no prompt compiles one mid-serving), and
running them leaves the KV cache and later tokens as they were."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from executor_harness import COMMON, GREEDY, PROMPTS, build_tiny_llama

from atomrt.runtime.entrypoints.llm import LLM
from atomrt.workers.kernels.attention.variants import launch_variants, warmup_lengths
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
        assert (1, 1) in batches and any(rows > 1 for rows, _ in batches)
        run_batches(runner, batches)
        for name, t in runner.kv_cache.items():
            assert torch.equal(t.k_cache, cache[name][0]) and torch.equal(t.v_cache, cache[name][1])
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()
    assert after == before

"""The MLA decode launch-plan options that are off by default (bench_mla_variants.py times them)
on CUDA at the model shapes, against float64 on the GPU: bf16 partials, the merge launch with
programmatic dependent launch, the in-kernel merge with wide steps, fewer splits with 64-key tiles,
half the heads a tile and each key tile's rows loaded during the tile before; eagerly and captured
in a CUDA graph replayed with new lengths.

Run on the GPU machine:  python -m pytest -m gpu tests/gpu/test_mla_variants_gpu.py
The CPU tier (tests/test_mla_kernels.py) checks the same options through Triton's interpreter
(merge_pdl runs only on sm90+, where these tests reach it).
"""

from __future__ import annotations

import dataclasses

import pytest
import test_mla_gpu as gpu_tier
import test_mla_kernels as cpu_tier
import torch

from atomrt.workers.kernels.attention.mla_decode import launch_mla_decode, plan_mla_decode
from atomrt.workers.kernels.device_info import sm_count

pytestmark = pytest.mark.gpu

r = dataclasses.replace


def _options(base):
    wide = r(base, block_n=64, num_warps=8, num_stages=2, min_tiles_per_split=1)
    fewer = max(2, base.num_splits // 4)
    heads_p = base.heads_p // 2
    block_m = max(16, base.block_q * heads_p)
    half = r(base, heads_p=heads_p, block_m=block_m, block_q=block_m // heads_p)
    return {
        "bf16": r(base, partials_bf16=True),
        "merge_pdl": r(base, merge_pdl=True),
        "bf16_merge_pdl": r(base, partials_bf16=True, merge_pdl=True),
        "kernel_steps16x32k": r(
            wide,
            num_splits=fewer,
            merge_in_kernel=True,
            merge_splits=16,
            merge_regs=32768,
            partials_bf16=True,
        ),  # fmt: skip
        "n64w8s2_fewer": r(wide, num_splits=fewer, partials_bf16=True),
        "half_heads": r(half, partials_bf16=True),
        "prefetch_kv_n32w8": r(base, prefetch_kv=True, num_warps=8, num_stages=1),
        "prefetch_kv_n16w4_fewer": r(
            base,
            prefetch_kv=True,
            block_n=16,
            num_stages=1,
            num_splits=fewer,
            min_tiles_per_split=4,
            partials_bf16=True,
        ),  # fmt: skip
    }


OPTIONS = list(_options(plan_mla_decode(1, 1, 8192, 16, 512, 64, 132)))


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("name", ["bs1_8k", "bs8_mixed", "verify"])
def test_option_matches_float64(name: str, option: str) -> None:
    lens_q, lens_k = gpu_tier.SCENARIOS[name]
    batch = gpu_tier.make_batch(
        lens_q + [1], lens_k + [0], num_heads=16, dtype=torch.bfloat16, extra_rows=1,
        max_blocks=8192 // gpu_tier.BLOCK_SIZE, seed=len(name) + len(option),
    )  # fmt: skip
    rows, reqs = batch.q.shape[0], batch.seq_lens.shape[0]
    base = plan_mla_decode(reqs, rows, 8192, 16, 512, 64, sm_count(batch.q.device))
    if base.num_splits == 1:
        base = r(base, num_splits=8)
    plan = _options(base)[option]
    gpu_tier.check(batch, cpu_tier.run_mla(batch, plan=plan))


@pytest.mark.parametrize("option", OPTIONS)
def test_option_in_a_graph(option: str) -> None:
    """A lone request's launch captured once (8k-key capacity), replayed with other lengths."""
    batch = gpu_tier.make_batch(
        [1], [8192], num_heads=16, dtype=torch.bfloat16, max_blocks=8192 // gpu_tier.BLOCK_SIZE,
        seed=3,
    )  # fmt: skip
    plan = _options(plan_mla_decode(1, 1, 8192, 16, 512, 64, sm_count(batch.q.device)))[option]
    out = batch.out()
    args = (batch.q, batch.kv_cache, batch.block_table, batch.seq_lens, batch.cu_seqlens_q)
    launch_mla_decode(plan, *args, batch.scale, out)  # compiles, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_mla_decode(plan, *args, batch.scale, out)
    for n in (8192, 3000, 100, 1):
        batch.seq_lens.fill_(n)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        gpu_tier.check(batch, out)

"""The MLA kernels on CUDA at the model shapes (latent 512 + rotary 64; 16 heads as DeepSeek-V2-Lite,
20 as GLM-4.7-Flash, 128 as DeepSeek-V3), bf16 and fp16, against float64 on the GPU: the cache write,
decode and verify rows over contexts up to 8k keys, padded requests among real ones, and the
graph-safe launch captured in a CUDA graph (cache write, then attention, as a layer runs them) and
replayed with new lengths, and so the plan that merges the splits in the decode kernel.

Run on the GPU machine:  python -m pytest -m gpu tests/gpu/test_mla_gpu.py
The CPU tier (tests/test_mla_kernels.py) runs the same checks through Triton's interpreter.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import test_mla_kernels as cpu_tier
import torch

from atomrt.workers.kernels.attention.decode_attention import prepare_decode_counters
from atomrt.workers.kernels.attention.mla_decode import (
    launch_mla_decode,
    mla_decode_attention,
    plan_mla_decode,
)
from atomrt.workers.kernels.attention.mla_write import mla_write_kv_cache
from atomrt.workers.kernels.device_info import sm_count

pytestmark = pytest.mark.gpu

LORA, ROPE, BLOCK_SIZE = 512, 64, 16
TOLERANCES = {torch.float16: dict(atol=5e-3, rtol=1e-2), torch.bfloat16: dict(atol=3e-2, rtol=5e-2)}
make_batch = functools.partial(
    cpu_tier.make_mla_batch, kv_lora_rank=LORA, rope_dim=ROPE, block_size=BLOCK_SIZE, device="cuda"
)


def _lens(n: int, high: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, high + 1, (n,), generator=gen).tolist()


# name: (rows per request, keys per request); two padded requests (seq_len 0) and a row of no
# request are added to each
SCENARIOS = {
    "bs1_short": ([1], [170]),
    "bs1_8k": ([1], [8192]),  # split over the SMs
    "bs8_mixed": ([1] * 8, [1, 100, 1000, 2048, 4000, 8192, 5, 333]),
    "bs32": ([1] * 32, _lens(32, 8192, 0)),
    "bs128": ([1] * 128, _lens(128, 4096, 1)),
    "verify": ([4, 1, 4, 2, 4, 4, 3, 4], _lens(8, 4096, 2)),  # speculative verify: 1-4 rows each
}


def check(batch: cpu_tier.MLABatch, out: torch.Tensor) -> None:
    cpu_tier.check_mla(batch, out, **TOLERANCES[batch.q.dtype])


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("num_heads", [16, 20, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_matches_float64(dtype: torch.dtype, num_heads: int, name: str) -> None:
    """The wrapper's own plan (splits chosen from the KV capacity: 8k keys per request)."""
    lens_q, lens_k = SCENARIOS[name]
    batch = make_batch(
        lens_q[:1] + [1] + lens_q[1:] + [1],
        lens_k[:1] + [0] + lens_k[1:] + [0],
        num_heads=num_heads,
        extra_rows=1,
        dtype=dtype,
        max_blocks=8192 // BLOCK_SIZE,
        seed=num_heads + len(name),
    )
    out = cpu_tier.run_mla(batch)
    torch.cuda.synchronize()
    check(batch, out)


@pytest.mark.parametrize("num_kv_splits", [1, 7, 32])
def test_forced_split_counts(num_kv_splits: int) -> None:
    """num_kv_splits given: a launch of that many splits, from one (no merge) to the most."""
    lens_k = [1, 64, 8192, 3000]
    batch = make_batch(
        [1] * 5, lens_k + [0], num_heads=16, dtype=torch.bfloat16, extra_rows=2, seed=num_kv_splits
    )
    check(batch, cpu_tier.run_mla(batch, num_kv_splits=num_kv_splits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_cache_rounds_to_nearest_even(dtype: torch.dtype) -> None:
    """fp32 rows into a cache of `dtype`: exactly torch's rounding; skipped slots untouched."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_tokens, num_blocks = 300, 40
    kv_a = torch.randn(num_tokens, LORA + ROPE, device="cuda", generator=gen)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda", generator=gen)[:num_tokens]
    slots[::7] = -1
    cache = torch.full(
        (num_blocks, BLOCK_SIZE, LORA + ROPE), float("nan"), device="cuda", dtype=dtype
    )
    mla_write_kv_cache(kv_a[:, :LORA], kv_a[:, LORA:], cache, slots)
    flat = cache.view(-1, LORA + ROPE)
    written = slots >= 0
    assert torch.equal(flat[slots[written]], kv_a[written].to(dtype))
    untouched = torch.ones(num_blocks * BLOCK_SIZE, dtype=torch.bool, device="cuda")
    untouched[slots[written]] = False
    assert torch.isnan(flat[untouched].float()).all()


class GraphBucket:
    """Static tensors of a decode bucket of `num_reqs` requests (one row each, KV capacity 8k) and a
    CUDA graph of one layer's MLA work on them: this step's cache rows written, then attention."""

    def __init__(self, num_reqs: int, num_heads: int, num_kv_splits: int | None):
        self.num_reqs, self.num_heads = num_reqs, num_heads
        self.max_blocks = 8192 // BLOCK_SIZE
        self.num_blocks = num_reqs * self.max_blocks + 3
        static = self.batch(_lens(num_reqs, 8192, 3), seed=0)
        self.static = static
        self.kv_c = torch.zeros(num_reqs, LORA, device="cuda", dtype=torch.bfloat16)
        self.k_pe = torch.zeros(num_reqs, ROPE, device="cuda", dtype=torch.bfloat16)
        self.slots = torch.full((num_reqs,), -1, device="cuda", dtype=torch.int64)
        self.out = static.out()
        self.num_kv_splits = num_kv_splits
        self.run()  # compiles, outside the capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.run()

    def batch(self, lens_k: list[int], seed: int) -> cpu_tier.MLABatch:
        return make_batch(
            [1] * self.num_reqs, lens_k, num_heads=self.num_heads, dtype=torch.bfloat16,
            max_blocks=self.max_blocks, num_blocks=self.num_blocks, seed=seed,
        )  # fmt: skip

    def run(self) -> None:
        s = self.static
        mla_write_kv_cache(self.kv_c, self.k_pe, s.kv_cache, self.slots)
        mla_decode_attention(
            s.q, s.kv_cache, s.block_table, s.seq_lens, s.cu_seqlens_q, s.scale, self.out,
            self.num_kv_splits,
        )  # fmt: skip

    def replay(self, new: cpu_tier.MLABatch) -> None:
        """Copies `new` in, its last key of each request held back as this step's row (its cache
        slot NaN until the graph writes it), and replays."""
        s = self.static
        for name in ("q", "block_table", "seq_lens", "cu_seqlens_q"):
            getattr(s, name).copy_(getattr(new, name))
        cache = new.kv_cache.clone().view(-1, LORA + ROPE)
        self.slots.fill_(-1)
        for b, n in enumerate(new.seq_lens.tolist()):
            if n == 0:
                continue
            slot = (
                int(new.block_table[b, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
            )
            self.slots[b] = slot
            self.kv_c[b], self.k_pe[b] = cache[slot, :LORA], cache[slot, LORA:]
            cache[slot] = float("nan")
        s.kv_cache.copy_(cache.view_as(s.kv_cache))
        self.out.fill_(float("nan"))
        self.graph.replay()
        torch.cuda.synchronize()


@pytest.mark.parametrize("num_kv_splits", [None, 4], ids=["planned", "splits4"])
@pytest.mark.parametrize("num_reqs", [1, 8, 64])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_graph_replay_with_new_lengths(
    num_heads: int, num_reqs: int, num_kv_splits: int | None
) -> None:
    """One capture per bucket, replayed with contexts that use a few, many and all of the splits,
    padded requests among the real ones: each replay against float64, and the written rows."""
    bucket = GraphBucket(num_reqs, num_heads, num_kv_splits)
    planned = plan_mla_decode(
        num_reqs, num_reqs, 8192, num_heads, LORA, ROPE, sm_count(bucket.out.device)
    )
    if num_kv_splits is None and num_reqs == 1:
        assert planned.num_splits > 1, "a lone request over 8k keys should split"
    cases = [_lens(num_reqs, 300, 10), _lens(num_reqs, 8192, 11), [8192] * num_reqs, [1] * num_reqs]
    cases.append([0 if b % 3 == 1 else n for b, n in enumerate(_lens(num_reqs, 5000, 12))])
    for seed, lens_k in enumerate(cases, start=1):
        new = bucket.batch(lens_k, seed)
        bucket.replay(new)
        check(new, bucket.out)
        written = bucket.slots >= 0
        flat = bucket.static.kv_cache.view(-1, LORA + ROPE)
        expected = new.kv_cache.view(-1, LORA + ROPE)[bucket.slots[written]]
        assert torch.equal(flat[bucket.slots[written]], expected)


@pytest.mark.parametrize("name", ["bs1_8k", "bs8_mixed", "bs32", "verify"])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_merge_in_kernel_in_a_graph(num_heads: int, name: str) -> None:
    """The planned launch with merge_in_kernel (the last split program merges; the counters reset
    themselves), captured once and replayed with new lengths, against float64 each time."""
    lens_q, lens_k = SCENARIOS[name]
    batch = make_batch(
        lens_q + [1], lens_k + [0], num_heads=num_heads, dtype=torch.bfloat16, extra_rows=1,
        max_blocks=8192 // BLOCK_SIZE, seed=num_heads,
    )  # fmt: skip
    num_reqs, num_rows = batch.seq_lens.shape[0], batch.q.shape[0]
    plan = dataclasses.replace(
        plan_mla_decode(num_reqs, num_rows, 8192, num_heads, LORA, ROPE, sm_count(batch.q.device)),
        merge_in_kernel=True,
    )
    if plan.num_splits == 1:
        plan = dataclasses.replace(plan, num_splits=4)
    counters = prepare_decode_counters(batch.q.device)
    out = batch.out()
    args = (batch.q, batch.kv_cache, batch.block_table, batch.seq_lens, batch.cu_seqlens_q)
    launch_mla_decode(plan, *args, batch.scale, out)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_mla_decode(plan, *args, batch.scale, out)
    full = batch.seq_lens.clone()
    for step in range(4):  # all keys, a few, one, then all again
        keep = [full, full // 7, torch.ones_like(full), full][step]
        batch.seq_lens.copy_(torch.minimum(full, keep) * (full > 0))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(batch, out)
        assert torch.all(counters == 0), "a merging program left its counter set"

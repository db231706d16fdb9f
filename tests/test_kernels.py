"""Paged-attention Triton kernels against a float64 torch reference, on CUDA when present, else on
CPU through Triton's interpreter.

Tiny shapes (block_size 16, 1-4 blocks per sequence, head_dim 32/64) so the interpreter stays fast.
The GPU tier (tests/gpu/test_kernels_gpu.py) repeats these checks at real sizes in fp16/bf16.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from kernel_device import DEVICE

from atomrt.workers.kernels.attention.paged_attention import (
    AttentionLaunch,
    launch_attention,
    plan_attention,
    rope_write_kv,
    unified_attention,
    write_kv_cache,
)
from atomrt.workers.layers.rotary import RotaryEmbedding

SENTINEL = 7.0  # what padded output rows hold before the call, and must hold after it


@dataclass
class PagedBatch:
    """A ragged batch laid out in a paged KV cache, plus the host copies of its metadata."""

    q: torch.Tensor  # [num_rows (incl. padding), num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32 (padded sequences have 0 rows)
    context_lens: torch.Tensor  # [num_seqs] int32 (padded sequences have 0)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 past the end
    cu_seqlens_q_cpu: list[int]
    context_lens_cpu: list[int]
    num_real_seqs: int

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_real_rows(self) -> int:
        return self.cu_seqlens_q_cpu[self.num_real_seqs]


def make_batch(
    lens_q: list[int],
    lens_k: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    max_blocks: int,
    pad_seqs: int = 0,
    pad_rows: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = DEVICE,
    num_blocks: int | None = None,
    seed: int = 0,
) -> PagedBatch:
    """Random q and cache, built on `device`; physical blocks shuffled across sequences. Every cache
    slot that no sequence owns, and every padded q row, holds NaN: a kernel that reads one fails the
    test. (The GPU tier builds its real-size batches with this too.)"""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in lens_k]
    assert all(b <= max_blocks for b in blocks_per_seq) and all(
        nq <= nk for nq, nk in zip(lens_q, lens_k)
    )
    num_blocks = num_blocks or sum(blocks_per_seq) + 3
    physical = torch.randperm(num_blocks, device=device, generator=gen)
    num_seqs = len(lens_q) + pad_seqs
    block_tables = torch.full((num_seqs, max_blocks), -1, dtype=torch.int32, device=device)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=device)
    used = 0
    for s, (n, nb) in enumerate(zip(lens_k, blocks_per_seq)):
        blocks = physical[used : used + nb]
        used += nb
        block_tables[s, :nb] = blocks.to(torch.int32)
        owned.view(-1)[
            (blocks[:, None] * block_size + torch.arange(block_size, device=device)).view(-1)[:n]
        ] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    nan = torch.tensor(float("nan"), device=device)
    k_cache = torch.where(
        owned[:, :, None, None], torch.randn(shape, device=device, generator=gen), nan
    ).to(dtype)
    v_cache = torch.where(
        owned[:, :, None, None], torch.randn(shape, device=device, generator=gen), nan
    ).to(dtype)
    cu = [0]
    for n in lens_q + [0] * pad_seqs:
        cu.append(cu[-1] + n)
    q = torch.full((cu[-1] + pad_rows, num_kv_heads * group, head_dim), float("nan"), device=device)
    q[: cu[-1]] = torch.randn(cu[-1], num_kv_heads * group, head_dim, device=device, generator=gen)
    ctx = list(lens_k) + [0] * pad_seqs
    return PagedBatch(
        q=q.to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        block_tables=block_tables,
        cu_seqlens_q_cpu=cu,
        context_lens_cpu=ctx,
        num_real_seqs=len(lens_q),
    )


def reference_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """float64 causal attention: gather each sequence's keys through its block table.
    Returns [num_real_rows, num_heads, head_dim]."""
    block_size, num_kv_heads = batch.k_cache.shape[1], batch.k_cache.shape[2]
    group = batch.q.shape[1] // num_kv_heads
    outs = []
    for s in range(batch.num_real_seqs):
        q0, q1 = batch.cu_seqlens_q_cpu[s], batch.cu_seqlens_q_cpu[s + 1]
        n_q, n_k = q1 - q0, batch.context_lens_cpu[s]
        pos = torch.arange(n_k, device=batch.q.device)
        blocks = batch.block_tables[s, pos // block_size].long()
        # [n_k, num_heads, head_dim]: kv head h // group serves query head h
        k = batch.k_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        v = batch.v_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        q = batch.q[q0:q1].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = n_k - n_q + torch.arange(n_q, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def run_attention(
    batch: PagedBatch, *, graph_safe: bool, max_seqlen_q: int, host_lists: bool = True
) -> torch.Tensor:
    """Calls unified_attention as the attention op would; returns the whole out buffer."""
    out = torch.full_like(batch.q, SENTINEL)
    unified_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        out,
        batch.cu_seqlens_q,
        batch.context_lens,
        batch.block_tables,
        batch.q.shape[2] ** -0.5,
        num_seqs=batch.num_seqs,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max(batch.context_lens_cpu),
        graph_safe=graph_safe,
        cu_seqlens_q_cpu=batch.cu_seqlens_q_cpu if host_lists else None,
        context_lens_cpu=batch.context_lens_cpu if host_lists else None,
    )
    return out


def check_output(
    batch: PagedBatch, out: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-5
) -> None:
    ref = reference_attention(batch, batch.q.shape[2] ** -0.5)
    n = batch.num_real_rows
    torch.testing.assert_close(out[:n].double(), ref, rtol=rtol, atol=atol)
    assert torch.all(out[n:] == SENTINEL), "padded output rows were written"


# (lens_q, lens_k): prefill with prior context (ragged, one chunk starting mid-block), decode, MTP verify
CASES = {
    "prefill": ([5, 17, 1, 9], [5, 40, 33, 20]),
    "decode": ([1, 1, 1], [1, 17, 48]),
    "mtp3": ([3, 3, 3], [3, 20, 47]),
}


@pytest.mark.parametrize("graph_safe", [False, True], ids=["host", "graph"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 32)], ids=["mha-d64", "gqa4-d32"])
def test_attention_matches_reference(
    graph_safe: bool, case: str, group: int, head_dim: int
) -> None:
    lens_q, lens_k = CASES[case]
    pad_seqs, pad_rows = (2, 3) if graph_safe else (0, 2)
    batch = make_batch(
        lens_q,
        lens_k,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=16,
        max_blocks=4,
        pad_seqs=pad_seqs,
        pad_rows=pad_rows,
        seed=len(case) + group,
    )
    # A graph bucket's rows per sequence may exceed the batch's real maximum.
    max_seqlen_q = max(lens_q) + (3 if graph_safe and case == "prefill" else 0)
    check_output(batch, run_attention(batch, graph_safe=graph_safe, max_seqlen_q=max_seqlen_q))


@pytest.mark.parametrize("seed", range(6))
def test_random_ragged_batches(seed: int) -> None:
    """Random mixes of decode, MTP and prefill-with-context rows; odd GQA ratios and head dims too."""
    rng = torch.Generator().manual_seed(100 + seed)

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    block_size, max_blocks = pick([16, 32]), 3
    group, head_dim, num_kv_heads = pick([1, 3, 4, 8]), pick([32, 48, 64]), pick([1, 2])
    lens_k = [
        int(n)
        for n in torch.randint(
            1, block_size * max_blocks + 1, (int(pick([1, 3, 5])),), generator=rng
        )
    ]
    lens_q = [min(n_k, pick([1, 2, 4, n_k])) for n_k in lens_k]
    graph_safe = seed % 2 == 0
    batch = make_batch(
        lens_q,
        lens_k,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        max_blocks=max_blocks,
        pad_seqs=int(graph_safe),
        pad_rows=2,
        seed=seed,
    )
    check_output(batch, run_attention(batch, graph_safe=graph_safe, max_seqlen_q=max(lens_q)))


def test_host_path_without_host_lists() -> None:
    lens_q, lens_k = CASES["prefill"]
    batch = make_batch(
        lens_q,
        lens_k,
        num_kv_heads=1,
        group=4,
        head_dim=32,
        block_size=16,
        max_blocks=3,
        pad_rows=1,
    )
    check_output(
        batch, run_attention(batch, graph_safe=False, max_seqlen_q=max(lens_q), host_lists=False)
    )


@pytest.mark.skipif(DEVICE == "cuda", reason="tests Triton's interpreter, which runs on CPU only")
def test_compile_ahead_launches_as_usual_under_the_interpreter() -> None:
    """The interpreter compiles nothing: `compile_ahead` says it does not apply, and launches
    inside it run (start-up then skips its compile-only pass)."""
    from atomrt.workers.kernels.launch import compile_ahead

    lens_q, lens_k = CASES["prefill"]
    batch = make_batch(
        lens_q, lens_k, num_kv_heads=1, group=4, head_dim=32, block_size=16, max_blocks=3
    )
    with compile_ahead() as ahead:
        assert not ahead
        out = run_attention(batch, graph_safe=False, max_seqlen_q=max(lens_q))
    check_output(batch, out)


def test_block_size_32() -> None:
    batch = make_batch(
        [4, 1, 2], [37, 64, 2], num_kv_heads=2, group=2, head_dim=32, block_size=32, max_blocks=2
    )
    check_output(batch, run_attention(batch, graph_safe=True, max_seqlen_q=4))


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("case", ["prefill", "decode"])
def test_split_kv_matches_reference(num_splits: int, case: str) -> None:
    """Forces a split count (the planner only splits contexts of hundreds of keys) to test the reduce."""
    lens_q, lens_k = CASES[case]
    batch = make_batch(
        lens_q,
        lens_k,
        num_kv_heads=2,
        group=4,
        head_dim=32,
        block_size=16,
        max_blocks=3,
        pad_seqs=1,
        pad_rows=2,
        seed=num_splits,
    )
    plan = plan_attention(
        batch.num_seqs, max(lens_q), 48, num_kv_heads=2, group=4, head_dim=32, num_sms=4
    )
    plan = dataclasses.replace(
        plan, num_splits=num_splits, tile_n=16
    )  # 16-key tiles: up to 3 per sequence
    out = torch.full_like(batch.q, SENTINEL)
    launch_attention(
        plan,
        batch.q,
        batch.k_cache,
        batch.v_cache,
        out,
        batch.cu_seqlens_q,
        batch.context_lens,
        batch.block_tables,
        32**-0.5,
        num_seqs=batch.num_seqs,
        reduce_rows=batch.q.shape[0],
    )
    check_output(batch, out)


def test_graph_safe_replay_with_new_metadata_in_same_buffers() -> None:
    """What a FULL graph replay does: same tensors, new contents (lengths, tables, q), same launch."""
    bucket = dict(num_kv_heads=2, group=2, head_dim=32, block_size=16, max_blocks=3, seed=1)
    first = make_batch(
        [1, 1, 1], [3, 33, 16], pad_seqs=1, pad_rows=1, **bucket
    )  # 4 sequences, 4 rows
    second = make_batch([1, 1], [48, 1], pad_seqs=2, pad_rows=2, **bucket)
    check_output(first, run_attention(first, graph_safe=True, max_seqlen_q=1))
    num_blocks = min(first.k_cache.shape[0], second.k_cache.shape[0])
    for name in ("q", "cu_seqlens_q", "context_lens", "block_tables"):
        getattr(first, name).copy_(getattr(second, name))
    first.k_cache[:num_blocks].copy_(second.k_cache[:num_blocks])
    first.v_cache[:num_blocks].copy_(second.v_cache[:num_blocks])
    replayed = dataclasses.replace(second, k_cache=first.k_cache, v_cache=first.v_cache)
    check_output(replayed, run_attention(replayed, graph_safe=True, max_seqlen_q=1))


def test_write_kv_cache_skips_padded_slots() -> None:
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, num_kv_heads, head_dim = 3, 16, 2, 32
    k = torch.randn(6, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(6, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), SENTINEL, device=DEVICE)
    v_cache = torch.full_like(k_cache, -SENTINEL)
    slot_mapping = torch.tensor([33, 2, -1, 17, 47, -1], dtype=torch.int64, device=DEVICE)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    k_flat, v_flat = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )
    written = slot_mapping >= 0
    assert torch.equal(k_flat[slot_mapping[written]], k[written])
    assert torch.equal(v_flat[slot_mapping[written]], v[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slot_mapping[written]] = False
    assert torch.all(k_flat[untouched] == SENTINEL) and torch.all(v_flat[untouched] == -SENTINEL)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding in float64; x [T, heads, D], cos/sin [T, D / 2]."""
    x = x.double()
    half = x.shape[-1] // 2
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 32), (3, 1, 64), (6, 3, 16)])
def test_rope_write_kv_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """q and k rotated as a float64 reference does, k and v at their slots, padded rows (-1) leave
    the cache alone; q and k are strided views of one fused qkv row, as the model hands them over."""
    gen = torch.Generator().manual_seed(11)
    num_tokens, num_blocks, block_size = 7, 3, 16
    rotary = RotaryEmbedding(head_dim, max_position=64, theta=10000.0).to(DEVICE)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(DEVICE)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 5, 63, 17, 0, 2, 40], dtype=torch.int64, device=DEVICE)
    slot_mapping = torch.tensor([33, 2, -1, 17, 47, -1, 0], dtype=torch.int64, device=DEVICE)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), SENTINEL, device=DEVICE)
    v_cache = torch.full_like(k_cache, -SENTINEL)

    q_rot = rope_write_kv(
        q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_cache, v_cache, slot_mapping
    )

    cos, sin = rotary.cos_cache[positions], rotary.sin_cache[positions]
    torch.testing.assert_close(q_rot.double(), _rotate_ref(q, cos, sin), rtol=1e-5, atol=1e-5)
    assert q_rot.is_contiguous() and q_rot.shape == q.shape
    written = slot_mapping >= 0
    k_flat, v_flat = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )
    k_ref = _rotate_ref(k, cos, sin)
    torch.testing.assert_close(
        k_flat[slot_mapping[written]].double(), k_ref[written], rtol=1e-5, atol=1e-5
    )
    assert torch.equal(v_flat[slot_mapping[written]], v[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slot_mapping[written]] = False
    assert torch.all(k_flat[untouched] == SENTINEL) and torch.all(v_flat[untouched] == -SENTINEL)
    # The unfused path the CPU reference runs (RotaryEmbedding) agrees.
    q_torch, k_torch = rotary(positions, q, k)
    torch.testing.assert_close(q_rot, q_torch, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        k_flat[slot_mapping[written]], k_torch[written], rtol=1e-5, atol=1e-5
    )


def test_rope_write_kv_rejects_mismatched_caches() -> None:
    rotary = RotaryEmbedding(32, max_position=8, theta=10000.0)
    q, k = torch.zeros(2, 4, 32), torch.zeros(2, 2, 32)
    k_cache = torch.zeros(2, 16, 2, 32)
    slots, positions = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="do not fit head_dim 64"):
        q64, k64 = torch.zeros(2, 4, 64), torch.zeros(2, 2, 64)
        rope_write_kv(
            q64,
            k64,
            k64,
            positions,
            rotary.cos_cache,
            rotary.sin_cache,
            torch.zeros(2, 16, 2, 64),
            torch.zeros(2, 16, 2, 64),
            slots,
        )
    with pytest.raises(ValueError, match="do not fit caches"):
        rope_write_kv(
            q,
            k,
            k,
            positions,
            rotary.cos_cache,
            rotary.sin_cache,
            k_cache[:, :, :1],
            k_cache,
            slots,
        )
    with pytest.raises(ValueError, match="1 positions"):
        rope_write_kv(
            q,
            k,
            k,
            positions[:1],
            rotary.cos_cache,
            rotary.sin_cache,
            k_cache,
            k_cache.clone(),
            slots,
        )


def test_write_then_attend_round_trip() -> None:
    """Prefill chunk written through write_kv_cache, then attended: the attention op's order."""
    batch = make_batch(
        [4, 2], [20, 2], num_kv_heads=2, group=1, head_dim=32, block_size=16, max_blocks=2, seed=5
    )
    new_k = torch.randn(6, 2, 32, device=DEVICE)
    new_v = torch.randn(6, 2, 32, device=DEVICE)
    slots = []
    for s, (n_q, n_k) in enumerate([(4, 20), (2, 2)]):
        for p in range(n_k - n_q, n_k):
            slots.append(int(batch.block_tables[s, p // 16]) * 16 + p % 16)
    write_kv_cache(
        new_k,
        new_v,
        batch.k_cache,
        batch.v_cache,
        torch.tensor(slots, dtype=torch.int64, device=DEVICE),
    )
    check_output(batch, run_attention(batch, graph_safe=False, max_seqlen_q=4))


def test_plan_depends_on_bucket_values_only_and_splits_long_decode() -> None:
    few_long = plan_attention(
        num_seqs=1,
        max_seqlen_q=1,
        max_seqlen_k=8192,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        num_sms=132,
    )
    assert few_long.num_splits > 1
    many = plan_attention(
        num_seqs=64,
        max_seqlen_q=1,
        max_seqlen_k=1024,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        num_sms=132,
    )
    assert many.num_splits == 1
    prefill = plan_attention(
        num_seqs=2,
        max_seqlen_q=2048,
        max_seqlen_k=4096,
        num_kv_heads=8,
        group=1,
        head_dim=128,
        num_sms=132,
    )
    assert prefill.block_m == 128 and prefill.num_splits == 1
    assert isinstance(few_long, AttentionLaunch) and few_long.block_m % few_long.group_p == 0


def test_rejects_mismatched_heads() -> None:
    q = torch.zeros(2, 3, 32)
    cache = torch.zeros(2, 16, 2, 32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        unified_attention(
            q,
            cache,
            cache,
            torch.zeros_like(q),
            torch.tensor([0, 2], dtype=torch.int32),
            torch.tensor([2], dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32),
            1.0,
            num_seqs=1,
            max_seqlen_q=2,
            max_seqlen_k=2,
            graph_safe=False,
        )

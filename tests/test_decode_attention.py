"""The one-launch decode kernel (rotary + KV write + attention + split merge) against float64
references, on CUDA when present, else on CPU through Triton's interpreter (the GPU tier repeats
it at real sizes).

The new key's cache slot holds NaN before the call: a kernel that read the new key back from the
cache instead of using it from registers would produce NaN.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_device import DEVICE
from test_kernels import SENTINEL, PagedBatch, make_batch, reference_attention

from atomrt.workers.kernels.attention.decode_attention import (
    DecodeLaunch,
    attention_step,
    decode_attention,
    plan_decode,
    prepare_decode_counters,
)
from atomrt.workers.kernels.attention.paged_attention import rope_write_kv, unified_attention
from atomrt.workers.layers.rotary import RotaryEmbedding


@dataclasses.dataclass
class DecodeCase:
    batch: PagedBatch  # q holds the un-rotated query rows; the cache holds keys 0..n-2 of each sequence
    k: torch.Tensor  # [rows, Hk, D] this step's keys, before the rotary embedding
    v: torch.Tensor
    positions: torch.Tensor  # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64, -1 for padded rows
    rotary: RotaryEmbedding | None


def make_decode_case(
    lens_k: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int = 16,
    pad_seqs: int = 0,
    pad_rows: int = 0,
    rope: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = DEVICE,
    max_blocks: int | None = None,
    num_blocks: int | None = None,
) -> DecodeCase:
    max_blocks = max_blocks or max(-(-n // block_size) for n in lens_k) + 1
    batch = make_batch(
        [1] * len(lens_k),
        lens_k,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        max_blocks=max_blocks,
        pad_seqs=pad_seqs,
        pad_rows=pad_rows,
        dtype=dtype,
        device=device,
        seed=seed,
        num_blocks=num_blocks,
    )
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    rows = batch.q.shape[0]
    k = torch.randn(rows, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(rows, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    positions = torch.zeros(rows, dtype=torch.int64, device=device)
    slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
    for s, n in enumerate(lens_k):
        positions[s] = n - 1
        slots[s] = (
            int(batch.block_tables[s, (n - 1) // block_size]) * block_size + (n - 1) % block_size
        )
    flat_k = batch.k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = batch.v_cache.view(-1, num_kv_heads, head_dim)
    flat_k[slots[: len(lens_k)]] = float("nan")  # the new key's slot: written, never read
    flat_v[slots[: len(lens_k)]] = float("nan")
    rotary = (
        RotaryEmbedding(head_dim, max_position=8192, theta=10000.0).to(device) if rope else None
    )
    return DecodeCase(batch, k, v, positions, slots, rotary)


def expected(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 (output rows of the real sequences, new k rows, new v rows) after rotary + write + attention."""
    b = case.batch
    q, k = b.q.double(), case.k.double()
    if case.rotary is not None:
        cos = case.rotary.cos_cache[case.positions].double()[:, None, :]
        sin = case.rotary.sin_cache[case.positions].double()[:, None, :]
        half = q.shape[-1] // 2

        def rot(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        q, k = rot(q), rot(k)
    k_cache, v_cache = b.k_cache.double().clone(), b.v_cache.double().clone()
    written = case.slot_mapping >= 0
    hk, d = k_cache.shape[2:]
    k_cache.view(-1, hk, d)[case.slot_mapping[written]] = k[written]
    v_cache.view(-1, hk, d)[case.slot_mapping[written]] = case.v.double()[written]
    ref_batch = dataclasses.replace(b, q=q, k_cache=k_cache, v_cache=v_cache)
    return reference_attention(ref_batch, d**-0.5), k[written], case.v.double()[written]


def run_decode(case: DecodeCase, plan: DecodeLaunch, ubatch: int = 0) -> torch.Tensor:
    b = case.batch
    out = torch.full_like(b.q, SENTINEL)
    rot = case.rotary
    decode_attention(
        b.q,
        case.k,
        case.v,
        out,
        case.positions if rot is not None else None,
        rot.cos_cache if rot is not None else None,
        rot.sin_cache if rot is not None else None,
        b.k_cache,
        b.v_cache,
        case.slot_mapping,
        b.cu_seqlens_q,
        b.context_lens,
        b.block_tables,
        b.q.shape[2] ** -0.5,
        plan,
        num_seqs=b.num_seqs,
        ubatch=ubatch,
    )
    return out


def check(case: DecodeCase, out: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    ref_out, ref_k, ref_v = expected(case)
    b = case.batch
    n = b.num_real_rows
    assert not torch.isnan(out[:n]).any(), (
        "NaN in the output: the new key's slot or a foreign slot was read"
    )
    torch.testing.assert_close(out[:n].double(), ref_out, atol=atol, rtol=rtol)
    assert torch.all(out[n:] == SENTINEL), "rows of no sequence were written"
    written = case.slot_mapping >= 0
    hk, d = b.k_cache.shape[2:]
    torch.testing.assert_close(
        b.k_cache.view(-1, hk, d)[case.slot_mapping[written]].double(), ref_k, atol=atol, rtol=rtol
    )
    torch.testing.assert_close(
        b.v_cache.view(-1, hk, d)[case.slot_mapping[written]].double(), ref_v, atol=0, rtol=0
    )


def forced_plan(
    group: int, head_dim: int, num_splits: int, tile_n: int = 16, min_tiles: int = 1
) -> DecodeLaunch:
    return DecodeLaunch(
        block_m=max(16, 1 << (group - 1).bit_length()),
        head_dim_p=max(16, 1 << (head_dim - 1).bit_length()),
        tile_n=tile_n,
        num_splits=num_splits,
        min_tiles_per_split=min_tiles,
        num_warps=4,
        num_stages=2,
    )


LENS = [1, 2, 17, 40, 64]  # a first token (no cached key), a block boundary, several tiles


@pytest.mark.parametrize("rope", [True, False], ids=["rope", "no-rope"])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
@pytest.mark.parametrize(
    "group,head_dim", [(1, 32), (3, 64), (4, 32)], ids=["mha-d32", "gqa3-d64", "gqa4-d32"]
)
def test_decode_matches_reference(group: int, head_dim: int, num_splits: int, rope: bool) -> None:
    """Every split count, with padded sequences and padded rows, GQA, with and without rotary."""
    case = make_decode_case(
        LENS,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        pad_seqs=2,
        pad_rows=3,
        rope=rope,
        seed=group * 10 + num_splits,
    )
    check(case, run_decode(case, forced_plan(group, head_dim, num_splits)))
    assert torch.all(prepare_decode_counters(case.batch.q.device) == 0), "split counters not reset"


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_prefetched_tiles_match_reference(num_splits: int) -> None:
    """prefetch_kv (each K/V tile loaded an iteration ahead): the same attention, split or not,
    over contexts of no cached key, one tile and several, with rotary."""
    case = make_decode_case(
        LENS, num_kv_heads=2, group=3, head_dim=32, pad_seqs=1, pad_rows=2, seed=40 + num_splits
    )
    plan = dataclasses.replace(forced_plan(3, 32, num_splits), prefetch_kv=True)
    check(case, run_decode(case, plan))
    assert torch.all(prepare_decode_counters(case.batch.q.device) == 0), "split counters not reset"


def test_each_microbatch_merges_through_its_own_counters() -> None:
    """Two-batch overlap's microbatches may run decode launches at once: microbatch 1's split
    launch counts in its own region. With microbatch 0's region held nonzero (as if its launch
    were in flight), microbatch 1's result is still exact and region 0 is left as it was."""
    from atomrt.workers.kernels.attention.decode_attention import DECODE_COUNTERS

    case = make_decode_case(LENS, num_kv_heads=2, group=4, head_dim=32, pad_seqs=1, seed=3)
    counters = prepare_decode_counters(case.batch.q.device)
    counters[:DECODE_COUNTERS] = 7
    try:
        check(case, run_decode(case, forced_plan(4, 32, num_splits=4), ubatch=1))
        assert torch.all(counters[:DECODE_COUNTERS] == 7)
        assert torch.all(counters[DECODE_COUNTERS:] == 0), "microbatch 1's counters not reset"
    finally:
        counters.zero_()


def test_splits_merge_only_past_the_minimum_tiles() -> None:
    """min_tiles_per_split 2 over 16-key tiles: contexts of 1-2 tiles stay in one program, longer ones
    split; the same launch serves both (the live lengths decide), twice in a row (counters reset)."""
    for seed in range(2):
        case = make_decode_case(
            [3, 30, 33, 100, 150], num_kv_heads=1, group=4, head_dim=32, seed=seed
        )
        check(case, run_decode(case, forced_plan(4, 32, num_splits=4, min_tiles=2)))
    assert torch.all(prepare_decode_counters(case.batch.q.device) == 0)


def test_block_size_32_and_skipped_slot() -> None:
    """A real row whose slot is -1 still attends to its new key (from registers), and writes nothing."""
    case = make_decode_case([5, 70], num_kv_heads=2, group=2, head_dim=32, block_size=32, seed=3)
    slot = int(case.slot_mapping[1])
    case.slot_mapping[1] = -1
    out = run_decode(case, forced_plan(2, 32, num_splits=2))
    assert torch.isnan(case.batch.k_cache.view(-1, 2, 32)[slot]).all(), "a -1 slot was written"
    case.slot_mapping[1] = slot  # the reference: the same keys, the new one in place
    ref_out, _, _ = expected(case)
    torch.testing.assert_close(out[:2].double(), ref_out, atol=1e-5, rtol=1e-5)


def test_attention_step_decode_equals_two_launch_path() -> None:
    """attention_step on a decode batch (fused) and the prefill path's launches on the same inputs agree."""
    case = make_decode_case(
        [9, 33, 48], num_kv_heads=2, group=4, head_dim=32, pad_seqs=1, pad_rows=1, seed=7
    )
    twin = make_decode_case(
        [9, 33, 48], num_kv_heads=2, group=4, head_dim=32, pad_seqs=1, pad_rows=1, seed=7
    )
    b, r = case.batch, case.rotary
    out = torch.full_like(b.q, SENTINEL)
    for graph_safe in (True, False):
        attention_step(
            b.q,
            case.k,
            case.v,
            out,
            case.positions,
            r.cos_cache,
            r.sin_cache,
            b.k_cache,
            b.v_cache,
            case.slot_mapping,
            b.cu_seqlens_q,
            b.context_lens,
            b.block_tables,
            b.q.shape[2] ** -0.5,
            num_seqs=b.num_seqs,
            max_seqlen_q=1,
            max_seqlen_k=max(b.context_lens_cpu),
            graph_safe=graph_safe,
            cu_seqlens_q_cpu=b.cu_seqlens_q_cpu,
            context_lens_cpu=b.context_lens_cpu,
        )
        check(case, out)
    t = twin.batch
    q_rot = rope_write_kv(
        t.q,
        twin.k,
        twin.v,
        twin.positions,
        r.cos_cache,
        r.sin_cache,
        t.k_cache,
        t.v_cache,
        twin.slot_mapping,
    )
    out2 = torch.full_like(t.q, SENTINEL)
    unified_attention(
        q_rot,
        t.k_cache,
        t.v_cache,
        out2,
        t.cu_seqlens_q,
        t.context_lens,
        t.block_tables,
        t.q.shape[2] ** -0.5,
        num_seqs=t.num_seqs,
        max_seqlen_q=1,
        max_seqlen_k=48,
        graph_safe=False,
        cu_seqlens_q_cpu=t.cu_seqlens_q_cpu,
        context_lens_cpu=t.context_lens_cpu,
    )
    torch.testing.assert_close(out, out2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.k_cache.nan_to_num(), t.k_cache.nan_to_num(), atol=1e-6, rtol=1e-6)


def test_attention_step_with_two_rows_takes_the_general_path() -> None:
    """An MTP-verify batch (two rows per sequence) is rotary + write, then causal attention over both rows."""
    lens_q, lens_k = [2, 2], [10, 37]
    b = make_batch(
        lens_q, lens_k, num_kv_heads=2, group=2, head_dim=32, block_size=16, max_blocks=3, seed=4
    )
    rotary = RotaryEmbedding(32, max_position=64, theta=10000.0).to(DEVICE)
    k = torch.randn(4, 2, 32, device=DEVICE)
    v = torch.randn(4, 2, 32, device=DEVICE)
    positions = torch.tensor([8, 9, 35, 36], device=DEVICE)
    slots = torch.tensor(
        [
            int(b.block_tables[s, p // 16]) * 16 + p % 16
            for s, p in [(0, 8), (0, 9), (1, 35), (1, 36)]
        ],
        device=DEVICE,
    )
    out = torch.full_like(b.q, SENTINEL)
    attention_step(
        b.q,
        k,
        v,
        out,
        positions,
        rotary.cos_cache,
        rotary.sin_cache,
        b.k_cache,
        b.v_cache,
        slots,
        b.cu_seqlens_q,
        b.context_lens,
        b.block_tables,
        32**-0.5,
        num_seqs=2,
        max_seqlen_q=2,
        max_seqlen_k=37,
        graph_safe=True,
    )
    q_ref, k_ref = rotary(positions, b.q, k)
    ref_batch = dataclasses.replace(b, q=q_ref)
    ref_batch.k_cache.view(-1, 2, 32)[slots] = k_ref
    ref_batch.v_cache.view(-1, 2, 32)[slots] = v
    torch.testing.assert_close(
        out.double(), reference_attention(ref_batch, 32**-0.5), atol=1e-5, rtol=1e-5
    )


def test_plan_decode_splits_only_few_long_sequences() -> None:
    one = plan_decode(
        num_seqs=1, max_seqlen_k=8192, num_kv_heads=3, group=3, head_dim=64, num_sms=132
    )
    assert one.num_splits > 1 and one.block_m == 16 and one.min_tiles_per_split * one.tile_n >= 256
    many = plan_decode(
        num_seqs=64, max_seqlen_k=8192, num_kv_heads=8, group=4, head_dim=128, num_sms=132
    )
    assert many.num_splits == 1
    short = plan_decode(
        num_seqs=1, max_seqlen_k=200, num_kv_heads=8, group=4, head_dim=128, num_sms=132
    )
    assert short.num_splits == 1
    wide = plan_decode(
        num_seqs=1, max_seqlen_k=8192, num_kv_heads=1, group=16, head_dim=128, num_sms=132
    )
    assert wide.block_m == 16


def test_decode_rejects_mismatched_rows() -> None:
    case = make_decode_case([4], num_kv_heads=1, group=2, head_dim=32)
    b = case.batch
    with pytest.raises(ValueError, match="do not fit q"):
        decode_attention(
            b.q,
            case.k[:, :, :16],
            case.v,
            torch.empty_like(b.q),
            None,
            None,
            None,
            b.k_cache,
            b.v_cache,
            case.slot_mapping,
            b.cu_seqlens_q,
            b.context_lens,
            b.block_tables,
            1.0,
            forced_plan(2, 32, 1),
            num_seqs=1,
        )


def test_sequence_without_a_row_shifts_the_rows_after_it() -> None:
    """cu_seqlens_q [0, 1, 1, 2]: sequence 1 has no row, so sequence 2's row is 1, not 2 (the kernel
    guesses row = sequence and must reload), split and unsplit."""
    lens_k = [5, 7, 40]
    for num_splits in (1, 3):
        case = make_decode_case(lens_k, num_kv_heads=2, group=2, head_dim=32, seed=num_splits)
        b = case.batch
        keep = torch.tensor([0, 2], device=DEVICE)
        b.q = b.q[keep].contiguous()
        case.k, case.v = case.k[keep].contiguous(), case.v[keep].contiguous()
        case.positions, case.slot_mapping = (
            case.positions[keep].contiguous(),
            case.slot_mapping[keep].contiguous(),
        )
        b.cu_seqlens_q_cpu = [0, 1, 1, 2]
        b.cu_seqlens_q = torch.tensor(b.cu_seqlens_q_cpu, dtype=torch.int32, device=DEVICE)
        out = run_decode(case, forced_plan(2, 32, num_splits=num_splits))
        ref_out, ref_k, _ = expected(case)
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            b.k_cache.view(-1, 2, 32)[case.slot_mapping].double(), ref_k, atol=1e-5, rtol=1e-5
        )

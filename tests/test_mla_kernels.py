"""The MLA kernels (latent cache write, paged decode over the latent cache) against float64
references written here from the formula, on CUDA when present, else on CPU through Triton's
interpreter. Small dims (latent
32-64, rotary 8-32, non-powers of two among them) keep the interpreter fast; the GPU tier
(tests/gpu/test_mla_gpu.py) repeats the checks at real shapes.

Every cache slot no request owns holds NaN, and every output row starts as NaN: a kernel that reads
a foreign slot, or leaves a row unwritten, fails the test. Decode runs in fp32 and fp16 here (the
interpreter's bf16 tl.dot is wrong, triton-lang/triton#11584); the cache write in fp32 and bf16.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from kernel_device import DEVICE, assert_same_roundings

from atomrt.workers.kernels.attention import mla_decode
from atomrt.workers.kernels.attention.mla_decode import (
    MLADecodeLaunch,
    launch_mla_decode,
    mla_decode_attention,
    plan_mla_decode,
)
from atomrt.workers.kernels.attention.mla_write import mla_rope_write_kv_cache, mla_write_kv_cache
from atomrt.workers.kernels.attention.workspace import split_workspace
from atomrt.workers.layers.rotary import RotaryEmbedding

NAN = float("nan")


@dataclass
class MLABatch:
    """Requests' absorbed query rows over a paged latent cache, and their metadata."""

    q: torch.Tensor  # [R, H, L + P]; rows past the requests' hold NaN
    kv_cache: torch.Tensor  # [num_blocks, block_size, L + P]; unowned slots hold NaN
    block_table: torch.Tensor  # [B, max_blocks] int32, -1 past each request's blocks
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    kv_lora_rank: int
    scale: float

    def out(self) -> torch.Tensor:
        return torch.full(
            (*self.q.shape[:2], self.kv_lora_rank), NAN, dtype=self.q.dtype, device=self.q.device
        )


def make_mla_batch(
    lens_q: list[int],
    lens_k: list[int],
    *,
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    block_size: int = 16,
    extra_rows: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = DEVICE,
    max_blocks: int | None = None,
    table_pad: int = 0,
    num_blocks: int | None = None,
    seed: int = 0,
) -> MLABatch:
    """Random rows and cache, physical blocks shuffled across requests. A request of seq_len 0 is a
    padded one (its block-table row stays -1); `extra_rows` rows belong to no request;
    `table_pad` > 0 makes the block table a column slice of a wider one (row stride > max_blocks)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = kv_lora_rank + rope_dim
    blocks_per_req = [math.ceil(n / block_size) for n in lens_k]
    max_blocks = max_blocks or max(blocks_per_req + [1])
    num_blocks = num_blocks or sum(blocks_per_req) + 3
    physical = torch.randperm(num_blocks, generator=gen, device=device)
    wide = torch.full((len(lens_k), max_blocks + table_pad), -1, dtype=torch.int32, device=device)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    used = 0
    for b, (n, nb) in enumerate(zip(lens_k, blocks_per_req)):
        blocks = physical[used : used + nb]
        used += nb
        wide[b, :nb] = blocks.to(torch.int32)
        slots = blocks[:, None] * block_size + torch.arange(block_size, device=device)
        owned[slots.view(-1)[:n]] = True
    cache = torch.randn(num_blocks * block_size, width, generator=gen, device=device)
    cache[~owned] = NAN
    cu = [0]
    for n in lens_q:
        cu.append(cu[-1] + n)
    q = torch.full((cu[-1] + extra_rows, num_heads, width), NAN, device=device)
    q[: cu[-1]] = torch.randn(cu[-1], num_heads, width, generator=gen, device=device)
    return MLABatch(
        q=q.to(dtype),
        kv_cache=cache.view(num_blocks, block_size, width).to(dtype),
        block_table=wide[:, :max_blocks],
        seq_lens=torch.tensor(lens_k, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        kv_lora_rank=kv_lora_rank,
        scale=width**-0.5 * 1.3,  # not 1/sqrt(width): the model's scale carries YaRN's mscale
    )


def reference_mla(batch: MLABatch) -> torch.Tensor:
    """float64 out [R, H, L]: for row j of a request with n rows and seq_len s, the softmax over keys
    0..s - n + j of scale * q . K (K the whole cache row) times V (the row's first L columns); zero
    for a row that sees no key and for rows of no request."""
    q, cache, lora = batch.q.double(), batch.kv_cache.double(), batch.kv_lora_rank
    block_size = cache.shape[1]
    out = torch.zeros(*q.shape[:2], lora, dtype=torch.float64, device=q.device)
    cu = batch.cu_seqlens_q.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        num_q = cu[b + 1] - cu[b]
        pos = torch.arange(seq_len, device=q.device)
        keys = cache[batch.block_table[b, pos // block_size].long(), pos % block_size]
        for j in range(num_q):
            visible = seq_len - num_q + j + 1
            if visible <= 0:
                continue
            k = keys[:visible]  # [visible, L + P]
            p = torch.softmax(batch.scale * q[cu[b] + j] @ k.T, dim=-1)  # [H, visible]
            out[cu[b] + j] = p @ k[:, :lora]
    return out


def run_mla(
    batch: MLABatch, num_kv_splits: int | None = None, plan: MLADecodeLaunch | None = None
) -> torch.Tensor:
    out = batch.out()
    args = (batch.q, batch.kv_cache, batch.block_table, batch.seq_lens, batch.cu_seqlens_q)
    if plan is None:
        assert mla_decode_attention(*args, batch.scale, out, num_kv_splits) is out
    else:
        launch_mla_decode(plan, *args, batch.scale, out)
    return out


def check_mla(batch: MLABatch, out: torch.Tensor, atol: float = 2e-5, rtol: float = 2e-5) -> None:
    assert not torch.isnan(out).any(), (
        "NaN in the output: a row left unwritten or a foreign slot read"
    )
    torch.testing.assert_close(out.double(), reference_mla(batch), atol=atol, rtol=rtol)


def forced_plan(
    num_heads: int, kv_lora_rank: int, rope_dim: int, *, num_splits: int, block_q: int = 1,
    block_n: int = 16, num_row_blocks: int = 1, min_tiles_per_split: int = 1,
) -> MLADecodeLaunch:  # fmt: skip
    """A plan with small key tiles (several per short context) and the given splits."""
    heads_p = 1 << (num_heads - 1).bit_length()
    block_m = max(16, block_q * heads_p)
    return MLADecodeLaunch(
        heads_p=heads_p,
        block_q=block_m // heads_p,
        block_m=block_m,
        num_row_blocks=num_row_blocks,
        block_n=block_n,
        lora_p=max(16, 1 << (kv_lora_rank - 1).bit_length()),
        rope_p=max(16, 1 << (rope_dim - 1).bit_length()),
        num_splits=num_splits,
        min_tiles_per_split=min_tiles_per_split,
        num_warps=4,
        num_stages=2,
    )


@pytest.mark.parametrize(
    "src,dst",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
    ids=["fp32", "bf16", "fp32-to-bf16"],
)  # fmt: skip
def test_write_kv_cache(src: torch.dtype, dst: torch.dtype) -> None:
    """Row t lands at slot_mapping[t] (latent, then k_pe, in the cache's dtype) from views of one
    projection output, as the model splits it; slots < 0 and past the cache write nothing.
    Rounding to a narrower cache is exact on CUDA (round to nearest even, tests/gpu/test_mla_gpu.py);
    the interpreter's fp32 -> bf16 truncates, hence one bf16 step of tolerance for it here."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, lora, rope = 3, 16, 40, 8
    kv_a = torch.randn(6, lora + rope, generator=gen).to(
        DEVICE, src
    )  # [T, L + P]: rows L + P apart
    kv_c, k_pe = kv_a[:, :lora], kv_a[:, lora:]
    slots = torch.tensor([5, -1, 47, 16, num_blocks * block_size, 0], device=DEVICE)
    cache = torch.full((num_blocks, block_size, lora + rope), NAN, dtype=dst, device=DEVICE)
    mla_write_kv_cache(kv_c, k_pe, cache, slots)
    flat = cache.view(-1, lora + rope)
    written = torch.tensor([0, 2, 3, 5], device=DEVICE)
    expected = kv_a[written].to(dst)
    if src == dst:
        assert torch.equal(flat[slots[written]], expected)
    else:
        torch.testing.assert_close(flat[slots[written]], expected, atol=0, rtol=2**-7)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[written]] = False
    assert torch.isnan(flat[untouched].float()).all(), "a skipped row was written"


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half-split"])
def test_rope_write_kv_cache_is_the_rotary_then_the_write(interleaved: bool) -> None:
    """One launch gives RotaryEmbedding's rotated q_pe (every row: padded ones too) and k_pe
    with the same roundings (assert_same_roundings), and writes mla_write_kv_cache's rows of the rotated k_pe;
    slots < 0 and past the cache write nothing. q_pe as a strided view of the whole query, YaRN
    scaling in cos/sin as DeepSeek's rotary has it."""
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, heads, nope, lora, rope = 3, 16, 5, 12, 40, 16
    rotary = RotaryEmbedding(
        rope, 4096, 10000.0, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                              "mscale": 0.707, "mscale_all_dim": 0.707}, interleaved=interleaved,
    ).to(DEVICE)  # fmt: skip
    q = torch.randn(6, heads, nope + rope, generator=gen).to(DEVICE)
    kv_a = torch.randn(6, lora + rope, generator=gen).to(DEVICE)  # [T, L + P]: rows L + P apart
    kv_c, k_pe = kv_a[:, :lora], kv_a[:, lora:]
    positions = torch.tensor([0, 7, 300, 4095, 1, 64], device=DEVICE)
    slots = torch.tensor([5, -1, 47, 16, num_blocks * block_size, 0], device=DEVICE)
    cache = torch.full((num_blocks, block_size, lora + rope), NAN, device=DEVICE)
    q_rot = mla_rope_write_kv_cache(
        q[..., nope:], kv_c, k_pe, positions, rotary.cos_cache, rotary.sin_cache, interleaved,
        cache, slots,
    )  # fmt: skip
    want_q, want_k = rotary(positions, q[..., nope:], k_pe.unsqueeze(1))
    assert_same_roundings(q_rot, want_q)
    want = torch.full_like(cache, NAN)
    mla_write_kv_cache(kv_c, want_k.squeeze(1), want, slots)
    assert torch.equal(cache.isnan(), want.isnan())
    assert_same_roundings(cache.nan_to_num(), want.nan_to_num())


LENS_K = [1, 17, 40, 70]  # a first token (no earlier key), a block boundary, several key tiles


@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize(
    "num_heads,lora,rope", [(4, 32, 16), (3, 64, 32), (5, 40, 8)], ids=["h4-32+16", "h3-64+32", "h5-40+8"]
)  # fmt: skip
def test_decode_matches_reference(num_heads: int, lora: int, rope: int, num_splits: int) -> None:
    """One row per request, with a padded request (seq_len 0: zeros) and rows of no request
    (zeros), every split count, dims that are not powers of two."""
    batch = make_mla_batch(
        [1] * 5, LENS_K + [0], num_heads=num_heads, kv_lora_rank=lora, rope_dim=rope,
        extra_rows=2, seed=num_heads + num_splits,
    )  # fmt: skip
    check_mla(batch, run_mla(batch, plan=forced_plan(num_heads, lora, rope, num_splits=num_splits)))


@pytest.mark.parametrize("num_row_blocks", [1, 2])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_verify_rows_are_causal(num_splits: int, num_row_blocks: int) -> None:
    """Several query rows per request (a verify step; ragged, one request of a single row): row j
    sees keys up to seq_len - n + j. Sixteen heads leave room for two rows per tile, so a request
    of three or four rows has two query tiles: one program takes both in turn, or two take one
    each."""
    batch = make_mla_batch(
        [3, 1, 4, 2], [5, 33, 50, 2], num_heads=16, kv_lora_rank=32, rope_dim=16, seed=11
    )
    plan = forced_plan(16, 32, 16, num_splits=num_splits, block_q=2, num_row_blocks=num_row_blocks)
    assert plan.block_q == 2
    check_mla(batch, run_mla(batch, plan=plan))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_q_pe_apart_from_the_latent_query(num_splits: int) -> None:
    """The latent query as a bmm leaves it ([H, R, L] transposed to [R, H, L]) and its rotary part
    as a view of another tensor, q_pe=: the reference's attention of the whole rows, verify rows
    included, without their copy into one row."""
    lora, rope = 40, 8
    batch = make_mla_batch(
        [1, 3, 1], [5, 33, 0], num_heads=5, kv_lora_rank=lora, rope_dim=rope, extra_rows=1,
        seed=21,
    )  # fmt: skip
    q_latent = batch.q[..., :lora].transpose(0, 1).contiguous().transpose(0, 1)
    q_pe = torch.cat((batch.q[..., lora:], torch.randn(*batch.q.shape[:2], 3, device=DEVICE)), -1)[
        ..., :rope
    ]
    out = batch.out()
    args = (batch.kv_cache, batch.block_table, batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    mla_decode_attention(q_latent, *args, out, num_splits, q_pe=q_pe)
    check_mla(batch, out)


@pytest.mark.parametrize("prefetch_blocks", [True, False], ids=["prefetch", "in-order"])
def test_block_ids_ahead_or_in_order(prefetch_blocks: bool) -> None:
    """A tile's block ids loaded with the previous tile's rows (the default) or before its own:
    the reference's attention either way, verify rows and splits included, block boundaries
    inside the tiles (block_size 16, 16-key tiles over 2-4 tiles per split)."""
    batch = make_mla_batch(
        [3, 1, 2], [70, 33, 50], num_heads=4, kv_lora_rank=32, rope_dim=16, seed=31
    )
    plan = dataclasses.replace(
        forced_plan(4, 32, 16, num_splits=3), prefetch_blocks=prefetch_blocks
    )
    check_mla(batch, run_mla(batch, plan=plan))


def test_long_runs_of_rows_share_out_their_tiles() -> None:
    """A request of many rows (as a prefill chunk has) beside one of a single row: the default plan
    gives the long one's query tiles programs of their own, each taking every n-th."""
    batch = make_mla_batch([37, 1], [60, 90], num_heads=4, kv_lora_rank=32, rope_dim=16, seed=12)
    plan = plan_mla_decode(2, 38, 90, 4, 32, 16, num_sms=4)
    assert (plan.block_q, plan.num_row_blocks) == (8, 3)  # 5 tiles: programs take 2, 2, 1
    check_mla(batch, run_mla(batch))


def test_padded_requests_leave_the_real_ones_exact() -> None:
    """Padded requests (seq_len 0, one row each) and a request of no rows among real ones: the real
    rows come out bit for bit as without them, the padded ones zero."""
    lens_q, lens_k = [1, 2, 1], [30, 45, 9]
    alone = make_mla_batch(lens_q, lens_k, num_heads=4, kv_lora_rank=32, rope_dim=16, seed=5)
    mixed = make_mla_batch(
        [1, 1, 2, 0, 1, 1], [0, 30, 45, 12, 0, 9], num_heads=4, kv_lora_rank=32, rope_dim=16
    )
    # the same rows and keys: request b of `alone` is request keep[b] of `mixed`
    keep, rows = [1, 2, 5], {0: [1], 1: [2, 3], 2: [5]}
    mixed.q[[1, 2, 3, 5]] = alone.q
    for b, m in enumerate(keep):
        mixed.kv_cache.view(-1, 48)[_slots(mixed, m)] = alone.kv_cache.view(-1, 48)[
            _slots(alone, b)
        ]
    plan = forced_plan(4, 32, 16, num_splits=2)
    out_alone, out_mixed = run_mla(alone, plan=plan), run_mla(mixed, plan=plan)
    check_mla(mixed, out_mixed)
    for b in range(len(keep)):
        a0, a1 = alone.cu_seqlens_q[b], alone.cu_seqlens_q[b + 1]
        assert torch.equal(out_mixed[rows[b]], out_alone[a0:a1])
    assert torch.all(out_mixed[[0, 4]] == 0)


def _slots(batch: MLABatch, b: int) -> torch.Tensor:
    """The cache slots of request b's keys, in order."""
    pos = torch.arange(int(batch.seq_lens[b]), device=batch.block_table.device)
    return batch.block_table[b, pos // batch.kv_cache.shape[1]].long() * batch.kv_cache.shape[1] + (
        pos % batch.kv_cache.shape[1]
    )


def test_fp16_cache() -> None:
    """fp16 q and cache (the products on tensor cores, fp32 accumulation) against float64 of the
    same rounded inputs. bf16 decode runs on the GPU tier only: the interpreter multiplies bf16
    tl.dot operands as raw bit patterns (triton-lang/triton#11584)."""
    batch = make_mla_batch(
        [1, 2, 1], [9, 40, 66], num_heads=4, kv_lora_rank=64, rope_dim=32, dtype=torch.float16
    )
    check_mla(batch, run_mla(batch, num_kv_splits=2), atol=1e-2, rtol=1e-2)


def test_block_size_32_and_a_strided_block_table() -> None:
    """Cache blocks of 32 (a key tile of 16 inside one block) and a block table that is a column
    slice of a wider one: its row stride, not max_blocks, steps between requests."""
    batch = make_mla_batch(
        [1, 1, 1], [31, 33, 64], num_heads=2, kv_lora_rank=32, rope_dim=16, block_size=32,
        table_pad=3, seed=4,
    )  # fmt: skip
    assert not batch.block_table.is_contiguous()
    check_mla(batch, run_mla(batch, plan=forced_plan(2, 32, 16, num_splits=2)))


def poison_split_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLA decode's split workspace (partials, m, l) starts as NaN on every launch: what a
    launch reads without writing it first shows in its output."""

    def poisoned(*args):
        partial, m, l = split_workspace(*args)
        for t in (partial, m, l):
            t.fill_(NAN)
        return partial, m, l

    monkeypatch.setattr(mla_decode, "kept_split_workspace", poisoned)


def test_the_live_context_decides_the_working_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four splits of at least two 16-key tiles: contexts of one or two tiles stay in one split,
    longer ones spread over more. The split workspace starts as NaN: every m and l must be written
    (idle splits leave l = 0), and the merge reads no partial output of a split that saw no key."""
    poison_split_workspace(monkeypatch)
    batch = make_mla_batch(
        [1] * 6, [3, 30, 33, 100, 150, 0], num_heads=4, kv_lora_rank=32, rope_dim=16, seed=6
    )
    plan = forced_plan(4, 32, 16, num_splits=4, min_tiles_per_split=2)
    check_mla(batch, run_mla(batch, plan=plan))


def test_more_splits_than_a_32_wide_merge() -> None:
    """A lone long request over 40 splits of one 16-key tile each: the merge takes a 64-wide split
    tile (and narrower latent chunks), and the splits past the live context stay idle."""
    batch = make_mla_batch([1, 1], [600, 50], num_heads=4, kv_lora_rank=64, rope_dim=16, seed=21)
    plan = forced_plan(4, 64, 16, num_splits=40, min_tiles_per_split=1)
    check_mla(batch, run_mla(batch, plan=plan))


def test_keys_past_the_block_table_are_never_read() -> None:
    """A seq_len past the block table's capacity attends to the keys the table holds and reads no
    column past it (the wider table's next columns name an unowned block, all NaN)."""
    batch = make_mla_batch([1, 1], [32, 20], num_heads=4, kv_lora_rank=32, rope_dim=16, table_pad=2)
    # a block no request owns (the physical order is the device generator's: any may be free)
    unowned = next(b for b in range(batch.kv_cache.shape[0]) if batch.kv_cache[b].isnan().all())
    batch.block_table.as_strided((2, 4), (batch.block_table.stride(0), 1))[:, 2:] = unowned
    one, two = (forced_plan(4, 32, 16, num_splits=n) for n in (1, 2))
    out, out_split = run_mla(batch, plan=one), run_mla(batch, plan=two)
    batch.seq_lens[0] = 40  # 8 keys past the table's 2 blocks of 16
    # one split walks the same two tiles, then a third that masks every key: bit for bit
    assert torch.equal(run_mla(batch, plan=one), out)
    # two splits cut 40 keys' three tiles as (2, 1), not 32 keys' two as (1, 1): the merge sums
    # in another order, so equal to rounding (a NaN key read would poison the row)
    past = run_mla(batch, plan=two)
    assert past.isfinite().all()
    torch.testing.assert_close(past, out_split, rtol=1e-5, atol=1e-6)
    batch.seq_lens[0] = 32
    check_mla(batch, out)
    check_mla(batch, out_split)


def test_planned_launch_replays_with_new_lengths() -> None:
    """What a CUDA-graph replay does: one launch (its grid and plan fixed) repeated with new lengths
    and rows written into the same tensors: fewer keys, a request turned padded."""
    batch = make_mla_batch(
        [1, 1, 1], [60, 64, 20], num_heads=4, kv_lora_rank=32, rope_dim=16, max_blocks=4, seed=8
    )
    forced = forced_plan(4, 32, 16, num_splits=3)
    check_mla(batch, run_mla(batch, plan=forced))
    batch.seq_lens.copy_(torch.tensor([7, 0, 20], dtype=torch.int32, device=DEVICE))
    batch.q[1].normal_()
    check_mla(batch, run_mla(batch, plan=forced))
    assert torch.all(run_mla(batch, plan=forced)[1] == 0)


def test_default_plan_matches_reference() -> None:
    """num_kv_splits=None: the wrapper plans from shapes (the interpreter's stand-in SM count
    splits a small batch)."""
    batch = make_mla_batch(
        [1, 1], [100, 260], num_heads=4, kv_lora_rank=32, rope_dim=16, max_blocks=20, seed=9
    )
    check_mla(batch, run_mla(batch))


@pytest.mark.parametrize("num_heads", [16, 20])
def test_model_dims_through_the_interpreter(num_heads: int) -> None:
    """The model's latent 512 + rotary 64 at DeepSeek-V2-Lite's and GLM-4.7-Flash's head counts,
    decode and verify rows and a padded request, with the wrapper's own plan (fp32: the
    interpreter's bf16 dot is wrong)."""
    batch = make_mla_batch(
        [1, 3, 1, 1], [70, 130, 0, 200], num_heads=num_heads, kv_lora_rank=512, rope_dim=64,
        extra_rows=1, max_blocks=16, seed=num_heads,
    )  # fmt: skip
    check_mla(batch, run_mla(batch))
    check_mla(batch, run_mla(batch, num_kv_splits=3))


def test_plan_at_model_shapes() -> None:
    """The planner at real shapes (H200: 132 SMs; latent 512 + rotary 64)."""
    v2_lite = plan_mla_decode(1, 1, 8192, 16, 512, 64, 132)
    assert (v2_lite.heads_p, v2_lite.block_m, v2_lite.block_q) == (16, 16, 1)
    assert (v2_lite.lora_p, v2_lite.rope_p) == (512, 64)
    # a lone request spreads its 8k keys over about one split per SM, each of 64 keys or more
    assert v2_lite.num_splits == 128 and 8192 // v2_lite.num_splits >= 64
    # at most 2 programs per SM, all resident in one wave: 128 x 2 and 32 x 8 of 264
    assert plan_mla_decode(128, 128, 8192, 16, 512, 64, 132).num_splits == 2
    assert plan_mla_decode(32, 32, 8192, 16, 512, 64, 132).num_splits == 8
    assert plan_mla_decode(256, 256, 8192, 16, 512, 64, 132).num_splits == 1  # SMs all busy
    glm = plan_mla_decode(8, 8, 8192, 20, 512, 64, 132)
    assert (glm.heads_p, glm.block_m) == (32, 32) and glm.num_splits > 1
    v3 = plan_mla_decode(8, 8, 8192, 128, 512, 64, 132)
    assert v3.heads_p == 32 and v3.block_m == 32
    verify = plan_mla_decode(8, 32, 8192, 16, 512, 64, 132)  # four rows per request
    assert (verify.block_q, verify.block_m, verify.num_row_blocks) == (2, 32, 2)
    assert v2_lite.num_row_blocks == 1 and glm.num_row_blocks == 1
    short = plan_mla_decode(1, 1, 64, 16, 512, 64, 132)
    assert short.num_splits == 1


def test_rejects_bad_arguments() -> None:
    batch = make_mla_batch([1], [5], num_heads=2, kv_lora_rank=32, rope_dim=16)
    args = (batch.q, batch.kv_cache, batch.block_table, batch.seq_lens, batch.cu_seqlens_q)
    out = batch.out()
    with pytest.raises(ValueError, match="do not fit"):
        mla_decode_attention(batch.q[:, :, :40], *args[1:], 1.0, out)
    with pytest.raises(ValueError, match="do not fit"):
        mla_decode_attention(*args, 1.0, out[:, :1])
    with pytest.raises(ValueError, match="describe B requests"):
        mla_decode_attention(*args[:4], batch.cu_seqlens_q[:1], 1.0, out)
    with pytest.raises(ValueError, match="must hold integers"):
        mla_decode_attention(*args[:3], batch.seq_lens.float(), *args[4:], 1.0, out)
    for bad in (0, 129, True, 2.0):
        with pytest.raises(ValueError, match="num_kv_splits"):
            mla_decode_attention(*args, 1.0, out, bad)
    with pytest.raises(ValueError, match="out must be contiguous in its last dimension"):
        mla_decode_attention(*args, 1.0, batch.out().transpose(0, 2).contiguous().transpose(0, 2))
    with pytest.raises(ValueError, match="with q_pe, want q"):
        mla_decode_attention(*args, 1.0, out, q_pe=batch.q[..., 32:])  # q still has its q_pe
    with pytest.raises(ValueError, match="with q_pe, want q"):
        mla_decode_attention(batch.q[..., :32], *args[1:], 1.0, out, q_pe=batch.q[:, :1, 32:])
    with pytest.raises(ValueError, match="block_table rows must be contiguous"):
        strided = torch.zeros(1, 2 * batch.block_table.shape[1], dtype=torch.int32, device=DEVICE)
        strided = strided[:, ::2]
        mla_decode_attention(*args[:2], strided, *args[3:], 1.0, out)
    with pytest.raises(ValueError, match="slot_mapping must hold integers"):
        mla_write_kv_cache(
            torch.zeros(1, 32, device=DEVICE), torch.zeros(1, 16, device=DEVICE), batch.kv_cache,
            torch.zeros(1, device=DEVICE),
        )  # fmt: skip
    with pytest.raises(ValueError, match="do not fit cache rows"):
        mla_write_kv_cache(
            torch.zeros(1, 32, device=DEVICE),
            torch.zeros(1, 8, device=DEVICE),
            batch.kv_cache,
            torch.zeros(1, dtype=torch.long, device=DEVICE),
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        mla_write_kv_cache(
            torch.zeros(2, 32, device=DEVICE),
            torch.zeros(2, 16, device=DEVICE),
            batch.kv_cache,
            torch.zeros(1, dtype=torch.long, device=DEVICE),
        )


@pytest.mark.parametrize("merge_in_kernel", [False, True], ids=["merge-launch", "merge-in-kernel"])
def test_bf16_partials_stay_within_their_rounding(
    merge_in_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """partials_bf16: the splits' unnormalised outputs stored in bfloat16 (m and l in fp32), merged
    by the merge launch or in the kernel. The workspace starts as NaN (a partial read unwritten
    shows), idle splits included; the result is the float64 reference's to bf16's rounding of the
    partials (2^-9 relative, 2^-8 where the interpreter truncates), decode and verify rows."""
    poison_split_workspace(monkeypatch)
    batch = make_mla_batch(
        [1, 2, 1], [150, 97, 0], num_heads=4, kv_lora_rank=48, rope_dim=16, extra_rows=1, seed=31
    )
    plan = dataclasses.replace(
        forced_plan(4, 48, 16, num_splits=5, block_q=2),
        partials_bf16=True,
        merge_in_kernel=merge_in_kernel,
    )
    out = run_mla(batch, plan=plan)
    check_mla(batch, out, atol=1e-2, rtol=1e-2)
    # the rounding is the partials' alone: fp32 partials meet the tight bound
    check_mla(batch, run_mla(batch, plan=dataclasses.replace(plan, partials_bf16=False)))


@pytest.mark.parametrize(
    "merge_splits,merge_regs", [(8, 16384), (2, 512)], ids=["wide-steps", "narrow-chunks"]
)
def test_merge_in_kernel_steps(
    merge_splits: int, merge_regs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """merge_in_kernel at other merge steps: 8 splits a step over all 64 latent columns (more
    working splits than a step, and fewer), and 2 splits a step over 16-column chunks of a 48-wide
    latent (the last chunk part padding); the workspace starts as NaN."""
    poison_split_workspace(monkeypatch)
    batch = make_mla_batch(
        [1, 1, 2], [190, 40, 120], num_heads=4, kv_lora_rank=48, rope_dim=16, extra_rows=1, seed=32
    )
    plan = dataclasses.replace(
        forced_plan(4, 48, 16, num_splits=11, block_q=2),
        merge_in_kernel=True,
        merge_splits=merge_splits,
        merge_regs=merge_regs,
    )
    check_mla(batch, run_mla(batch, plan=plan))


@pytest.mark.parametrize(
    "num_splits,merge_in_kernel",
    [(1, False), (3, False), (3, True)],
    ids=["one", "launch", "kernel"],
)
def test_rows_ahead_of_their_tile(
    num_splits: int, merge_in_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prefetch_kv: each key tile's rows loaded during the tile before. The reference's attention
    with one split and with several (merged by a launch or in the kernel), verify rows, a context
    that ends inside a tile, one shorter than a split's tiles and a padded request; the workspace
    starts as NaN, and unowned cache slots hold NaN: the tile past a split's last loads nothing."""
    poison_split_workspace(monkeypatch)
    batch = make_mla_batch(
        [3, 1, 2, 1], [70, 33, 50, 0], num_heads=4, kv_lora_rank=40, rope_dim=16, extra_rows=1,
        seed=33,
    )  # fmt: skip
    plan = dataclasses.replace(
        forced_plan(4, 40, 16, num_splits=num_splits, block_q=2),
        prefetch_kv=True,
        merge_in_kernel=merge_in_kernel,
    )
    out = run_mla(batch, plan=plan)
    check_mla(batch, out)
    # the same sums in the same order as the rows loaded in turn: bit for bit
    assert torch.equal(out, run_mla(batch, plan=dataclasses.replace(plan, prefetch_kv=False)))


def test_half_the_heads_a_tile() -> None:
    """Two head tiles a request (heads_p 4 of 8 heads, 4 rows a tile): each program reads the
    same keys for its heads; verify rows, splits merged by a launch, bf16 partials."""
    batch = make_mla_batch(
        [3, 1, 1], [90, 40, 0], num_heads=8, kv_lora_rank=32, rope_dim=16, extra_rows=1, seed=34
    )
    plan = dataclasses.replace(
        forced_plan(8, 32, 16, num_splits=3), heads_p=4, block_q=4, block_m=16
    )
    check_mla(batch, run_mla(batch, plan=plan))
    bf16 = run_mla(batch, plan=dataclasses.replace(plan, partials_bf16=True))
    check_mla(batch, bf16, atol=1e-2, rtol=1e-2)

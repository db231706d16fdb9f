"""The MLA decode kernel's own split merge (plan field merge_in_kernel): the last split program of
each (request, program column) to finish merges the splits, and no merge launch runs. Checked against
the float64 reference of tests/test_mla_kernels.py, on CUDA when present, else on CPU through
Triton's interpreter; the split workspace starts as NaN, so a partial the merge should not read, or
one a split never wrote, shows. The split counters must be back at zero after every launch: a
CUDA-graph replay reuses them without a reset.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_device import DEVICE
from test_mla_kernels import (
    check_mla,
    forced_plan,
    make_mla_batch,
    poison_split_workspace,
    reference_mla,
    run_mla,
)

from atomrt.workers.kernels.attention import mla_decode
from atomrt.workers.kernels.attention.decode_attention import (
    DECODE_COUNTERS,
    prepare_decode_counters,
)
from atomrt.workers.kernels.attention.mla_decode import launch_mla_decode, mla_decode_attention


@pytest.fixture(autouse=True)
def poisoned_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    poison_split_workspace(monkeypatch)


def merging_plan(num_heads: int, lora: int, rope: int, **kw) -> mla_decode.MLADecodeLaunch:
    return dataclasses.replace(forced_plan(num_heads, lora, rope, **kw), merge_in_kernel=True)


def counters_are_zero() -> bool:
    return bool(torch.all(prepare_decode_counters(torch.device(DEVICE)) == 0))


@pytest.mark.parametrize(
    "lens_k,num_splits,min_tiles",
    [
        ([3, 100, 250], 7, 1),  # short: one working split; long: all seven
        ([40, 600], 40, 1),  # a lone long request over many splits, more than one merge step
        ([30, 33, 150, 0], 4, 2),  # contexts of one, three and ten tiles; a padded request
        ([17], 2, 1),  # two splits, the second of one key
    ],
    ids=["mixed", "many-splits", "min-tiles", "two"],
)
def test_decode_matches_reference(lens_k: list[int], num_splits: int, min_tiles: int) -> None:
    batch = make_mla_batch(
        [1] * len(lens_k), lens_k, num_heads=4, kv_lora_rank=64, rope_dim=16, seed=len(lens_k)
    )
    plan = merging_plan(4, 64, 16, num_splits=num_splits, min_tiles_per_split=min_tiles)
    check_mla(batch, run_mla(batch, plan=plan))
    assert counters_are_zero(), "the merging program left its counter set"


@pytest.mark.parametrize("num_row_blocks", [1, 2])
def test_verify_rows_are_causal(num_row_blocks: int) -> None:
    """k + 1 rows per request over several query tiles a program: its merge covers each of them;
    early rows see fewer keys, so some splits hold nothing for them (never read)."""
    batch = make_mla_batch(
        [5, 3, 1], [70, 20, 45], num_heads=4, kv_lora_rank=32, rope_dim=16, extra_rows=2, seed=4
    )
    plan = merging_plan(4, 32, 16, num_splits=3, num_row_blocks=num_row_blocks)
    assert plan.block_q == 4  # 16 tile rows over 4 heads: a 5-row request takes two tiles
    check_mla(batch, run_mla(batch, plan=plan))
    assert counters_are_zero()


def test_repeated_launches_reuse_the_counters() -> None:
    """What a CUDA-graph replay does: the same launch with new lengths in the same tensors, the
    counters never reset from the host."""
    batch = make_mla_batch(
        [1, 1, 1], [60, 64, 20], num_heads=4, kv_lora_rank=32, rope_dim=16, max_blocks=4, seed=8
    )
    plan = merging_plan(4, 32, 16, num_splits=3)
    for lens in ([60, 64, 20], [7, 0, 20], [60, 33, 1], [60, 64, 20]):
        batch.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32, device=DEVICE))
        out = run_mla(batch, plan=plan)
        check_mla(batch, out)
        assert counters_are_zero()
    assert torch.all(out[1] != 0)


def test_a_microbatch_takes_its_own_counters() -> None:
    """ubatch=1 bumps the second counter region; the first stays untouched (zero) throughout."""
    batch = make_mla_batch([1, 1], [90, 50], num_heads=4, kv_lora_rank=32, rope_dim=16, seed=2)
    counters = prepare_decode_counters(torch.device(DEVICE))
    counters[DECODE_COUNTERS + 1] = 7  # a stray count of the second region's request 1
    out = batch.out()
    args = (batch.q, batch.kv_cache, batch.block_table, batch.seq_lens, batch.cu_seqlens_q)
    launch_mla_decode(merging_plan(4, 32, 16, num_splits=3), *args, batch.scale, out, ubatch=1)
    # request 1's tickets counted from 7: none was the last, so its output was never merged
    assert torch.isnan(out[1]).all()
    counters[DECODE_COUNTERS + 1] = 0
    assert counters_are_zero()
    check_mla(batch, run_mla(batch, plan=merging_plan(4, 32, 16, num_splits=3)))


def test_more_columns_than_counters_keep_the_merge_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mla_decode, "DECODE_COUNTERS", 2)
    batch = make_mla_batch([1, 1, 1], [90, 50, 33], num_heads=4, kv_lora_rank=32, rope_dim=16)
    check_mla(batch, run_mla(batch, plan=merging_plan(4, 32, 16, num_splits=3)))
    assert counters_are_zero()


def test_ubatch_is_checked() -> None:
    batch = make_mla_batch([1], [20], num_heads=4, kv_lora_rank=32, rope_dim=16)
    args = (batch.q, batch.kv_cache, batch.block_table, batch.seq_lens, batch.cu_seqlens_q)
    with pytest.raises(ValueError, match="ubatch"):
        mla_decode_attention(*args, batch.scale, batch.out(), ubatch=2)


def test_the_plan_rule_merges_few_splits_in_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """MERGE_IN_KERNEL_MAX_SPLITS: plans (and a num_kv_splits given) of at most that many splits
    merge in the kernel, more keep the merge launch; what the wrapper then runs is exact."""
    caches = (mla_decode.plan_mla_decode, mla_decode._with_splits)
    monkeypatch.setattr(mla_decode, "MERGE_IN_KERNEL_MAX_SPLITS", 8)
    for cache in caches:
        cache.cache_clear()
    try:
        few = mla_decode.plan_mla_decode(32, 32, 8192, 16, 512, 64, 132)
        many = mla_decode.plan_mla_decode(1, 1, 8192, 16, 512, 64, 132)
        assert (few.num_splits, few.merge_in_kernel) == (8, True)
        assert (many.num_splits, many.merge_in_kernel) == (128, False)
        assert mla_decode._with_splits(many, 3).merge_in_kernel
        assert not mla_decode._with_splits(few, 9).merge_in_kernel
        batch = make_mla_batch([1, 1], [90, 50], num_heads=4, kv_lora_rank=32, rope_dim=16)
        with monkeypatch.context() as m:
            m.setattr(mla_decode, "launch", lambda *a, **k: pytest.fail("a merge launch ran"))
            check_mla(batch, run_mla(batch, num_kv_splits=3))
        assert counters_are_zero()
    finally:
        for cache in caches:
            cache.cache_clear()


def test_a_scaled_e4m3_cache() -> None:
    """kv_cache_dtype fp8: each split's partials carry the cache's scale, and so the merge."""
    batch = make_mla_batch([1, 3], [40, 66], num_heads=4, kv_lora_rank=64, rope_dim=32, seed=5)
    k_scale = 0.0123
    batch.kv_cache = (2 * batch.kv_cache).to(torch.float8_e4m3fn)
    scales = torch.tensor([k_scale, 0.5], dtype=torch.float32, device=DEVICE)
    out = batch.out()
    args = (batch.q, batch.kv_cache, batch.block_table, batch.seq_lens, batch.cu_seqlens_q)
    plan = merging_plan(4, 64, 32, num_splits=3)
    launch_mla_decode(plan, *args, batch.scale, out, kv_scales=scales)
    ref = reference_mla(dataclasses.replace(batch, kv_cache=batch.kv_cache.double() * k_scale))
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert counters_are_zero()


def test_head_tiles_merge_apart() -> None:
    """Half the heads a tile: each (request, head tile) has its own counter and merging program."""
    batch = make_mla_batch([1, 2], [90, 50], num_heads=4, kv_lora_rank=32, rope_dim=16, seed=12)
    plan = dataclasses.replace(
        merging_plan(4, 32, 16, num_splits=3), heads_p=2, block_m=16, block_q=8
    )
    check_mla(batch, run_mla(batch, plan=plan))
    assert counters_are_zero()

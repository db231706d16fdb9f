"""DecodeLaunch.early_kv: the first K/V tile loaded before the rotary's round trip (with
prefetch_kv) changes when the loads go out, never the attention: the float64 reference over
contexts of no cached key, one tile and several, split or not (through the interpreter on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode_attention import LENS, check, forced_plan, make_decode_case, run_decode

from atomrt.workers.kernels.attention.decode_attention import prepare_decode_counters


@pytest.mark.parametrize("num_splits", [1, 3])
def test_early_first_tile_matches_reference(num_splits: int) -> None:
    case = make_decode_case(
        LENS, num_kv_heads=2, group=3, head_dim=32, pad_seqs=1, pad_rows=2, seed=50 + num_splits
    )
    plan = forced_plan(3, 32, num_splits)
    plan = dataclasses.replace(plan, prefetch_kv=True, early_kv=True)
    check(case, run_decode(case, plan))
    assert torch.all(prepare_decode_counters(case.batch.q.device) == 0), "split counters not reset"


def test_early_kv_names_prefetch_kv() -> None:
    plan = forced_plan(3, 32, 1)
    with pytest.raises(ValueError, match="set prefetch_kv"):
        dataclasses.replace(plan, early_kv=True)

"""The one-launch decode kernel over an e4m3 cache with a bfloat16 q: its products are float16 by
default (e4m3 keys and values widened to float16, q scaled by a power of two into float16's range),
against a float64 reference over the dequantized cache, also at q values past float16's largest (a
q copied into float16 as it is would give inf, and NaN scores).

On CPU the kernel runs through Triton's interpreter at tiny shapes. The interpreter's bfloat16
tl.dot is wrong (its products come out ~1e10), so the bfloat16 products the plan can still ask for
(fp8_f16_products=False) are checked against the float16 ones on the GPU only
(tests/gpu/test_fp8_kv_decode_gpu.py, which runs this module's checks at Llama-3.1-8B's shape).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_device import DEVICE
from test_decode_attention import expected, forced_plan, make_decode_case
from test_kernels import SENTINEL

from atomrt.workers.kernels.attention.decode_attention import (
    FP8_PLAN_D128,
    FP8_SPLIT_PLAN_D128,
    DecodeLaunch,
    decode_attention,
    plan_decode,
)

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.0123, 0.0371
ROOT = Path(__file__).resolve().parents[1]
LENS = [1, 2, 17, 40]  # a first token (no cached key), a block boundary, several tiles


def _e4m3(shape: tuple[int, ...], seed: int, device: str) -> torch.Tensor:
    """Random float32 values that e4m3 holds exactly (~N(0, 4))."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return (2 * torch.randn(shape, generator=gen, device=device)).to(FP8).float()


def run_fp8_decode(
    q_scale: float,
    f16_products: bool,
    num_splits: int,
    *,
    lens: list[int] = LENS,
    num_kv_heads: int = 2,
    group: int = 4,
    head_dim: int = 32,
    tile_n: int = 16,
    device: str = DEVICE,
    prefetch_kv: bool | None = None,
    widen_v_first: bool | None = None,
    plan: DecodeLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, float64 reference) of the real rows of a decode step over a scaled e4m3
    cache with a bfloat16 q of about `q_scale` in magnitude. `plan` (default: forced_plan's)
    keeps its prefetch_kv and widen_v_first unless they are given."""
    case = make_decode_case(
        lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, pad_seqs=1, pad_rows=2,
        rope=False, seed=11, device=device,
    )  # fmt: skip
    b = case.batch
    q = (b.q * q_scale).to(torch.bfloat16)
    b = dataclasses.replace(
        b, q=q, k_cache=(2 * b.k_cache).to(FP8), v_cache=(2 * b.v_cache).to(FP8)
    )
    k_new = (_e4m3(tuple(case.k.shape), 12, device) * K_SCALE).to(torch.bfloat16)
    v_new = (_e4m3(tuple(case.v.shape), 13, device) * V_SCALE).to(torch.bfloat16)
    case = dataclasses.replace(case, batch=b, k=k_new, v=v_new)
    out = torch.full_like(q, SENTINEL)
    plan = dataclasses.replace(
        plan or forced_plan(group, head_dim, num_splits, tile_n=tile_n),
        fp8_f16_products=f16_products,
    )
    if prefetch_kv is not None:
        plan = dataclasses.replace(plan, prefetch_kv=prefetch_kv)
    if widen_v_first is not None:
        plan = dataclasses.replace(plan, widen_v_first=widen_v_first)
    decode_attention(
        q, case.k, case.v, out, None, None, None, b.k_cache, b.v_cache, case.slot_mapping,
        b.cu_seqlens_q, b.context_lens, b.block_tables, head_dim**-0.5, plan, num_seqs=b.num_seqs,
        kv_scales=torch.tensor([K_SCALE, V_SCALE], dtype=torch.float32, device=device),
    )  # fmt: skip
    ref_batch = dataclasses.replace(
        b, k_cache=b.k_cache.double() * K_SCALE, v_cache=b.v_cache.double() * V_SCALE
    )
    ref, _, _ = expected(dataclasses.replace(case, batch=ref_batch))
    n = b.num_real_rows
    assert torch.all(out[n:] == SENTINEL), "padded output rows were written"
    return out[:n].double(), ref


@pytest.mark.parametrize("widen_v_first", [False, True], ids=["", "widen-v"])
@pytest.mark.parametrize("prefetch_kv", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_f16_products_match_a_float64_reference(
    num_splits: int, prefetch_kv: bool, widen_v_first: bool
) -> None:
    """float16 products give float64 attention over the cache times its scales, to the bfloat16
    output's rounding, split or not, with the e4m3 tiles loaded an iteration ahead or not, and V
    tiles widened before their layout change or after."""
    out, ref = run_fp8_decode(
        1.0, True, num_splits, prefetch_kv=prefetch_kv, widen_v_first=widen_v_first,
        tile_n=32 if widen_v_first else 16,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=8e-3, atol=8e-3)


def test_widening_v_first_refuses_16_key_tiles() -> None:
    """Compiled for an H100, V tiles of 16 keys widened first gave wrong attention: a plan refuses
    the pair, naming both."""
    plan = forced_plan(4, 32, 1, tile_n=16)
    with pytest.raises(ValueError, match="widen_v_first needs tiles of at least 32 keys"):
        dataclasses.replace(plan, widen_v_first=True)


def test_widening_v_first_is_the_same_attention() -> None:
    """widen_v_first only moves where V's widening happens: under the Triton interpreter the
    output is the unwidened plan's, bit for bit, at head_dim 128 over contexts of several 64-key
    tiles (compiled for a GPU the V products may be ordered differently: equal to float16
    rounding, tests/gpu/test_fp8_kv_decode_gpu.py)."""
    plan = dataclasses.replace(plan_decode(32, 8192, 8, 4, 128, 132, True), min_tiles_per_split=1)
    kw = dict(lens=[1, 65, 200], num_kv_heads=2, head_dim=128, plan=plan)
    late, ref = run_fp8_decode(1.0, True, 1, widen_v_first=False, **kw)
    early, _ = run_fp8_decode(1.0, True, 1, widen_v_first=True, **kw)
    if DEVICE == "cpu":
        assert torch.equal(late, early)
    else:  # measured 1e-5 to 6e-5 apart on an H100
        torch.testing.assert_close(late, early, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(early, ref, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("q_scale", [3.0e3, 2.0e6], ids=["in-f16-range", "past-f16-max"])
def test_q_past_float16_range_keeps_exact_scores(q_scale: float) -> None:
    """q values past float16's largest (65504) are scaled down by a power of two before the
    float16 copy: finite scores and the reference's attention (almost one-hot at these sizes)."""
    out, ref = run_fp8_decode(q_scale, True, 1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=8e-3, atol=8e-3)


def test_an_e4m3_cache_plans_its_own_tiles_at_head_dim_128() -> None:
    """At head_dim 128 an e4m3 cache takes FP8_PLAN_D128's tiles, warps, stages and V widening
    (FP8_SPLIT_PLAN_D128's at bs 1; the bfloat16 cache's plan: 128-key tiles in 2 stages; at
    other head dims the e4m3 cache takes it too), and those give the reference's attention over
    contexts of several tiles, split and not."""
    bf16 = plan_decode(32, 8192, 8, 4, 128, 132)
    fp8 = plan_decode(32, 8192, 8, 4, 128, 132, fp8_cache=True)
    assert (bf16.tile_n, bf16.num_stages, bf16.widen_v_first) == (128, 2, False)
    tile_n, warps, stages, widen_v_first, _ = FP8_PLAN_D128
    assert (fp8.tile_n, fp8.num_warps, fp8.num_stages) == (tile_n, warps, stages)
    assert fp8.widen_v_first == widen_v_first
    bs1 = plan_decode(1, 8192, 8, 4, 128, 132, fp8_cache=True)
    assert (bs1.tile_n, bs1.num_warps, bs1.num_stages, bs1.widen_v_first) == FP8_SPLIT_PLAN_D128
    assert plan_decode(32, 8192, 8, 4, 64, 132, fp8_cache=True) == plan_decode(
        32, 8192, 8, 4, 64, 132
    )
    for splits in (1, 3):
        plan = dataclasses.replace(fp8, num_splits=splits, min_tiles_per_split=1)
        out, ref = run_fp8_decode(
            1.0, True, splits, lens=[1, 65, 200], num_kv_heads=2, head_dim=128, plan=plan
        )
        torch.testing.assert_close(out, ref, rtol=8e-3, atol=8e-3)


def _bench_decode_attention():
    """benchmarks/bench_decode_attention.py as a module (it imports without a GPU)."""
    spec = importlib.util.spec_from_file_location(
        "bench_decode_attention", ROOT / "benchmarks" / "bench_decode_attention.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("num_seqs", [32, 1], ids=["bs32", "bs1"])
def test_the_sweeps_e4m3_candidates_match_a_float64_reference(num_seqs: int) -> None:
    """Every plan bench_decode_attention.py --sweep times over an e4m3 cache, with the tiles and
    split counts it gives them at Llama-3.1-8B's bs 32 and bs 1 (8 KV heads, 132 SMs), gives the
    reference's attention at head_dim 128 (each split working from a tile on, so contexts of a
    few tiles take every split)."""
    bench = _bench_decode_attention()
    base = plan_decode(num_seqs, 8192, 8, 4, 128, 132, fp8_cache=True)
    for name in bench.FP8_CANDIDATES:
        plan = bench.candidate_plan(base, name, num_seqs * 8, 132)
        per_sm = bench.FP8_CANDIDATES[name][1]
        if plan.num_splits > base.num_splits:  # filled: one wave of programs
            assert plan.num_splits * num_seqs * 8 <= 132 * per_sm, (name, plan)
        plan = dataclasses.replace(plan, num_splits=min(plan.num_splits, 5), min_tiles_per_split=1)
        assert plan.widen_v_first == bench.FP8_CANDIDATES[name][0].get("widen_v_first", False)
        out, ref = run_fp8_decode(
            1.0, True, plan.num_splits, lens=[1, 65, 200], num_kv_heads=2, head_dim=128, plan=plan
        )
        torch.testing.assert_close(out, ref, rtol=8e-3, atol=8e-3, msg=name)


def test_widened_v_tiles_change_layout_without_byte_reads() -> None:
    """Compiled for sm_90 (benchmarks/kernel_stats.py, no GPU needed), the e4m3 plans the sweep
    times with widen_v_first read no shared memory a byte at a time in their key loop, where the
    default reads V's tile so, and none spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernel_stats.py"), "decode",
         "--kv-cache-dtype", "fp8", "--candidates"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1 + len(_bench_decode_attention().FP8_CANDIDATES)
    for row in rows:
        assert row["stack"] == 0 and row["loop_spill_loads"] == 0, row
        if row["widen_v_first"]:
            assert row["loop_shared_byte_loads"] == 0, row
        else:
            assert row["loop_shared_byte_loads"] > 0, row


def test_e4m3_plans_fill_the_sms_program_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once every SM has a (sequence, KV head) program, an e4m3 plan at head_dim 128 splits the
    keys so the programs fill the SMs' program slots (FP8_PLAN_D128's programs per SM) in one
    wave; fewer programs than SMs split as before, and the bfloat16 cache does not split."""
    import atomrt.workers.kernels.attention.decode_attention as da

    def plan(bs: int, fp8: bool = True, kv_heads: int = 8) -> DecodeLaunch:
        return da.plan_decode(bs, 8192, kv_heads, 4, 128, 132, fp8_cache=fp8)

    plan_decode.cache_clear()
    per_sm = FP8_PLAN_D128[4]
    assert plan(32).num_splits == max(1, 132 * per_sm // 256)  # 256 programs: one wave
    assert plan(33, kv_heads=4).num_splits == per_sm  # 132 programs: one an SM, split per_sm ways
    assert plan(1024).num_splits == 1  # more programs than the SMs hold in one wave
    assert plan(33, fp8=False, kv_heads=4).num_splits == 1
    assert plan(8).num_splits == 5  # 64 programs < 132 SMs: cdiv(2 * 132, 64)
    monkeypatch.setattr(da, "FP8_PLAN_D128", (32, 4, 3, True, 5))
    monkeypatch.setattr(da, "FP8_SPLIT_PLAN_D128", (128, 8, 2, True))
    plan_decode.cache_clear()
    try:
        p32 = plan(32)
        assert (p32.tile_n, p32.num_warps, p32.num_stages, p32.widen_v_first) == (32, 4, 3, True)
        assert p32.num_splits == 2 and p32.min_tiles_per_split == 8  # 660 slots // 256
        assert plan(128).num_splits == 1 and plan(64).num_splits == 1  # 660 // 512, // 1024
        assert plan(32, fp8=False).num_splits == 1
        p8 = plan(8)  # fewer programs than SMs: the split plan's tiles, splits as before
        assert (p8.tile_n, p8.num_warps, p8.num_stages, p8.widen_v_first) == (128, 8, 2, True)
        assert p8.num_splits == 5 and p8.min_tiles_per_split == 2
    finally:
        plan_decode.cache_clear()


def test_bound_launches_plan_an_e4m3_cache_as_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TR_HYBRID region's kept decode launch is keyed by the plan attention_step launches: over
    an e4m3 cache at head_dim 128 the e4m3 plan (its tiles, stages and V widening), over a
    bfloat16 cache the bfloat16 one."""
    from test_bound_attention import KV, _md

    from atomrt.workers.kernels import device_info
    from atomrt.workers.layers import attention as attention_layer

    monkeypatch.setattr(device_info, "sm_count", lambda device: 132)
    q = torch.zeros(2, 8, 128)
    for dtype, fp8 in ((FP8, True), (torch.bfloat16, False)):
        plans = attention_layer._DecodePlans()
        cache = torch.zeros(10, 16, 2, 128, dtype=dtype)
        md = _md([5, 9])
        assert plans.plan_id(md, q, KV(cache, cache)) == 0
        ((plan, *_),) = plans.ids
        want = FP8_SPLIT_PLAN_D128 if fp8 else (128, 8, 2, False)
        assert (plan.tile_n, plan.num_warps, plan.num_stages, plan.widen_v_first) == want

"""bench_mla_decode.py --plans, the sweep the MLA decode plan rule is set from, at a toy shape (on
CPU through Triton's interpreter): each case's row carries its error against float32 torch, the
cases cover the merge as a launch and in the kernel, and the last row names the fastest."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from kernel_device import DEVICE

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_mla_decode", BENCH / "bench_mla_decode.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_mla_decode"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_plan_sweep_rows(capsys) -> None:
    bench = _bench()
    shape = bench.Shape(num_heads=4, bs=1, ctx=100, lora=32, rope=16, capacity=128)
    rows = bench.plan_sweep(shape, DEVICE, torch.float32, copy=1.0, dry_run=True)
    *cases, summary = rows
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(rows), "one JSON line per case and one for the best"
    assert cases[0]["default"] and not any(r["default"] for r in cases[1:])
    assert len({r["plan"] for r in cases}) == len(cases), "a plan timed twice"
    assert all(r["max_err"] < 1e-5 for r in cases), cases
    merges = {r["plan"].rsplit("merge=", 1)[1] for r in cases}
    assert {"launch", "kernel"} <= merges
    assert any(r["plan"].startswith("n16w4s1") for r in cases), "the key tiles' stage is missing"
    fastest = min(cases, key=lambda r: r["us"])
    assert (summary["best"], summary["us"]) == (fastest["plan"], fastest["us"])
    assert summary["speedup"] == round(cases[0]["us"] / fastest["us"], 3)


def test_split_counts_surround_the_planned_one() -> None:
    bench = _bench()
    base = bench.plan_mla_decode(1, 1, 8192, 16, 512, 64, 132)
    assert base.num_splits == 128
    assert bench.split_counts(base, 1, 132) == [16, 32, 64, 128]
    base = bench.plan_mla_decode(32, 32, 8192, 16, 512, 64, 132)
    assert bench.split_counts(base, 32, 132) == [1, 2, 4, 8, 16]


def test_tile_candidates_include_half_the_heads_a_tile() -> None:
    bench = _bench()
    best = bench.plan_mla_decode(1, 1, 8192, 16, 512, 64, 132)
    plans = bench.tile_candidates(best, dry_run=False)
    names = [bench.plan_name(p) for p in plans]
    assert len(set(names)) == len(plans) == len(bench.PLAN_TILES) + 1
    half = plans[-1]
    assert (half.heads_p, half.block_m, half.block_q, half.num_splits) == (8, 16, 2, 128)
    assert all(p.num_splits == best.num_splits for p in plans)

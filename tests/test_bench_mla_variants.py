"""bench_mla_variants.py, the MLA decode plan variants timed against the planned launch, at a toy
shape on CPU through Triton's interpreter (a check of the script, not a measure): each case's row
carries its error against float32 torch and the fields it changes, the full list at model shapes
covers every option, and the last row names the fastest case within the error bound."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch
from kernel_device import DEVICE

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses (and the variants' import) look it up
    spec.loader.exec_module(module)
    return module


def _bench():
    _load("bench_mla_decode")
    return _load("bench_mla_variants")


def test_variant_rows(capsys) -> None:
    bench = _bench()
    shape = bench.Shape(num_heads=16, bs=1, ctx=100, lora=32, rope=16, capacity=128)
    *cases, summary = bench.variant_sweep(shape, DEVICE, torch.float32, copy=1.0, dry_run=True)
    assert len(capsys.readouterr().out.splitlines()) == len(cases) + 1
    assert cases[0]["case"] == "planned" and cases[0]["fields"] == {}
    assert cases[0]["max_err"] < 1e-5, cases[0]
    bf16 = next(r for r in cases if r["case"] == "bf16")
    assert bf16["fields"] == {"partials_bf16": True}
    # bf16 partials round (2^-8 relative where the interpreter truncates), and stay in the bound
    assert 0 < bf16["max_err"] <= summary["err_bound"], (bf16, summary)
    ok = [r for r in cases if r["max_err"] <= summary["err_bound"]]
    fastest = min(ok, key=lambda r: r["us"])
    assert (summary["best"], summary["us"]) == (fastest["case"], fastest["us"])
    assert summary["plan"]["partials_bf16"] == ("bf16" in fastest["case"])


def test_variants_at_model_shapes_cover_every_option() -> None:
    bench = _bench()
    for bs, splits in ((1, 128), (8, 33)):
        base = bench.plan_mla_decode(bs, bs, 8192, 16, 512, 64, 132)
        assert base.num_splits == splits
        plans = bench.variants(base, dry_run=False)
        assert plans["planned"] == base
        assert len(set(plans.values())) == len(plans), "a plan timed twice"
        fields = {k for p in plans.values() for k in bench._changed(p, base)}
        assert {"partials_bf16", "num_splits", "block_n", "heads_p", "merge_in_kernel"} <= fields
        assert {"merge_splits", "merge_regs", "merge_pdl", "prefetch_kv"} <= fields
        for plan in plans.values():  # each keeps the planned minimum of keys a working split takes
            assert plan.min_tiles_per_split * plan.block_n >= 64, plan
            assert plan.block_m == max(16, plan.block_q * plan.heads_p)
            assert 1 <= plan.num_splits <= splits
        merged = [p for p in plans.values() if p.merge_in_kernel]
        assert merged and all(p.num_splits < splits for p in merged)
        assert dataclasses.replace(plans["bf16"], partials_bf16=False) == base

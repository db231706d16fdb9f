"""MLA decode launch-plan variants against the planned launch, one JSON line per case (needs a CUDA
GPU; --dry-run runs a toy shape on CPU through Triton's interpreter, to check the script):

    python benchmarks/bench_mla_variants.py [--heads 16] [--bs 1,8] [--ctx 8192]
    python benchmarks/bench_mla_variants.py --dry-run

Per shape, bench_mla_decode.py's setup and timer (a CUDA graph of one call per layer, each over its
own cache, the L2 cleared before each replay): the planned launch, then the plan fields that are
off by default or planned otherwise --

  partials_bf16             the splits' partial outputs in bf16 (half the bytes written and read
                            again by the merge)
  merge_pdl                 the merge launch scheduled while the decode runs (programmatic
                            dependent launch), waiting for it: the gap between the launches hidden
  splits / key tiles        fewer splits taking more keys each, 64-key tiles at 8 warps
  prefetch_kv               each key tile's rows loaded while the tile before is summed
  heads_p                   half the heads a tile (twice the programs, each key read twice: the
                            second time from L2)
  merge_in_kernel + steps   the merge done by the last split program with wider steps
                            (merge_splits, merge_regs), at a few splits

Each row: `us`, `of_copy` (share of a device copy's bandwidth), `max_err` against float32 torch,
and the plan fields that differ from the planned launch. The last row per shape names the fastest
case whose error stays within the planned launch's: ERR_FACTOR times it, or it plus two bf16 steps
at the output's scale (bf16 partials add a rounding of about the output's own), with its full
plan, to copy into plan_mla_decode.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_mla_decode beside it
if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from bench_mla_decode import (  # noqa: E402
    Shape,
    call,
    copy_gbps,
    max_error,
    moved_bytes,
    setup,
    time_us,
)

from atomrt.workers.kernels.attention.mla_decode import (  # noqa: E402
    MLADecodeLaunch,
    plan_mla_decode,
)
from atomrt.workers.kernels.device_info import sm_count  # noqa: E402
from atomrt.workers.kernels.launch import compile_ahead  # noqa: E402

ERR_FACTOR = 3.0  # a case's max_err may be this many times the planned launch's


def _tile(plan: MLADecodeLaunch, block_n: int, warps: int, stages: int) -> MLADecodeLaunch:
    """The plan at another key tile, keeping the keys a working split takes at least."""
    min_keys = plan.min_tiles_per_split * plan.block_n
    return dataclasses.replace(
        plan, block_n=block_n, num_warps=warps, num_stages=stages,
        min_tiles_per_split=triton.cdiv(min_keys, block_n),
    )  # fmt: skip


def _half_heads(plan: MLADecodeLaunch) -> MLADecodeLaunch:
    heads_p = max(1, plan.heads_p // 2)
    block_m = max(16, plan.block_q * heads_p)
    return dataclasses.replace(plan, heads_p=heads_p, block_m=block_m, block_q=block_m // heads_p)


def variants(base: MLADecodeLaunch, dry_run: bool) -> dict[str, MLADecodeLaunch]:
    """Named plans to time after the planned one (a few on the dry run: the interpreter is slow)."""
    r = dataclasses.replace
    splits = base.num_splits
    bf16 = r(base, partials_bf16=True)
    wide = _tile(bf16, 64, 8, 2)
    out = {"planned": base, "bf16": bf16}
    out["merge_pdl"] = r(base, merge_pdl=True)
    out["bf16 merge_pdl"] = r(bf16, merge_pdl=True)
    out["bf16 n16w4s2"] = _tile(bf16, 16, 4, 2)  # the tiles that keep two programs an SM unspilled
    out["bf16 n32w4s1"] = _tile(bf16, 32, 4, 1)
    out["bf16 n32w4s3"] = _tile(bf16, 32, 4, 3)  # two key tiles in flight ahead of the one summed
    out["bf16 n32w8s3"] = _tile(bf16, 32, 8, 3)
    ahead = r(bf16, prefetch_kv=True)  # the next tile's rows in registers: unspilled at these tiles
    out["bf16 prefetch_kv n16w4s1"] = _tile(ahead, 16, 4, 1)
    out["bf16 prefetch_kv n32w8s1"] = _tile(ahead, 32, 8, 1)
    out[f"bf16 prefetch_kv n32w8s1 splits{max(1, splits // 2)}"] = r(
        _tile(ahead, 32, 8, 1), num_splits=max(1, splits // 2)
    )
    out["bf16 n64w8s2"] = wide
    out["bf16 n64w8s1"] = _tile(bf16, 64, 8, 1)
    for d in (2, 4):
        fewer = max(1, splits // d)
        out[f"bf16 splits{fewer}"] = r(bf16, num_splits=fewer)
        out[f"bf16 n64w8s2 splits{fewer}"] = r(wide, num_splits=fewer)
    out[f"fp32 n64w8s2 splits{max(1, splits // 2)}"] = r(
        wide, partials_bf16=False, num_splits=max(1, splits // 2)
    )
    if base.heads_p >= 16:
        out[f"bf16 h{base.heads_p // 2} splits{max(1, splits // 2)}"] = r(
            _half_heads(bf16), num_splits=max(1, splits // 2)
        )
    for d in (2, 4, 8):
        fewer = splits // d
        if fewer < 2:
            continue
        merged = r(wide, num_splits=fewer, merge_in_kernel=True)
        out[f"bf16 n64w8s2 splits{fewer} merge=kernel"] = merged
        out[f"bf16 n64w8s2 splits{fewer} merge=kernel steps16x32k"] = r(
            merged, merge_splits=16, merge_regs=32768
        )
    if dry_run:
        steps = r(wide, merge_in_kernel=True, merge_splits=16, merge_regs=32768)
        return {"planned": base, "bf16": bf16, "bf16 merge=kernel steps16x32k": steps}
    return out


def _changed(plan: MLADecodeLaunch, base: MLADecodeLaunch) -> dict:
    new, old = dataclasses.asdict(plan), dataclasses.asdict(base)
    return {k: v for k, v in new.items() if v != old[k]}


def variant_sweep(
    shape: Shape, device: str, dtype: torch.dtype, copy: float, dry_run: bool
) -> list[dict]:
    """One row per case (printed as it is timed), then the fastest case within the error bound."""
    s = setup(shape, device, dtype)
    base = plan_mla_decode(
        shape.bs, shape.bs, shape.capacity, shape.num_heads, shape.lora, shape.rope,
        sm_count(torch.device(device)),
    )  # fmt: skip
    rows: list[dict] = []
    plans = variants(base, dry_run)
    try:  # every variant's kernels compile side by side first (not under the interpreter)
        with compile_ahead() as ahead:
            for plan in plans.values() if ahead else ():
                call(s, 0, plan)
    except Exception as exc:  # noqa: BLE001 - a variant that fails to compile fails in its row
        print(json.dumps(dict(compile_ahead_error=type(exc).__name__)), flush=True)

    def case(name: str, plan: MLADecodeLaunch) -> None:
        row = dict(heads=shape.num_heads, bs=shape.bs, ctx=shape.ctx, case=name)
        try:
            us = time_us(lambda i: call(s, i, plan), dry_run, rep_ms=100)
            gbps = round(moved_bytes(shape) * s["q"].element_size() / us / 1e3, 1)
            err = max_error(s, shape, plan=plan)
            row |= dict(us=us, gbps=gbps, of_copy=round(gbps / copy, 3), max_err=err)
        except Exception as exc:  # noqa: BLE001 - out of resources for this plan: record, go on
            row["error"] = type(exc).__name__
        row["fields"] = _changed(plan, base)
        print(json.dumps(row), flush=True)
        rows.append(row)
        plans[name] = plan

    for name, plan in list(plans.items()):
        case(name, plan)
    planned = rows[0]
    call(s, 0, base)
    out_max = s["out"].float().abs().max().item()
    err = planned.get("max_err", math.nan)
    bound = max(ERR_FACTOR * err, err + out_max / 128)  # or two bf16 steps at the output's scale

    def best_row() -> dict | None:
        ok = [r for r in rows if "us" in r and r["max_err"] <= bound]  # NaN errors never pass
        return min(ok, key=lambda r: r["us"]) if ok else None

    # the fastest with a merge launch, its merge started with programmatic dependent launch
    best = best_row()
    top = best and plans[best["case"]]
    if top and top.num_splits > 1 and not top.merge_in_kernel and not top.merge_pdl:
        case(f"{best['case']} + merge_pdl", dataclasses.replace(top, merge_pdl=True))
        best = best_row()
    timed = [r for r in rows if "us" in r]
    summary = dict(
        best=best and best["case"], heads=shape.num_heads, bs=shape.bs, ctx=shape.ctx,
        us=best and best["us"], of_copy=best and best["of_copy"], planned_us=planned.get("us"),
        speedup=round(planned["us"] / best["us"], 3) if best and "us" in planned else None,
        err_bound=bound,
        fastest_any_error=min(timed, key=lambda r: r["us"])["case"] if timed else None,
        plan=best and dataclasses.asdict(plans[best["case"]]),
    )  # fmt: skip
    print(json.dumps(summary), flush=True)
    return rows + [summary]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--heads", default="16", help="query heads per shape, comma-separated")
    ap.add_argument("--bs", default="1,8")
    ap.add_argument("--ctx", default="8192", help="keys per request")
    ap.add_argument("--dry-run", action="store_true", help="a toy shape on CPU, the interpreter")
    args = ap.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    if args.dry_run:
        device, dtype, lora, rope, capacity = "cpu", torch.float32, 32, 16, 128
        heads, batch_sizes, contexts = [16], [1], [100]
    else:
        device, dtype, lora, rope, capacity = "cuda", torch.bfloat16, 512, 64, 8192
        heads, batch_sizes, contexts = ints(args.heads), ints(args.bs), ints(args.ctx)
    copy = copy_gbps(device, args.dry_run)
    print(json.dumps({"copy_gbps": copy}), flush=True)
    for num_heads in heads:
        for bs in batch_sizes:
            for ctx in contexts:
                shape = Shape(num_heads, bs, ctx, lora, rope, max(capacity, ctx))
                variant_sweep(shape, device, dtype, copy, args.dry_run)


if __name__ == "__main__":
    main()

"""MLA decode bandwidth (needs a CUDA GPU; --dry-run runs toy shapes on CPU through Triton's
interpreter, to check the script, not to measure):

    python benchmarks/bench_mla_decode.py [--heads 16,20,128] [--bs 1,8,32,128] [--ctx 1024,8192]
                                          [--sweep] [--json PATH] [--record [DIR]]
    python benchmarks/bench_mla_decode.py --plans --heads 16 --bs 1,8,32,128 --ctx 8192
    python benchmarks/bench_mla_decode.py --dry-run [--plans] [--json PATH]

For each (heads, batch size, context): GPU µs per call of mla_decode_attention (the graph-safe
launch: plan from the 8k-key capacity, bf16 latent cache of 512 + 64, block size 16), replayed from
a CUDA graph holding one call per layer, each layer over its own cache (Triton's timer clears the L2
cache before each replay, so every layer reads from HBM). GB/s counts the bytes a call must move --
the latent cache rows of the live context, q and out -- over that time, and `of_copy` is its share
of a device-to-device copy's bandwidth (read + write) measured in the same run. Target: 70% of the
copy at bs >= 8 (benchmarks/goals.json; `--record` keeps each row as an `mla-decode` figure).
`max_err` is the first layer's largest difference from a float32 torch reference over its first
requests. `--sweep` adds other launch plans (key tile, warps, stages, heads per
tile, splits, keys per working split, block ids prefetched or not) and the best of them.

`--plans` is the sweep the plan rule (plan_mla_decode) is set from, in about a minute on an H100: per
shape, the planned launch, then split counts around the planned one with the merge as a launch and
in the kernel (merge_in_kernel), then the best of those over the key tiles, warps and stages of
PLAN_TILES; one JSON line per case (`us`, `of_copy`, `max_err`) and a `best` line per shape.
"""

from __future__ import annotations

import sys

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is first imported
    import os

    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from atomrt.runtime.bench import goals  # noqa: E402
from atomrt.runtime.bench.records import (  # noqa: E402
    Figure,
    Quantity,
    add_record_flag,
    figure,
    resolve_record_flag,
    save,
)
from atomrt.workers.kernels.attention.mla_decode import (  # noqa: E402
    MAX_SPLITS,
    MLADecodeLaunch,
    launch_mla_decode,
    mla_decode_attention,
    plan_mla_decode,
)
from atomrt.workers.kernels.device_info import sm_count  # noqa: E402

BLOCK_SIZE, LAYERS = 16, 8


@dataclasses.dataclass
class Shape:
    num_heads: int
    bs: int
    ctx: int
    lora: int
    rope: int
    capacity: int


def setup(shape: Shape, device: str, dtype: torch.dtype) -> dict:
    """Per-layer caches (blocks shuffled), one block table, q and out for `shape`."""
    width = shape.lora + shape.rope
    max_blocks = shape.capacity // BLOCK_SIZE
    num_blocks = shape.bs * triton.cdiv(shape.ctx, BLOCK_SIZE)
    caches = [
        torch.randn(num_blocks, BLOCK_SIZE, width, device=device, dtype=dtype)
        for _ in range(LAYERS)
    ]
    block_table = torch.zeros(shape.bs, max_blocks, device=device, dtype=torch.int32)
    used = triton.cdiv(shape.ctx, BLOCK_SIZE)
    block_table[:, :used] = torch.randperm(num_blocks, device=device).to(torch.int32).view(-1, used)
    q = torch.randn(shape.bs, shape.num_heads, width, device=device, dtype=dtype)
    return dict(
        caches=caches,
        block_table=block_table,
        q=q,
        out=torch.empty(shape.bs, shape.num_heads, shape.lora, device=device, dtype=dtype),
        seq_lens=torch.full((shape.bs,), shape.ctx, device=device, dtype=torch.int32),
        cu=torch.arange(shape.bs + 1, device=device, dtype=torch.int32),
        scale=width**-0.5,
    )


def call(s: dict, layer: int, plan: MLADecodeLaunch | None = None) -> None:
    args = (s["q"], s["caches"][layer], s["block_table"], s["seq_lens"], s["cu"])
    if plan is None:
        mla_decode_attention(*args, s["scale"], s["out"])
    else:
        launch_mla_decode(plan, *args, s["scale"], s["out"])


def max_error(
    s: dict, shape: Shape, requests: int = 2, plan: MLADecodeLaunch | None = None
) -> float:
    """Layer 0's output against float32 torch over the first requests (the formula: softmax of
    scale * q . K over the whole cache row, times the row's latent part)."""
    s["out"].fill_(float("nan"))
    call(s, 0, plan)
    worst = 0.0
    cache = s["caches"][0]
    for b in range(min(requests, shape.bs)):
        pos = torch.arange(shape.ctx, device=cache.device)
        keys = cache[s["block_table"][b, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE].float()
        p = torch.softmax(s["scale"] * s["q"][b].float() @ keys.T, dim=-1)
        ref = p @ keys[:, : shape.lora]
        err = (s["out"][b].float() - ref).abs().max().item()
        worst = err if math.isnan(err) else max(worst, err)  # NaN: a row left unwritten
    return worst


def time_us(fn, dry_run: bool, rep_ms: int = 200) -> float:
    """µs per layer: a CUDA graph of LAYERS calls, timed by Triton (median); on the dry run, wall
    time of the calls through the interpreter."""
    if dry_run:
        start = time.perf_counter()
        for layer in range(LAYERS):
            fn(layer)
        return round((time.perf_counter() - start) * 1e6 / LAYERS, 1)
    for layer in range(LAYERS):
        fn(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            fn(layer)
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median")
    return round(ms * 1e3 / LAYERS, 2)


def copy_gbps(device: str, dry_run: bool) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second, of a buffer well past L2."""
    numel = (1 << 20) if dry_run else (1 << 29)  # 1 GiB of bf16 on the GPU
    src = torch.randn(numel, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    if dry_run:
        start = time.perf_counter()
        dst.copy_(src)
        seconds = time.perf_counter() - start
    else:
        seconds = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3
    return round(2 * src.numel() * src.element_size() / seconds / 1e9, 1)


def sweep(s: dict, base: MLADecodeLaunch, dry_run: bool) -> dict:
    """Other plans at this shape: µs per call, or the error that stopped one."""
    variants: dict[str, object] = {}
    heads = sorted({base.heads_p, min(16, base.heads_p)})
    for heads_p in heads:
        for block_n in (16, 32, 64):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    block_m = max(16, base.block_q * heads_p)
                    plan = dataclasses.replace(
                        base, heads_p=heads_p, block_m=block_m, block_q=block_m // heads_p,
                        block_n=block_n, num_warps=warps, num_stages=stages,
                    )  # fmt: skip
                    variants[f"h{heads_p}n{block_n}w{warps}s{stages}"] = _try(s, plan, dry_run)
    for splits in sorted({1, 2, 4, 8, 16, 32, 64, 128} - {base.num_splits}):
        plan = dataclasses.replace(base, num_splits=splits)
        variants[f"splits{splits}"] = _try(s, plan, dry_run)
    for min_tiles in sorted({1, 2, 4, 8} - {base.min_tiles_per_split}):
        plan = dataclasses.replace(base, min_tiles_per_split=min_tiles)
        variants[f"min_tiles{min_tiles}"] = _try(s, plan, dry_run)
    plan = dataclasses.replace(base, prefetch_blocks=not base.prefetch_blocks)
    variants[f"prefetch_blocks={plan.prefetch_blocks}"] = _try(s, plan, dry_run)
    return variants


def _try(s: dict, plan: MLADecodeLaunch, dry_run: bool) -> object:
    try:
        return time_us(lambda i: call(s, i, plan), dry_run)
    except Exception as exc:  # noqa: BLE001 - out of resources for this plan: record, go on
        return type(exc).__name__


# (keys per tile, warps, stages) the plan sweep tries after the planned tile. benchmarks/
# kernel_stats.py mla (sm_90, 16 heads, bf16): the planned 32/4/2 spills in its key loop (255
# registers; 36 local loads, 7 with merge_in_kernel); 16/4/1, 32/4/1 and 16/4/2 keep two programs
# per SM without a spill; 64/8/1 and 32/8/1 hold one program per SM but no spill (larger
# tiles, fewer round trips: for bs >= 8); 64-key tiles at 4 warps spill and are left out.
PLAN_TILES = ((16, 4, 1), (32, 4, 1), (16, 4, 2), (64, 8, 1), (32, 8, 1))


def split_counts(base: MLADecodeLaunch, num_programs: int, num_sms: int) -> list[int]:
    """Split counts around the planned one: an eighth of it to twice it, and one wave of programs."""
    counts = {
        base.num_splits,
        min(MAX_SPLITS, 2 * base.num_splits),
        max(1, min(MAX_SPLITS, num_sms // num_programs)),
    }
    counts |= {max(1, base.num_splits // d) for d in (2, 4, 8)}
    return sorted(counts)


def plan_name(plan: MLADecodeLaunch) -> str:
    merge = "none" if plan.num_splits == 1 else "kernel" if plan.merge_in_kernel else "launch"
    tile = f"n{plan.block_n}w{plan.num_warps}s{plan.num_stages} h{plan.heads_p}"
    return f"{tile} splits{plan.num_splits} merge={merge}"


def tile_candidates(best: MLADecodeLaunch, dry_run: bool) -> list[MLADecodeLaunch]:
    """The plan sweep's second stage, at the best split count and merge: the tiles of PLAN_TILES,
    then (16 heads or more a tile) half the heads a tile: twice the programs, each with half the
    partials to store and merge, the cache read once per head tile (the L2 may serve the second)."""
    tiles = PLAN_TILES[:1] if dry_run else PLAN_TILES
    out = [
        dataclasses.replace(best, block_n=block_n, num_warps=warps, num_stages=stages)
        for block_n, warps, stages in tiles
    ]
    if best.heads_p >= 16:
        heads_p = best.heads_p // 2
        block_m = max(16, best.block_q * heads_p)
        out.append(
            dataclasses.replace(best, heads_p=heads_p, block_m=block_m, block_q=block_m // heads_p)
        )
    return out


def plan_sweep(
    shape: Shape, device: str, dtype: torch.dtype, copy: float, dry_run: bool
) -> list[dict]:
    """The planned launch, then its tile at split counts around the planned one with each merge,
    then the fastest (splits, merge) over PLAN_TILES: one row per case (printed as it is timed)
    and a last row naming the best."""
    s = setup(shape, device, dtype)
    sms = sm_count(torch.device(device))
    base = plan_mla_decode(
        shape.bs, shape.bs, shape.capacity, shape.num_heads, shape.lora, shape.rope, sms
    )
    num_programs = shape.bs * triton.cdiv(shape.num_heads, base.heads_p) * base.num_row_blocks
    rows: list[dict] = []
    plans: dict[str, MLADecodeLaunch] = {}

    def case(plan: MLADecodeLaunch) -> None:
        name = plan_name(plan)
        if name in plans:
            return
        plans[name] = plan
        row = dict(heads=shape.num_heads, bs=shape.bs, ctx=shape.ctx, plan=name)
        try:
            us = time_us(lambda i: call(s, i, plan), dry_run, rep_ms=100)
            gbps = round(moved_bytes(shape) * s["q"].element_size() / us / 1e3, 1)
            err = max_error(s, shape, plan=plan)
            row |= dict(us=us, gbps=gbps, of_copy=round(gbps / copy, 3), max_err=err)
        except Exception as exc:  # noqa: BLE001 - out of resources for this plan: record, go on
            row["error"] = type(exc).__name__
        row["default"] = plan == base
        print(json.dumps(row), flush=True)
        rows.append(row)

    case(base)
    counts = split_counts(base, num_programs, sms)
    if dry_run:  # the interpreter is slow: the planned count and one other
        counts = sorted({base.num_splits, counts[0]})
    for splits in counts:
        for merge in (False, True):
            case(dataclasses.replace(base, num_splits=splits, merge_in_kernel=merge))
    timed = [r for r in rows if "us" in r and not math.isnan(r["max_err"])]
    if timed:
        best_plan = plans[min(timed, key=lambda r: r["us"])["plan"]]
        for plan in tile_candidates(best_plan, dry_run):
            case(plan)
    timed = [r for r in rows if "us" in r and not math.isnan(r["max_err"])]
    best = min(timed, key=lambda r: r["us"]) if timed else dict(plan=None, us=None, of_copy=None)
    summary = dict(
        best=best["plan"], heads=shape.num_heads, bs=shape.bs, ctx=shape.ctx, us=best["us"],
        of_copy=best["of_copy"], default_us=rows[0].get("us"),
        speedup=round(rows[0]["us"] / best["us"], 3) if timed and "us" in rows[0] else None,
    )  # fmt: skip
    print(json.dumps(summary), flush=True)
    return rows + [summary]


def moved_bytes(shape: Shape) -> int:
    """Elements a call must move: the live cache rows, q and out."""
    width = shape.lora + shape.rope
    return shape.bs * (shape.ctx * width + shape.num_heads * (width + shape.lora))


def bench_shape(
    shape: Shape, device: str, dtype: torch.dtype, copy: float, with_sweep: bool, dry_run: bool
) -> dict:
    """One line of the table: time, bandwidth and its share of the copy's, error, plan."""
    s = setup(shape, device, dtype)
    base = plan_mla_decode(
        shape.bs, shape.bs, shape.capacity, shape.num_heads, shape.lora, shape.rope,
        sm_count(torch.device(device)),
    )  # fmt: skip
    us = time_us(lambda i: call(s, i), dry_run)
    gbps = round(moved_bytes(shape) * s["q"].element_size() / us / 1e3, 1)
    row = dict(
        heads=shape.num_heads, bs=shape.bs, ctx=shape.ctx, us=us, gbps=gbps,
        of_copy=round(gbps / copy, 3), max_err=max_error(s, shape), plan=dataclasses.asdict(base),
    )  # fmt: skip
    if with_sweep:
        variants = sweep(s, base, dry_run)
        timed = [(v, k) for k, v in variants.items() if isinstance(v, float)]
        row["best"] = min(timed) if timed else None
        row["variants"] = variants
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--heads", default="16,20,128", help="query heads per shape, comma-separated")
    ap.add_argument("--bs", default="1,8,32,128")
    ap.add_argument("--ctx", default="1024,8192", help="keys per request")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument(
        "--plans", action="store_true", help="the plan sweep: splits x merge, then key tiles"
    )
    ap.add_argument("--dry-run", action="store_true", help="toy shapes on CPU, the interpreter")
    ap.add_argument("--json", default="")
    add_record_flag(ap)
    args = ap.parse_args()
    resolve_record_flag(args, ap)
    if args.plans and (args.record is not None or args.sweep):
        ap.error("--plans prints its own rows: it takes neither --record nor --sweep")
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    if args.dry_run:
        device, dtype, lora, rope, capacity = "cpu", torch.float32, 32, 16, 128
        heads, batch_sizes, contexts = [4], [1, 2], [40, 100]
    else:
        device, dtype, lora, rope, capacity = "cuda", torch.bfloat16, 512, 64, 8192
        heads, batch_sizes, contexts = ints(args.heads), ints(args.bs), ints(args.ctx)
    copy = copy_gbps(device, args.dry_run)
    print(json.dumps({"copy_gbps": copy, "device": _device_name(device)}), flush=True)
    rows = []
    for num_heads in heads:
        for bs in batch_sizes:
            for ctx in contexts:
                shape = Shape(num_heads, bs, ctx, lora, rope, max(capacity, ctx))
                if args.plans:
                    rows += plan_sweep(shape, device, dtype, copy, args.dry_run)
                    continue
                row = bench_shape(shape, device, dtype, copy, args.sweep, args.dry_run)
                print(json.dumps({k: v for k, v in row.items() if k != "variants"}), flush=True)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_gbps=copy, device=_device_name(device), rows=rows), f, indent=1)
    if args.record is not None and not args.plans:
        program = "python benchmarks/bench_mla_decode.py"
        on_gpu = not args.dry_run
        notes = (
            [] if on_gpu else ["dry run: toy shapes through Triton's interpreter, not a measure"]
        )
        records = figures(rows, copy, on_gpu)
        save(
            args.record,
            "bench_mla_decode",
            sys.argv[1:],
            records,
            on_gpu=on_gpu,
            program=program,
            notes=notes,
        )


def figures(rows: list[dict], copy: float, on_gpu: bool) -> list[Figure]:
    """mla-decode: GB/s against the device copy of the same run, per (heads, batch size, context);
    judged against the goal (benchmarks/goals.json: from a batch size up), on a GPU."""
    out = []
    for row in rows:
        goal = goals.threshold("mla-decode", batch_size=row["bs"]) if on_gpu else None
        out.append(
            figure(
                "mla-decode",
                f"{row['heads']} heads bs={row['bs']} ctx={row['ctx']}",
                row["gbps"],
                "GB/s",
                anchor=copy,
                anchor_name="device copy",
                threshold=goal,
                extra={
                    "time": Quantity(row["us"], "µs"),
                    "max error": Quantity(row["max_err"], "abs"),
                },
            )
        )
    return out


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"


if __name__ == "__main__":
    main()

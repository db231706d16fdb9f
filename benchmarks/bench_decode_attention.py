"""Decode attention timings (needs a CUDA GPU):

    python benchmarks/bench_decode_attention.py [--sweep] [--json PATH]
        [--shape NAME ...] [--ctx 170,1024,4096] [--kv-cache-dtype auto|fp8] [--candidates A,B]

For the benchmark model shapes (SHAPES; --shape picks some), GPU µs per layer of a decode step's
attention work, replayed from a CUDA graph that holds 16 layers' calls back to back (as a step
does):
  two_launch  rope_write_kv, then unified_attention (+ its split reduce), for comparison
  fused       attention_step: one decode_attention launch (rotary, KV write, attention, split merge)
  fused_bf16_tiles  (--kv-cache-dtype fp8) float16 products in the bfloat16 cache's tiles
              (plan_decode without fp8_cache: 128 keys, 2 stages)
  fused_before  (--kv-cache-dtype fp8) those tiles with bfloat16 products: the kernel as it was
              before the float16 products and the e4m3 tiles
  fused_prefetch  the launch with prefetch_kv=True: each K/V tile loaded an iteration ahead
  fused_early  and early_kv=True: the first K/V tile loaded before the rotary's round trip
`--sweep` adds the fused kernel under other tile sizes / warps / stages / splits, to tune
plan_decode. With --kv-cache-dtype fp8 the caches are e4m3 with per-tensor k/v scales, the FP8 KV
cache's decode; there `--sweep` times, per shape and context, the bfloat16 cache's default plan,
the e4m3 cache's default plan and each of FP8_CANDIDATES, one JSON line each with its ratio to the
bfloat16 cache's plan and to the e4m3 default (e.g. --shape "Llama-3.1-8B bs32" --ctx 8192
--kv-cache-dtype fp8 --sweep; --candidates picks some).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch
import triton
import triton.testing

from atomrt.workers.kernels.attention.decode_attention import (
    DecodeLaunch,
    attention_step,
    decode_attention,
    plan_decode,
    prepare_decode_counters,
)
from atomrt.workers.kernels.attention.paged_attention import (
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    rope_write_kv,
    unified_attention,
)
from atomrt.workers.kernels.device_info import sm_count
from atomrt.workers.layers.rotary import RotaryEmbedding

SHAPES = {  # name: (batch size, KV heads, group, head_dim)
    "SmolLM2-135M bs1": (1, 3, 3, 64),
    "Llama-3.2-1B bs32": (32, 8, 4, 64),
    "Llama-3.1-8B bs1": (1, 8, 4, 128),
    "Llama-3.1-8B bs32": (32, 8, 4, 128),
}
DEFAULT_SHAPES = ("SmolLM2-135M bs1", "Llama-3.2-1B bs32", "Llama-3.1-8B bs1")
LAYERS, BLOCK_SIZE, CAPACITY = 16, 16, 8192

# The e4m3 cache's plans --sweep times beside the defaults, name: (DecodeLaunch fields, programs
# an SM holds); each splits to fill the SMs' program slots (fill_splits) and keeps the default's
# splits where those are more (bs 1). Programs per SM: sm_90 registers at Llama-3.1-8B's shape, the
# split path compiled in where a plan splits at bs 32 (benchmarks/kernel_stats.py decode
# --kv-cache-dtype fp8 --candidates; Triton 3.6: none spills). The 1-stage default issues a tile's
# V loads only after its K tile went through shared memory (two round trips a tile); 2 and 3
# stages copy both ahead (cp.async) as the bfloat16 cache's plan does. widen_v_first: 44 warp
# instructions a key in the loop at 64-key tiles, 8 warps and 2 stages, where the default has 48
# (58 at 2 stages), and 128-key tiles fit 2 programs an SM again (118 registers, 37 a key: the
# bfloat16 cache's plan, 93 and 37; 154 registers with the split path, so 1 an SM at bs 1).
# Fewer warps a program: fewer cross-warp softmax reductions (barriers) a key.
FP8_CANDIDATES: dict[str, tuple[dict, int]] = {
    "t64w8s2": (dict(tile_n=64, num_warps=8, num_stages=2), 2),
    "t64w8s2v": (dict(tile_n=64, num_warps=8, num_stages=2, widen_v_first=True), 2),
    "t64w8s3v": (dict(tile_n=64, num_warps=8, num_stages=3, widen_v_first=True), 2),
    "t128w8s2v": (dict(tile_n=128, num_warps=8, num_stages=2, widen_v_first=True), 2),
    "t64w4s2v": (dict(tile_n=64, num_warps=4, num_stages=2, widen_v_first=True), 4),
    "t64w4s3v": (dict(tile_n=64, num_warps=4, num_stages=3, widen_v_first=True), 4),
    "t32w4s3v": (dict(tile_n=32, num_warps=4, num_stages=3, widen_v_first=True), 5),
    "t32w2s2v": (dict(tile_n=32, num_warps=2, num_stages=2, widen_v_first=True), 6),
}


def fill_splits(num_programs: int, num_sms: int, per_sm: int, capacity: int) -> int:
    """The splits that give about `per_sm` programs to every SM for `num_programs` (sequence, KV
    head) pairs, each split at least MIN_KEYS_PER_SPLIT keys of `capacity`."""
    slots = num_sms * per_sm
    return max(1, min(MAX_SPLITS, capacity // MIN_KEYS_PER_SPLIT, slots // max(1, num_programs)))


def candidate_plan(base: DecodeLaunch, name: str, num_programs: int, num_sms: int) -> DecodeLaunch:
    """FP8_CANDIDATES[name] as a launch, over `base` (the e4m3 cache's default plan); V widened
    first only where the candidate says so, whatever the default does. Once the programs fill the
    SMs the candidate's own programs an SM set its splits, not the default's."""
    fields, per_sm = FP8_CANDIDATES[name]
    splits = fill_splits(num_programs, num_sms, per_sm, CAPACITY)
    if num_programs < num_sms:
        splits = max(base.num_splits, splits)
    return dataclasses.replace(
        base,
        **{"widen_v_first": False, **fields},
        num_splits=splits,
        min_tiles_per_split=max(1, MIN_KEYS_PER_SPLIT // fields["tile_n"]),
    )


def setup(
    bs: int, num_kv_heads: int, group: int, head_dim: int, ctx: int, fp8: bool = False
) -> dict:
    dev, dtype = "cuda", torch.bfloat16
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    max_blocks = CAPACITY // BLOCK_SIZE
    num_blocks = bs * max_blocks
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    caches = [
        (
            torch.randn(shape, device=dev, dtype=dtype).to(cache_dtype),
            torch.randn(shape, device=dev, dtype=dtype).to(cache_dtype),
        )
        for _ in range(LAYERS)
    ]
    block_tables = torch.randperm(num_blocks, device=dev).to(torch.int32).view(bs, max_blocks)
    q = torch.randn(bs, num_kv_heads * group, head_dim, device=dev, dtype=dtype)
    k = torch.randn(bs, num_kv_heads, head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    positions = torch.full((bs,), ctx - 1, device=dev, dtype=torch.int64)
    slots = (
        block_tables[:, (ctx - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE
    ).contiguous()
    rotary = RotaryEmbedding(head_dim, max_position=CAPACITY, theta=10000.0).to(dev)
    return dict(
        q=q,
        k=k,
        v=v,
        out=torch.empty_like(q),
        positions=positions,
        slots=slots,
        caches=caches,
        block_tables=block_tables,
        rotary=rotary,
        bs=bs,
        cu=torch.arange(bs + 1, device=dev, dtype=torch.int32),
        context_lens=torch.full((bs,), ctx, device=dev, dtype=torch.int32),
        kv_scales=torch.tensor([0.02, 0.03], device=dev) if fp8 else None,
    )


def two_launch(s: dict, layer: int) -> None:
    kc, vc = s["caches"][layer]
    r = s["rotary"]
    q = rope_write_kv(
        s["q"], s["k"], s["v"], s["positions"], r.cos_cache, r.sin_cache, kc, vc, s["slots"],
        s["kv_scales"],
    )  # fmt: skip
    unified_attention(
        q,
        kc,
        vc,
        s["out"],
        s["cu"],
        s["context_lens"],
        s["block_tables"],
        0.125,
        num_seqs=s["bs"],
        max_seqlen_q=1,
        max_seqlen_k=CAPACITY,
        graph_safe=True,
        kv_scales=s["kv_scales"],
    )


def fused(s: dict, layer: int, plan=None) -> None:
    kc, vc = s["caches"][layer]
    r = s["rotary"]
    if plan is None:
        attention_step(
            s["q"],
            s["k"],
            s["v"],
            s["out"],
            s["positions"],
            r.cos_cache,
            r.sin_cache,
            kc,
            vc,
            s["slots"],
            s["cu"],
            s["context_lens"],
            s["block_tables"],
            0.125,
            num_seqs=s["bs"],
            max_seqlen_q=1,
            max_seqlen_k=CAPACITY,
            graph_safe=True,
            kv_scales=s["kv_scales"],
        )
    else:
        decode_attention(
            s["q"],
            s["k"],
            s["v"],
            s["out"],
            s["positions"],
            r.cos_cache,
            r.sin_cache,
            kc,
            vc,
            s["slots"],
            s["cu"],
            s["context_lens"],
            s["block_tables"],
            0.125,
            plan,
            num_seqs=s["bs"],
            kv_scales=s["kv_scales"],
        )


def time_us(fn, rep: int = 300) -> float:
    for layer in range(LAYERS):
        fn(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            fn(layer)
    ms = triton.testing.do_bench(graph.replay, warmup=rep // 6, rep=rep)
    return round(ms * 1e3 / LAYERS, 2)


def sweep_fp8(name: str, ctx: int, candidates: list[str]) -> list[dict]:
    """One row per plan at shape `name` and context `ctx`: the bfloat16 cache's default, the e4m3
    cache's default, `candidates` (FP8_CANDIDATES' names); each with its ratio to the first two
    and the largest difference of its output from the e4m3 default's (the same inputs)."""
    bs, hk, group, hd = SHAPES[name]
    num_sms = sm_count(torch.device("cuda"))
    s = setup(bs, hk, group, hd, ctx, fp8=False)
    bf16_plan = plan_decode(bs, CAPACITY, hk, group, hd, num_sms)
    bf16_us = time_us(lambda i: fused(s, i, bf16_plan), rep=100)
    del s
    s = setup(bs, hk, group, hd, ctx, fp8=True)
    base = plan_decode(bs, CAPACITY, hk, group, hd, num_sms, True)
    plans = {"bf16_default": bf16_plan, "fp8_default": base}
    plans |= {c: candidate_plan(base, c, bs * hk, num_sms) for c in candidates}
    rows, base_out, base_us = [], None, None
    for label, plan in plans.items():
        row = dict(shape=name, ctx=ctx, plan_name=label)
        if label == "bf16_default":
            row.update(kv_cache_dtype="auto", us=bf16_us)
        else:
            row["kv_cache_dtype"] = "fp8"
            try:
                fused(s, 0, plan)
                out = s["out"].float().clone()
                base_out = out if base_out is None else base_out
                row["max_diff_vs_fp8_default"] = round((out - base_out).abs().max().item(), 5)
                row["us"] = time_us(lambda i: fused(s, i, plan), rep=100)
            except Exception as exc:  # out of resources for this plan
                row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        if "us" in row:
            base_us = row["us"] if label == "fp8_default" else base_us
            row["ratio_to_bf16"] = round(row["us"] / bf16_us, 3)
            if base_us is not None:
                row["ratio_to_fp8_default"] = round(row["us"] / base_us, 3)
        row["plan"] = dict(
            tile_n=plan.tile_n, warps=plan.num_warps, stages=plan.num_stages,
            splits=plan.num_splits, widen_v_first=plan.widen_v_first,
        )  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--shape",
        action="append",
        choices=sorted(SHAPES),
        help="repeatable; default: the first three",
    )
    ap.add_argument(
        "--ctx", default="", help="comma-separated context lengths (default 170,1024,4096)"
    )
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument(
        "--candidates",
        help="--kv-cache-dtype fp8 --sweep: comma-separated FP8_CANDIDATES to time (default all)",
    )
    args = ap.parse_args()
    if args.candidates is not None and not (args.sweep and args.kv_cache_dtype == "fp8"):
        ap.error("--candidates: only with --kv-cache-dtype fp8 --sweep")
    candidates = [c for c in (args.candidates or ",".join(FP8_CANDIDATES)).split(",") if c]
    if unknown := sorted(set(candidates) - set(FP8_CANDIDATES)):
        ap.error(f"--candidates: unknown {unknown}; known: {', '.join(FP8_CANDIDATES)}")
    fp8 = args.kv_cache_dtype == "fp8"
    contexts = [int(c) for c in args.ctx.split(",")] if args.ctx else [170, 1024, 4096]
    if max(contexts) > CAPACITY:
        ap.error(f"--ctx: at most {CAPACITY} keys (the bench's KV capacity)")
    prepare_decode_counters(torch.device("cuda"))
    rows = []
    for name in args.shape or DEFAULT_SHAPES:
        bs, hk, group, hd = SHAPES[name]
        for ctx in contexts:
            if fp8 and args.sweep:
                rows += sweep_fp8(name, ctx, candidates)
                continue
            s = setup(bs, hk, group, hd, ctx, fp8)
            base = plan_decode(bs, CAPACITY, hk, group, hd, sm_count(s["q"].device), fp8)
            row = dict(
                shape=name,
                ctx=ctx,
                kv_cache_dtype=args.kv_cache_dtype,
                two_launch=time_us(lambda i: two_launch(s, i)),
                fused=time_us(lambda i: fused(s, i)),
                plan=dataclasses.asdict(base),
            )
            prefetch_plan = dataclasses.replace(base, prefetch_kv=True)
            row["fused_prefetch"] = time_us(lambda i: fused(s, i, prefetch_plan))
            early_plan = dataclasses.replace(prefetch_plan, early_kv=True)
            row["fused_early"] = time_us(lambda i: fused(s, i, early_plan))
            if fp8:
                bf16_tiles = plan_decode(bs, CAPACITY, hk, group, hd, sm_count(s["q"].device))
                before = dataclasses.replace(bf16_tiles, fp8_f16_products=False)
                row["fused_bf16_tiles"] = time_us(lambda i: fused(s, i, bf16_tiles))
                row["fused_before"] = time_us(lambda i: fused(s, i, before))
            # the default contexts sweep the short ones; named contexts all sweep
            if args.sweep and (args.ctx or ctx <= 1024):
                variants = {}
                grid = itertools.product(
                    (64, 128, 256) if fp8 else (64, 128), (4, 8), (1, 2), (False, True)
                )
                for tile_n, warps, stages, prefetch in grid:
                    plan = dataclasses.replace(
                        base,
                        tile_n=tile_n,
                        num_warps=warps,
                        num_stages=stages,
                        min_tiles_per_split=max(1, 256 // tile_n),
                        prefetch_kv=prefetch,
                    )
                    name = f"t{tile_n}w{warps}s{stages}{'p' if prefetch else ''}"
                    try:
                        variants[name] = time_us(lambda i: fused(s, i, plan))
                    except Exception as exc:  # out of resources for this config
                        variants[name] = f"{type(exc).__name__}"
                for splits in (1, 2, 4, 8):
                    plan = dataclasses.replace(base, num_splits=splits)
                    variants[f"splits{splits}"] = time_us(lambda i: fused(s, i, plan))
                best = min((v, k) for k, v in variants.items() if isinstance(v, float))
                row["best"] = best
                row["variants"] = variants
            print(json.dumps({k: v for k, v in row.items() if k != "variants"}), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

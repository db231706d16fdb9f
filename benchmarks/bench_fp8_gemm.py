"""FP8 (w8a8) linear layers at decode rows against bf16: GPU µs per call inside a CUDA graph, the
weights rotated through several copies so that they stream from HBM, for Llama-3.1-8B's and
DeepSeek-V2-Lite's projections. Rows: bf16 `F.linear` (cuBLAS), the two-launch FP8 path (the
activation-quantization kernel, then `w8a8_gemm`), and the fused decode path `w8a8_skinny` at its
launch for its shape (fp8_skinny_configs.skinny_launch) and, with --sweep, at other launches; GB/s counts
the weight and scale bytes. Each row also times the fused path with the products' sum over K
deferred (or not: the other side of fp8_skinny_configs.skinny_defers_sum for its shape).

`--norm` (per-row scales) adds a residual add + RMSNorm before the projection: add_rms_norm then
the fused path (what runs by default) against w8a8_skinny_add_norm, the add and norm in the GEMM's
launch (ATOMRT_FP8_NORM_PROLOGUE=1), at the shape's launch.

`--variants` times the fused path's launch variants (`fp8_skinny_configs.SkinnyOptions`: split K,
persistent programs, wide passes over x, a preloaded first weight step, load hints, and wider K
steps or deeper pipelines) against the shape's plain launch, one line per shape and variant, each
checked against the plain launch's output; their kernels compile first in parallel processes.
With --norm, qkv and gate_up take the residual add and RMSNorm in the GEMM's launch, as the model
runs them (w8a8_skinny_add_norm, ATOMRT_FP8_NORM_PROLOGUE=1).
Under ATOMRT_PDL=1 the fused path launches with programmatic dependent launch: a call's preloaded
weights stream while the call before it finishes.
`--stats` (no GPU) compiles the same cases for sm_90 and prints their registers and spills.

`python benchmarks/bench_fp8_gemm.py [--m 1] [--sweep] [--group 128] [--norm]`
`python benchmarks/bench_fp8_gemm.py --variants [--norm] [--shapes "8B qkv,8B o"]`
`python benchmarks/bench_fp8_gemm.py --variants --stats`
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import torch.nn.functional as F

from atomrt.runtime.bench.cuda_timing import graph_call_us
from atomrt.workers.kernels.gemm import fp8_gemm, fp8_skinny, fp8_skinny_configs
from atomrt.workers.kernels.gemm.fp8_skinny_configs import SkinnyOptions
from atomrt.workers.kernels.rms_norm import add_rms_norm
from atomrt.workers.layers.quantization.fp8 import quantize_fp8

SHAPES = {  # name: (N, K)
    "8B qkv": (6144, 4096),
    "8B o": (4096, 4096),
    "8B gate_up": (28672, 4096),
    "8B down": (4096, 14336),
    "V2-Lite q+kv_a": (3648, 2048),  # q_proj and kv_a_proj_with_mqa as one GEMM (mla.py)
    "V2-Lite o": (2048, 2048),
}
COPIES = 4  # weight copies cycled through: more bytes than the 50-60 MB of L2
# the projections a decoder layer runs after its residual add and norm: with --variants --norm
# they take them in the GEMM's launch (w8a8_skinny_add_norm), as ATOMRT_FP8_NORM_PROLOGUE=1 runs
NORM_SHAPES = ("8B qkv", "8B gate_up", "V2-Lite q+kv_a")
LAUNCH_FIELDS = ("block_k", "products", "warps", "stages")
# name: (changes to the shape's launch, options); "flip_sum": the other side of skinny_defers_sum
VARIANTS: dict[str, tuple[dict[str, int], SkinnyOptions]] = {
    "plain": ({}, SkinnyOptions()),
    "split2": ({}, SkinnyOptions(split_k=2)),
    "split4": ({}, SkinnyOptions(split_k=4)),
    "split4 preload": ({}, SkinnyOptions(split_k=4, preload=True)),
    "split2 preload x4096": ({}, SkinnyOptions(split_k=2, preload=True, x_block=4096)),
    "x4096": ({}, SkinnyOptions(x_block=4096)),
    "preload": ({}, SkinnyOptions(preload=True)),
    "preload x2048": ({}, SkinnyOptions(preload=True, x_block=2048)),
    "preload x4096": ({}, SkinnyOptions(preload=True, x_block=4096)),
    "w .cg": ({}, SkinnyOptions(weight_cache=".cg")),
    "w evict_first": ({}, SkinnyOptions(weight_evict="evict_first")),
    "persistent2": ({}, SkinnyOptions(persistent=2)),
    "persistent4": ({}, SkinnyOptions(persistent=4)),
    "stages4": ({"stages": 4}, SkinnyOptions()),
    "stages5": ({"stages": 5}, SkinnyOptions()),
    "bk2048": ({"block_k": 2048}, SkinnyOptions()),
    "bk2048 stages4": ({"block_k": 2048, "stages": 4}, SkinnyOptions()),
    "bk4096 stages2": ({"block_k": 4096, "stages": 2}, SkinnyOptions()),
    "flip_sum": ({"flip_sum": 1}, SkinnyOptions()),
    "split4 preload flip_sum": ({"flip_sum": 1}, SkinnyOptions(split_k=4, preload=True)),
}


def _variant_launch(
    n: int, k: int, variant: str
) -> tuple[tuple[int, int, int, int], SkinnyOptions]:
    """(launch, options, defer_sum) of `variant` at a weight [n, k]: the shape's launch with its
    changes."""
    changes, options = VARIANTS[variant]
    launch = dict(zip(LAUNCH_FIELDS, fp8_skinny_configs.skinny_launch(n, k))) | changes
    defer_sum = fp8_skinny_configs.skinny_defers_sum(n, k) != bool(changes.get("flip_sum"))
    return tuple(launch[f] for f in LAUNCH_FIELDS), options, defer_sum


def _configs(default: tuple[int, int, int, int], sweep: bool):
    yield default
    if sweep:
        for cfg in itertools.product((256, 512, 1024), (4096, 8192, 16384), (2, 4, 8), (1, 3)):
            if cfg != default:
                yield cfg


def _variant_call(x, w, s, variant: str, norm_w):
    """The fused path at `variant`: w8a8_skinny, or with a norm weight `norm_w` [K]
    w8a8_skinny_add_norm's output (x its residual and its update)."""
    launch, options, defer_sum = _variant_launch(w.shape[0], w.shape[1], variant)
    if norm_w is not None:
        return fp8_skinny.w8a8_skinny_add_norm(
            x, x, norm_w, 1e-6, w, s, launch=launch, options=options, defer_sum=defer_sum
        )[1]
    return fp8_skinny.w8a8_skinny(
        x, w, s, None, launch=launch, defer_sum=defer_sum, options=options
    )


def _compile_cases(cases: list[tuple[str, str, int, bool]]) -> None:
    """A worker process: one call of each (shape, variant, m, norm), so that Triton's cache holds
    its kernels when the timing process asks."""
    for name, variant, m, norm in cases:
        n, k = SHAPES[name]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.zeros(n, k, device="cuda", dtype=torch.float8_e4m3fn)
        norm_w = torch.ones(k, device="cuda", dtype=x.dtype) if norm else None
        try:
            _variant_call(x, w, torch.ones(n, 1, device="cuda"), variant, norm_w)
        except Exception:  # a launch that does not fit: the timing process reports it
            pass
    torch.cuda.synchronize()


def run_variants(args) -> None:
    """One line per shape and variant: µs per call, GB/s, speed against the plain launch, and the
    largest difference from its output (relative to its largest value)."""
    names = args.shapes.split(",")
    norms = {nm: args.norm and nm in NORM_SHAPES for nm in names}
    cases = [(nm, v, args.m, norms[nm]) for nm in names for v in VARIANTS]
    workers = max(1, min(8, (os.cpu_count() or 2) // 2))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        list(pool.map(_compile_cases, [cases[i::workers] for i in range(workers)]))
    torch.manual_seed(0)
    print(
        f"m={args.m}; x: the plain launch's us / the variant's; (block_k, products, warps, stages)"
    )
    for name in names:
        n, k = SHAPES[name]
        x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
        qs = [
            quantize_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, None)
            for _ in range(COPIES)
        ]
        nbytes = n * k + n * 4
        norm_w = torch.ones(k, device="cuda", dtype=x.dtype) if norms[name] else None
        want = _variant_call(x, *qs[0], "plain", norm_w).float()
        plain, times = None, {}
        for variant in VARIANTS:
            try:
                got = _variant_call(x, *qs[0], variant, norm_w).float()
                us = graph_call_us(lambda i: _variant_call(x, *qs[i % COPIES], variant, norm_w), 20)
            except Exception as e:  # a launch that does not fit (shared memory, registers)
                print(f"{name:16} {variant:24} {type(e).__name__}: {str(e)[:60]}", flush=True)
                continue
            diff = ((got - want).abs().max() / want.abs().max()).item()
            plain = plain or us
            times[variant] = us
            print(
                f"{name + (' +norm' if norms[name] else ''):16} {variant:24} {us:8.2f} us "
                f"{nbytes / us / 1e3:6.0f} GB/s {plain / us:5.2f}x diff {diff:.1e}  "
                f"{_variant_launch(n, k, variant)[0]} defer_sum={_variant_launch(n, k, variant)[2]}",
                flush=True,
            )
        _print_flip(name, n, k, times)


def _print_flip(name: str, n: int, k: int, times: dict[str, float]) -> None:
    """The fp8_skinny_configs entries that make a shape's fastest variant its launch, where it
    beats the plain launch by more than 3%."""
    best = min(times, key=times.get)
    if "plain" not in times or times[best] > 0.97 * times["plain"]:
        print(f"{name:16} keep the plain launch (best {best} {times[best]:.2f} us)", flush=True)
        return
    launch, options, defer_sum = _variant_launch(n, k, best)
    flips = []
    if launch != fp8_skinny_configs.skinny_launch(n, k):
        flips.append(f"SKINNY_SHAPE_LAUNCHES[{(n, k)}] = {launch}")
    if options != SkinnyOptions():
        flips.append(f"SKINNY_SHAPE_OPTIONS[{(n, k)}] = {options!r}")
    if defer_sum != fp8_skinny_configs.skinny_defers_sum(n, k):
        flips.append(f"SKINNY_DEFER_SHAPES {'add' if defer_sum else 'drop'} {(n, k)}")
    print(
        f"{name:16} flip to {best} ({times[best]:.2f} against {times['plain']:.2f} us): "
        + "; ".join(flips),
        flush=True,
    )


def run_stats(args) -> None:
    """sm_90 compile statics of each shape's variants (no GPU): registers, spills, programs per
    SM, the K loop's instructions."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kernel_stats  # a sibling script

    # the model shapes' N, K and split K are multiples of 16, as a launch specializes them
    kernel_stats.DIV16_INTS = (*kernel_stats.DIV16_INTS, "N", "K", "K_SPLIT")

    kernel = fp8_skinny.w8a8_skinny_kernel
    bf = "*bf16"
    pointers = dict(x_ptr=bf, u_ptr=bf, nw_ptr=bf, h_ptr=bf, b_ptr="*fp8e4nv")
    pointers |= dict(b_s_ptr="*fp32", static_ptr="*fp32")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        for variant in VARIANTS:
            launch, options, defer_sum = _variant_launch(n, k, variant)
            norm = args.norm and name in NORM_SHAPES
            plan = fp8_skinny.plan_skinny(
                args.m, n, k, 0, 132, launch, defer_sum, options, norm=norm
            )
            constexprs = dict(plan.constexprs)
            warps = constexprs.pop("num_warps")
            sig = kernel_stats._signature(
                kernel, pointers | dict(c_ptr="*fp32" if plan.split_k > 1 else bf), ("eps",)
            )
            stats = kernel_stats.compile_stats(kernel, sig, constexprs, warps, 3, 90)
            row = dict(shape=name, variant=variant, norm=norm, grid=plan.grid)
            print(json.dumps(row | stats), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=1, help="rows (decode tokens), at most SKINNY_M")
    p.add_argument("--group", type=int, default=None, help="128: block-scaled weights")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names")
    p.add_argument("--sweep", action="store_true", help="also other fused launches")
    p.add_argument(
        "--norm", action="store_true", help="also a residual add + RMSNorm before, apart and fused"
    )
    p.add_argument(
        "--variants", action="store_true", help="the fused path's launch variants, per-row scales"
    )
    p.add_argument("--stats", action="store_true", help="with --variants: sm_90 statics, no GPU")
    args = p.parse_args()
    if args.norm and args.group:
        p.error("--norm: the fused add + norm takes per-row scales (no --group)")
    if args.variants and args.group:
        p.error("--variants: the launch variants take per-row scales (no --group)")
    if args.stats:
        if not args.variants:
            p.error("--stats goes with --variants")
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit(
                "bench_fp8_gemm --stats: unset TRITON_INTERPRET (the interpreter compiles none)"
            )
        return run_stats(args)
    if args.variants:
        return run_variants(args)
    torch.manual_seed(0)
    m, group = args.m, args.group
    print(f"m={m} group={group}; launches as (block_k, products, warps, stages)")
    print(f"{'shape':12} {'bf16 us':>8} {'2-launch':>9} {'fused':>8} {'GB/s':>6}  launch, best")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        default = fp8_skinny_configs.skinny_launch(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        qs = [quantize_fp8(w, group) for w in ws]
        bf16 = graph_call_us(lambda i: F.linear(x, ws[i % COPIES]), 20)

        def two_launch(i):
            q, s = fp8_gemm.quantize_fp8_triton(x, group)
            w, ws_ = qs[i % COPIES]
            return fp8_gemm.w8a8_gemm(q, s, w, ws_, group, x.dtype)

        old = graph_call_us(two_launch, 20)
        results = []
        for cfg in _configs(default, args.sweep):
            try:
                us = graph_call_us(
                    lambda i: fp8_gemm.w8a8_skinny(x, *qs[i % COPIES], group, launch=cfg), 20
                )
            except Exception as e:  # a launch that does not fit (shared memory, registers)
                print(f"  {cfg}: {type(e).__name__}")
                continue
            results.append((us, cfg))
        fused = next(us for us, cfg in results if cfg == default)
        flip = not fp8_skinny_configs.skinny_defers_sum(n, k)
        other = graph_call_us(
            lambda i: fp8_gemm.w8a8_skinny(x, *qs[i % COPIES], group, defer_sum=flip), 20
        )
        best = min(results)
        nbytes = n * k + qs[0][1].numel() * 4
        print(
            f"{name:12} {bf16:8.2f} {old:9.2f} {fused:8.2f} {nbytes / fused / 1e3:6.0f}  "
            f"{default}, {best[0]:.2f} {best[1]}; defer_sum={flip}: {other:.2f}"
        )
        if args.norm:
            update = torch.randn_like(x)
            norm_w = torch.ones(k, device="cuda", dtype=x.dtype)

            def apart(i):
                _, normed = add_rms_norm(x, update, norm_w, 1e-6)
                return fp8_gemm.w8a8_skinny(normed, *qs[i % COPIES], None)

            def prologue(i):
                return fp8_gemm.w8a8_skinny_add_norm(x, update, norm_w, 1e-6, *qs[i % COPIES])

            print(
                f"{'':12} + add/norm: apart {graph_call_us(apart, 20):.2f} us, in the GEMM's launch "
                f"{graph_call_us(prologue, 20):.2f} us"
            )


if __name__ == "__main__":
    main()

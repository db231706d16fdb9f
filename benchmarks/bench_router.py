"""DeepSeekMoE's float32 router projection at decode sizes: `F.linear(x.float(), W)` (cuBLAS, what
GroupedRouter runs with deepseek_moe.ROUTER_KERNEL off) against the one-launch Triton kernel it
runs by default (workers/kernels/moe/router_gemv.py), for V2-Lite's router (64 experts, hidden
2048) and V3's (256, 7168), bfloat16 activations.

    python benchmarks/bench_router.py [--shapes V2-Lite,V3] [--tokens 1,8,32] [--sweep]
    python benchmarks/bench_router.py --stats   # no GPU: registers and spills for sm_90

Prints one line per (shape, tokens): GPU us per call of each from a CUDA graph of calls cycling
through copies of W that together outgrow L2 (W streams from HBM, as between a decode step's
layers), the GB/s of W's bytes, and the largest difference between the two's logits. The kernel
runs at its default launch (`router_config`); --sweep adds a line per other launch (experts a
program x K step x warps x stages), the best marked. Above ROUTER_GEMV_MAX_TOKENS (16) the runtime
keeps F.linear; n = 32 shows the kernel there anyway. --stats compiles each case's default launch
(and with --sweep, every launch) for sm_90 on any machine and prints a JSON line of registers,
spills and programs per SM (benchmarks/kernel_stats.py's compile_stats).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

from atomrt.runtime.bench.cuda_timing import graph_call_us

SHAPES = {"V2-Lite": (64, 2048), "V3": (256, 7168)}  # name: (experts, hidden)
L2_OUTGROWN = 128 << 20  # bytes of W copies a graph cycles through: past the 50-60 MB of L2
# experts a program, K step, warps, stages, sum_last: each launch compiles once (a case ~30-60 s)
SWEEP = tuple(itertools.product((1, 2), (256, 512, 1024, 2048, 4096, 8192), (4, 8), (1, 2), (0, 1)))


def _configs(rg, n: int, experts: int, hidden: int, sweep: bool) -> list:
    default = rg.router_config(n, experts, hidden)
    if not sweep:
        return [default]
    others = [
        rg.RouterConfig(block_e=e, block_k=k, num_warps=w, num_stages=s, sum_last=bool(last))
        for e, k, w, s, last in SWEEP
        if k * triton_pow2(n) <= 8192 and k <= triton_pow2(hidden)
    ]
    return [default, *(c for c in others if c != default)]


def triton_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def _name(c) -> str:
    return (
        f"block_e={c.block_e} block_k={c.block_k} warps={c.num_warps} stages={c.num_stages} "
        f"sum_last={int(c.sum_last)}"
    )


def run_gpu(args) -> None:
    from atomrt.workers.kernels.moe import router_gemv as rg

    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        experts, hidden = SHAPES[shape]
        w_bytes = experts * hidden * 4
        copies = max(2, math.ceil(L2_OUTGROWN / w_bytes))
        weights = [
            0.02 * torch.randn(experts, hidden, device="cuda", generator=gen) for _ in range(copies)
        ]
        for n in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(n, hidden, device="cuda", generator=gen).to(torch.bfloat16)
            ref = F.linear(x.float(), weights[0])
            cublas = graph_call_us(lambda i: F.linear(x.float(), weights[i]), copies)
            rows = []
            for cfg in _configs(rg, n, experts, hidden, args.sweep):
                diff = (rg.router_gemv(x, weights[0], cfg) - ref).abs().max().item()
                us = graph_call_us(lambda i, c=cfg: rg.router_gemv(x, weights[i], c), copies)
                rows.append((us, cfg, diff))
            best = min(r[0] for r in rows)
            for k, (us, cfg, diff) in enumerate(rows):
                tag = "default " if k == 0 else ""
                mark = " (best)" if args.sweep and us == best else ""
                print(
                    f"{shape} E={experts} K={hidden} n={n}: F.linear {cublas:.2f} us "
                    f"({w_bytes / cublas / 1e3:.0f} GB/s), kernel {us:.2f} us "
                    f"({w_bytes / us / 1e3:.0f} GB/s) at {tag}{_name(cfg)}{mark}; "
                    f"max |diff| {diff:.2e}",
                    flush=True,
                )


def run_stats(args) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_stats import _signature, compile_stats  # a sibling script

    from atomrt.workers.kernels.moe import router_gemv as rg

    pointers = {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32"}
    sig = _signature(rg.router_gemv_kernel, pointers, ())
    for shape in args.shapes.split(","):
        experts, hidden = SHAPES[shape]
        for n in (int(t) for t in args.tokens.split(",")):
            for k, cfg in enumerate(_configs(rg, n, experts, hidden, args.sweep)):
                constexprs = dict(
                    BLOCK_N=triton_pow2(n),
                    BLOCK_E=cfg.block_e,
                    BLOCK_K=cfg.block_k,
                    EVEN_K=hidden % cfg.block_k == 0,
                    NUM_STAGES=cfg.num_stages,
                    SUM_LAST=cfg.sum_last,
                )
                stats = compile_stats(
                    rg.router_gemv_kernel, sig, constexprs, cfg.num_warps, cfg.num_stages, 90
                )
                row = dict(shape=shape, n=n, default=k == 0, programs=-(-experts // cfg.block_e))
                row |= dict(block_e=cfg.block_e, block_k=cfg.block_k, warps=cfg.num_warps)
                row |= dict(stages=cfg.num_stages, sum_last=cfg.sum_last)
                print(json.dumps(row | stats), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", default="V2-Lite,V3", help=f"comma-separated: {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="1,8,32", help="comma-separated token counts")
    ap.add_argument("--sweep", action="store_true", help="other launches too")
    ap.add_argument("--stats", action="store_true", help="sm_90 compile statics, no GPU")
    args = ap.parse_args()
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    if args.stats:
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit("bench_router --stats: unset TRITON_INTERPRET (the interpreter compiles none)")
        run_stats(args)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_router: needs a CUDA device (or --stats)")
    run_gpu(args)


if __name__ == "__main__":
    main()

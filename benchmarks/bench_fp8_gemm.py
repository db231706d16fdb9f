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

`python benchmarks/bench_fp8_gemm.py [--m 1] [--sweep] [--group 128] [--norm]`
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from atomrt.runtime.bench.cuda_timing import graph_call_us
from atomrt.workers.kernels.gemm import fp8_gemm, fp8_skinny_configs
from atomrt.workers.kernels.rms_norm import add_rms_norm
from atomrt.workers.layers.quantization.fp8 import quantize_fp8

SHAPES = {  # name: (N, K)
    "8B qkv": (6144, 4096),
    "8B o": (4096, 4096),
    "8B gate_up": (28672, 4096),
    "8B down": (4096, 14336),
    "V2-Lite q": (3072, 2048),
    "V2-Lite o": (2048, 2048),
}
COPIES = 4  # weight copies cycled through: more bytes than the 50-60 MB of L2


def _configs(default: tuple[int, int, int, int], sweep: bool):
    yield default
    if sweep:
        for cfg in itertools.product((256, 512, 1024), (4096, 8192, 16384), (2, 4, 8), (1, 3)):
            if cfg != default:
                yield cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=1, help="rows (decode tokens), at most SKINNY_M")
    p.add_argument("--group", type=int, default=None, help="128: block-scaled weights")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names")
    p.add_argument("--sweep", action="store_true", help="also other fused launches")
    p.add_argument(
        "--norm", action="store_true", help="also a residual add + RMSNorm before, apart and fused"
    )
    args = p.parse_args()
    if args.norm and args.group:
        p.error("--norm: the fused add + norm takes per-row scales (no --group)")
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

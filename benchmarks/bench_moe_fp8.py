"""The fused FP8 experts GEMMs (workers/kernels/moe/fused_moe_fp8.py) at decode rows: GPU µs per
call inside a CUDA graph for each of the two GEMMs (gate_up: hidden -> silu(gate) * up over the
quantized x; down: -> hidden over the quantized activations), at the launch each shape runs by
default (`fp8_moe_launch`) and, with --sweep, at other block_n / block_k / warps / stages, each
checked against the default launch's output. Every call of a graph routes its tokens to other
experts (uniform random top-k), so the experts' weights stream from HBM; GB/s counts the e4m3
weights and scales of the experts a call touches.

    python benchmarks/bench_moe_fp8.py [--shapes V2-Lite] [--tokens 1,8] [--group none,128] [--sweep]

Prints one line per (shape, GEMM, tokens, scales): the default launch and, with --sweep, the
fastest candidate and the line to add to fused_moe_fp8.FP8_MOE_LAUNCHES where it wins by > 3%.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Optional

import torch

from atomrt.runtime.bench.cuda_timing import graph_call_us
from atomrt.workers.kernels.gemm.fp8_gemm import quantize_fp8_triton
from atomrt.workers.kernels.moe import fused_moe_fp8 as fm
from atomrt.workers.kernels.moe.align import moe_align_block_size

SHAPES = {"V2-Lite": (64, 6, 2048, 1408), "V3 /8": (256, 8, 7168, 256)}  # E, top_k, H, I
CALLS = 8  # routings a graph cycles through
# block_n, block_k (per-row scales only), warps, stages
SWEEP = tuple(itertools.product((32, 64, 128), (128, 256), (4, 8), (3, 4, 5)))


def _candidates(grouped: bool, sweep: bool) -> list[fm.FP8MoELaunch]:
    if not sweep:
        return []
    out = []
    for n, k, w, s in SWEEP:
        if grouped and k != 128:
            continue  # block-scaled weights step by their group
        if n * k > 128 * 256 or (w == 8 and n * k < 64 * 256):
            continue  # too many registers a thread; too few columns for 8 warps
        launch = fm.FP8MoELaunch(block_n=n, block_k=k, num_warps=w, num_stages=s)
        if launch != fm.DEFAULT_LAUNCH:
            out.append(launch)
    return out


def _name(launch: fm.FP8MoELaunch) -> str:
    return f"n{launch.block_n} k{launch.block_k} w{launch.num_warps} s{launch.num_stages}"


def _weights(e: int, rows: int, cols: int, group: Optional[int]):
    w = (torch.randn(e, rows, cols, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    groups = (cols + group - 1) // group if group else 1
    return w, torch.rand(e, rows, groups, device="cuda") * 0.01 + 0.001


def bench(shape: str, tokens: int, group: Optional[int], sweep: bool) -> None:
    e, top_k, hidden, inter = SHAPES[shape]
    w13, s13 = _weights(e, 2 * inter, hidden, group)
    w2, s2 = _weights(e, hidden, inter, group)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pairs = tokens * top_k
    routings = []
    for _ in range(CALLS):
        ids = torch.rand(tokens, e, generator=gen, device="cuda").topk(top_k, dim=1).indices
        routings.append(moe_align_block_size(ids.to(torch.int32), fm.BLOCK_M, e))
    weights = torch.rand(pairs, device="cuda")
    qx, sx = quantize_fp8_triton(torch.randn(tokens, hidden, device="cuda").bfloat16(), group)
    qh, sh = quantize_fp8_triton(torch.randn(pairs, inter, device="cuda").bfloat16(), group)
    gemms = {
        "gate_up": (qx, sx, w13, s13, torch.empty(pairs, inter, device="cuda").bfloat16(), top_k),
        "down": (qh, sh, w2, s2, torch.empty(pairs, hidden, device="cuda").bfloat16(), 1),
    }
    for gemm, (a, a_s, w, w_s, out, rows_per_pair) in gemms.items():
        gated = gemm == "gate_up"
        n, k = (inter, hidden) if gated else (hidden, inter)
        touched = min(e, pairs) * (w[0].numel() + w_s[0].numel() * 4)

        def run(i: int, launch=None) -> None:
            fm._launch(
                a, a_s, w, w_s, out, weights, routings[i % CALLS], pairs, rows_per_pair, gated,
                group, launch,
            )  # fmt: skip

        default = fm.fp8_moe_launch(gemm, n, k)
        run(0, default)
        reference = out.clone()
        base = graph_call_us(lambda i: run(i, default), CALLS)
        best, best_us, failed = default, base, 0
        for launch in _candidates(group is not None, sweep):
            try:
                run(0, launch)
                torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)
                us = graph_call_us(lambda i, launch=launch: run(i, launch), CALLS)
            except Exception:  # a launch that fails to compile or mismatches is skipped, counted
                failed += 1
                continue
            if us < best_us:
                best, best_us = launch, us
        line = (
            f"{shape} {gemm} tokens={tokens} group={group}: default {_name(default)} {base:.2f} us"
            f" ({touched / base / 1e3:.0f} GB/s)"
        )
        if sweep:
            line += f"; best {_name(best)} {best_us:.2f} us ({touched / best_us / 1e3:.0f} GB/s)"
            line += f", {failed} skipped"
            if best_us < 0.97 * base:
                line += f"\n    FP8_MOE_LAUNCHES[({gemm!r}, {n}, {k})] = fm.{best!r}"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", default="V2-Lite", help=f"comma-separated of {list(SHAPES)}")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--group", default="none", help="comma-separated: none (per row) or 128")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_fp8.py times CUDA graphs: it needs a GPU")
    print(f"# {torch.cuda.get_device_name()}")
    for shape in args.shapes.split(","):
        for group in args.group.split(","):
            for tokens in map(int, args.tokens.split(",")):
                bench(shape, tokens, None if group == "none" else int(group), args.sweep)


if __name__ == "__main__":
    main()

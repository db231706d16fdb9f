"""MLA's absorbed-weight products at decode rows: torch.bmm (cuBLAS, what absorbed_decode runs by
default) against the one-launch Triton kernel MLA_ABSORB_KERNEL picks (workers/kernels/attention/
mla_absorb.py), on the views absorbed_decode passes: W_UK's product reads q_nope, a column slice of
q [n, H, 192] transposed, into a fresh [H, n, 512]; W_UV's writes into output [n, H, 128] transposed.
DeepSeek-V2-Lite's 16 heads (and V3's per rank at TP 8), V3's 128 heads; bf16.

    python benchmarks/bench_mla_absorb.py [--heads 16,128] [--rows 1,8,32] [--sweep]
    python benchmarks/bench_mla_absorb.py --dry-run [--heads 2 --rows 1,3]

One line per (heads, product, rows): GPU µs per call of each, from a CUDA graph of many calls that
cycles enough weight copies to stream them from HBM (as a step's layers do), the kernel's weight
GB/s and launch plan, and the largest difference between the two results. `--sweep` also times
other launch plans (column tile x reduction tile x warps; at n = 1 also the broadcast-and-sum
products; each compiles, so keep --rows short) and prints the fastest per case. Needs CUDA; `--dry-run` checks the script on CPU through
Triton's interpreter (wall times of two calls, not a measurement).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from atomrt.runtime.bench.cuda_timing import graph_call_us  # noqa: E402
from atomrt.workers.kernels.attention.mla_absorb import (  # noqa: E402
    SKINNY_MAX,
    MLAAbsorbLaunch,
    mla_absorb,
    plan_mla_absorb,
)
from atomrt.workers.kernels.device_info import sm_count  # noqa: E402

NOPE, ROPE, LATENT, V = 128, 64, 512, 128  # V2-Lite's and V3's per-head dims
WEIGHT_BYTES = 128 << 20  # weight copies cycled through: more than twice the 50 MB of L2
SWEEP = [  # 22 tl.dot plans, each a compile
    MLAAbsorbLaunch(block_n=bn, block_k=bk, num_warps=w, num_stages=3)
    for bn, bk, w in itertools.product((16, 32, 64, 128), (64, 128, 256), (2, 4))
    if bn * bk <= 128 * 128
]
SWEEP_ONE_ROW = [  # and at n = 1, 12 broadcast-and-sum plans
    MLAAbsorbLaunch(block_n=bn, block_k=bk, num_warps=w, num_stages=3, broadcast_max_rows=1)
    for bn, bk, w in itertools.product((16, 32, 64), (64, 128), (2, 4))
]
DEVICE = "cpu" if "--dry-run" in sys.argv else "cuda"


def _time_us(fn, copies: int, calls: int = 64) -> float:
    """Median µs of one call, from a CUDA graph of `calls` calls cycling `copies` weight copies
    (the dry run: the wall time of two eager calls)."""
    if DEVICE == "cpu":
        start = time.perf_counter()
        for i in range(2):
            fn(i % copies)
        return (time.perf_counter() - start) * 1e6 / 2
    return graph_call_us(lambda i: fn(i % copies), calls)


def _operands(product: str, heads: int, n: int, copies: int, gen: torch.Generator):
    """(x, weight copies, out) as absorbed_decode passes them."""
    dev, bf16 = DEVICE, torch.bfloat16
    if product == "W_UK":
        q = torch.randn(n, heads, NOPE + ROPE, device=dev, generator=gen).to(bf16)
        x = q[..., :NOPE].transpose(0, 1)
        w = [torch.randn(heads, NOPE, LATENT, device=dev, generator=gen).to(bf16) * 0.1]
        out = torch.empty(heads, n, LATENT, device=dev, dtype=bf16)
    else:
        x = torch.randn(n, heads, LATENT, device=dev, generator=gen).to(bf16).transpose(0, 1)
        x = x.contiguous()  # the decode kernel's latent_out, [H, n, L] contiguous
        w = [torch.randn(heads, LATENT, V, device=dev, generator=gen).to(bf16) * 0.1]
        out = torch.empty(n, heads, V, device=dev, dtype=bf16).transpose(0, 1)
    w += [w[0].clone() for _ in range(copies - 1)]
    return x, w, out


def _plan_text(p: MLAAbsorbLaunch) -> str:
    text = f"block_n={p.block_n} block_k={p.block_k} warps={p.num_warps} stages={p.num_stages}"
    return text + (f" broadcast_max_rows={p.broadcast_max_rows}" if p.broadcast_max_rows else "")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--heads", default="16,128", help="comma-separated query heads per rank")
    ap.add_argument("--rows", default="1,8,32", help="comma-separated decode rows (tokens)")
    ap.add_argument("--sweep", action="store_true", help="also time other launch plans")
    ap.add_argument(
        "--dry-run", action="store_true", help="check the script on CPU (Triton's interpreter)"
    )
    a = ap.parse_args()
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("bench_mla_absorb: needs a CUDA device (or --dry-run)")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    if a.dry_run:
        sms, name = sm_count(torch.device("cpu")), "CPU, Triton's interpreter (dry run)"
    else:
        sms, name = sm_count(torch.device("cuda")), torch.cuda.get_device_name(0)
    print(f"# {name}; absorbed_decode takes the kernel up to n={SKINNY_MAX}")
    for heads, product, n in itertools.product(
        (int(h) for h in a.heads.split(",")), ("W_UK", "W_UV"), (int(r) for r in a.rows.split(","))
    ):
        weight_bytes = heads * NOPE * LATENT * 2  # W_UK's and W_UV's alike
        copies = 2 if a.dry_run else max(2, WEIGHT_BYTES // weight_bytes)
        x, w, out = _operands(product, heads, n, copies, gen)
        want = torch.bmm(x, w[0])
        bmm_us = _time_us(lambda i: torch.bmm(x, w[i], out=out), copies)
        plan = plan_mla_absorb(heads, x.shape[2], w[0].shape[2], sms)
        mla_absorb(x, w[0], out, plan)
        diff = (out.float() - want.float()).abs().max().item()
        kernel_us = _time_us(lambda i: mla_absorb(x, w[i], out, plan), copies)
        line = (
            f"heads={heads} {product} n={n}: bmm {bmm_us:.2f} us, kernel {kernel_us:.2f} us "
            f"({weight_bytes / kernel_us / 1e3:.0f} GB/s, {_plan_text(plan)}), "
            f"max |diff| {diff:.3g} (of max |bmm| {want.abs().max().item():.3g})"
        )
        if a.sweep:
            timed = []
            for p in SWEEP + (SWEEP_ONE_ROW if n == 1 else []):
                try:
                    us = _time_us(lambda i, p=p: mla_absorb(x, w[i], out, p), copies)
                except Exception as e:  # noqa: BLE001 - a plan that does not fit (resources)
                    print(f"#   {_plan_text(p)}: {type(e).__name__}")
                    continue
                mla_absorb(x, w[0], out, p)
                timed.append((us, p, (out.float() - want.float()).abs().max().item()))
            best_us, best, best_diff = min(timed, key=lambda t: t[0])
            line += (
                f"; sweep best {best_us:.2f} us ({_plan_text(best)}, max |diff| {best_diff:.3g}; "
                f"over all {len(timed)} plans {max(t[2] for t in timed):.3g})"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()

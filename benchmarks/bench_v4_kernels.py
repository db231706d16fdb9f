"""DeepSeek-V4's kernels (workers/kernels/v4/) at DeepSeek-V4-Flash's shapes, bf16 cache rows of an
HCA layer (kv | compressor kv | gate | entry, 512 each): the sparse attention (64 query heads of
512, a 128-token window plus the entries) under each launch plan, the compressor (HCA rate 128,
CSA rate 4 with overlapping windows), and the hyper-connections' mixing weights and the query's
rotary embedding (torch's ops against the one launch of v4_hc.py, v4_rope.py).

    python benchmarks/bench_v4_kernels.py [--rows 1,8,32,2048] [--entries 16]
    python benchmarks/bench_v4_kernels.py --dry-run [--rows 1,3]
    python benchmarks/bench_v4_kernels.py --csa-topk 64,4096 [--rows 1,32] [--max-positions N]

One line per (kernel, rows, plan): GPU µs per call, from a CUDA graph of many calls, each over
rows picked at random from a cache larger than L2 (as a step's layers read theirs); the GB/s of
the distinct bytes a call reads (keys or window rows, q) and writes; the largest difference from
the float32 plan `h64`'s result. The attention plans (v4_kernels.ATTN_PLANS): `h64` (up to 64 heads
a program, float32 products), `h16` (16 heads a program: no spills, 4x the programs), `h16-tc`
(and bf16 products on tensor cores: the default, v4_kernels.DEFAULT_ATTN_PLAN), `h16-tc-w8`,
`h32-tc-w8`. Needs CUDA; `--dry-run` checks the
script on CPU through Triton's interpreter (wall times of two calls, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from atomrt.runtime.bench.cuda_timing import graph_call_us  # noqa: E402
from atomrt.workers.kernels.v4 import v4_kernels as v4  # noqa: E402
from atomrt.workers.kernels.v4.v4_index import prefix_topk  # noqa: E402

HEADS, D, WINDOW = 64, 512, 128
WIDTH = 4 * D  # an HCA row: kv | ckv | cgate | centry
CACHE_BYTES = 512 << 20  # more than ten times the 50 MB of L2
DEVICE = "cpu" if "--dry-run" in sys.argv else "cuda"
# the model's bfloat16; the dry run's float16 (Triton's interpreter multiplies bfloat16 as bits)
DTYPE = torch.float16 if DEVICE == "cpu" else torch.bfloat16


def _time_us(fn, copies: int) -> float:
    """Median µs of one call, from a CUDA graph of calls cycling `copies` operand sets (32 calls;
    4 for a prefill's large sets, whose calls take milliseconds) (the dry run: the wall time of two
    eager calls)."""
    if DEVICE == "cpu":
        start = time.perf_counter()
        for i in range(2):
            fn(i % copies)
        return (time.perf_counter() - start) * 1e6 / 2
    return graph_call_us(lambda i: fn(i % copies), 32 if copies > 2 else 4)


def bench_attention(n: int, entries: int, slots: int, copies: int, gen: torch.Generator) -> None:
    rows = torch.randn(slots, WIDTH, device=DEVICE, generator=gen).to(DTYPE)
    q = torch.randn(n, HEADS, D, device=DEVICE, generator=gen).to(DTYPE)
    sinks = torch.randn(HEADS, device=DEVICE, generator=gen)
    out = torch.empty_like(q)
    offsets = []
    for _ in range(copies):  # each call's window of consecutive slots and its entries' slots
        start = torch.randint(0, slots - WINDOW, (n, 1), device=DEVICE, generator=gen)
        window = (start + torch.arange(WINDOW, device=DEVICE)) * WIDTH
        picked = torch.randint(0, slots, (n, entries), device=DEVICE, generator=gen)
        offsets.append(torch.cat((window, picked * WIDTH + 3 * D), dim=1))
    nbytes = n * (WINDOW + entries) * D * 2 + 2 * q.numel() * 2
    want = None
    for name in v4.ATTN_PLANS:
        v4.use_attn_plan(name)
        v4.v4_sparse_attention(q, rows, offsets[0], sinks, D**-0.5, out)
        got = out.float()
        want = got.clone() if want is None else want
        us = _time_us(lambda i: v4.v4_sparse_attention(q, rows, offsets[i], sinks, D**-0.5, out),
                      copies)  # fmt: skip
        print(
            f"attention rows={n} keys={WINDOW}+{entries} plan={name}: {us:.2f} us, "
            f"{nbytes / us / 1e3:.0f} GB/s, max |diff| {(got - want).abs().max().item():.3g}",
            flush=True,
        )
    v4.use_attn_plan(v4.DEFAULT_ATTN_PLAN)


def bench_pool(n: int, rate: int, overlap: bool, slots: int, copies: int, gen: torch.Generator):
    c = 2 if overlap else 1
    width = 2 * c * D + 2 * D  # kv | ckv | cgate | entry (CSA's projections twice as wide)
    rows = torch.randn(slots, width, device=DEVICE, generator=gen).to(DTYPE)
    ape = torch.randn(rate, c * D, device=DEVICE, generator=gen)
    norm = torch.randn(D, device=DEVICE, generator=gen)
    windows = torch.randint(1, 1000, (n,), device=DEVICE, generator=gen)
    span = c * rate
    all_slots = [
        torch.randint(0, slots - span, (n, 1), device=DEVICE, generator=gen)
        + torch.arange(span, device=DEVICE)
        for _ in range(copies)
    ]
    out = torch.empty(n, D, device=DEVICE, dtype=DTYPE)
    nbytes = n * span * 2 * D * 2 + out.numel() * 2

    def call(i: int) -> None:
        v4.v4_pool(rows, all_slots[i], windows, ape, norm, D, D + c * D, 1e-6, overlap, out)

    us = _time_us(call, copies)
    kind = "csa" if overlap else "hca"
    print(f"pool {kind} rate={rate} rows={n}: {us:.2f} us, {nbytes / us / 1e3:.0f} GB/s",
          flush=True)  # fmt: skip
    windows.fill_(-1)  # rows that end no window, as most of a decode step's rows
    print(f"pool {kind} rate={rate} rows={n} ending no window: {_time_us(call, copies):.2f} us",
          flush=True)  # fmt: skip


def bench_hc_mix(n: int, gen: torch.Generator) -> None:
    """One block's mHC mixing weights (hc 4, 20 Sinkhorn iterations, Flash's): the torch ops, as a
    level-0 graph records them, against the one launch of v4_hc.py (v4_hyper.HC_MIX_KERNEL)."""
    from atomrt.workers.kernels.v4.v4_hc import v4_hc_mix
    from atomrt.workers.layers.v4_hyper import hc_mix

    hc, iters, eps = 4, 20, 1e-6
    mixes = torch.randn(n, (2 + hc) * hc, device=DEVICE, generator=gen)
    scale = torch.rand(3, device=DEVICE, generator=gen)
    base = torch.randn((2 + hc) * hc, device=DEVICE, generator=gen)
    torch_us = _time_us(lambda i: hc_mix(mixes, scale, base, hc, iters, eps), 16)
    kernel_us = _time_us(lambda i: v4_hc_mix(mixes, scale, base, hc, iters, eps), 16)
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(hc_mix(mixes, scale, base, hc, iters, eps),
                        v4_hc_mix(mixes, scale, base, hc, iters, eps))
    )  # fmt: skip
    print(f"hc_mix rows={n}: torch {torch_us:.2f} us, kernel {kernel_us:.2f} us, "
          f"max |diff| {diff:.3g}", flush=True)  # fmt: skip


def bench_rope(n: int, gen: torch.Generator) -> None:
    """The query's rotary embedding ([n, 64, 512], its last 64 channels): torch's ops against the
    one launch of v4_rope.py (v4_modules.ROPE_KERNEL)."""
    from atomrt.workers.kernels.v4.v4_rope import v4_rope_tail
    from atomrt.workers.layers.v4_modules import rope_tail

    q = torch.randn(n, HEADS, D, device=DEVICE, generator=gen).to(DTYPE)
    angles = torch.rand(n, 1, 32, device=DEVICE, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    torch_us = _time_us(lambda i: rope_tail(q, cos, sin), 16)
    kernel_us = _time_us(lambda i: v4_rope_tail(q, cos, sin), 16)
    diff = (rope_tail(q, cos, sin).float() - v4_rope_tail(q, cos, sin).float()).abs().max().item()
    print(f"rope q rows={n}: torch {torch_us:.2f} us, kernel {kernel_us:.2f} us "
          f"({2 * q.numel() * q.element_size() / kernel_us / 1e3:.0f} GB/s), "
          f"max |diff| {diff:.3g}", flush=True)  # fmt: skip


def chunked_topk(scores: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A candidate for a long row's top-k: the top k of each `chunk` columns (many short slices,
    side by side), then the top k of those; the same values as `scores.topk(k)` (a row's top k
    are among its chunks' top k), indices alike up to ties."""
    n, t = scores.shape
    c = -(-t // chunk)
    padded = torch.nn.functional.pad(scores, (0, c * chunk - t), value=float("-inf"))
    v1, i1 = padded.view(n, c, chunk).topk(min(k, chunk), dim=-1)
    i1 = i1 + (torch.arange(c, device=scores.device) * chunk).view(1, c, 1)
    v2, i2 = v1.view(n, -1).topk(k, dim=-1)
    return v2, i1.view(n, -1).gather(1, i2)


def bench_csa_topk(
    n: int, live: int, max_positions: int, topk: int, chunk: int, gen: torch.Generator
) -> None:
    """A CSA layer's indexer region at V4-Flash's indexer (64 heads of 128, rate 4): the scores
    (v4_index_scores) and torch's top-k over the T = max positions // 4 entries a graph-safe step
    (FULL) gives every row, `live` of them visible, against the same over the `live` entries alone
    (what a segment-by-segment replay plans from the step's lengths), and the candidates
    `chunked_topk` over T and `prefix_topk` (workers/kernels/v4/v4_index.py) over each row's
    live prefix, in each of its forms."""
    hi, di, t = 64, 128, max_positions // 4
    keys = torch.randn(max(4 * t, 4096), di, device=DEVICE, generator=gen).to(DTYPE)
    iq = torch.randn(n, hi, di, device=DEVICE, generator=gen).to(DTYPE)
    iw = torch.randn(n, hi, device=DEVICE, generator=gen)
    slots = torch.randint(0, keys.shape[0], (n, t), device=DEVICE, generator=gen)
    slots[:, live:] = -1
    live_slots = slots[:, :live].contiguous()
    full = v4.v4_index_scores(iq, iw, keys, slots, 0)
    k = min(topk, t)
    want, got = full.topk(k, dim=-1).values, chunked_topk(full, k, chunk)[0]
    same = bool(torch.equal(want, got))
    scores_t = _time_us(lambda i: v4.v4_index_scores(iq, iw, keys, slots, 0), 2)
    topk_t = _time_us(lambda i: full.topk(k, dim=-1), 2)
    chunked_t = _time_us(lambda i: chunked_topk(full, k, chunk), 2)
    lens = torch.full((n,), live, dtype=torch.int32, device=DEVICE)
    top = full.topk(k, dim=-1)

    def same_scores(picks: torch.Tensor) -> bool:
        """picks name entries of torch's top-k scores (equal scores may come in either order)"""
        got = torch.where(picks >= 0, full.gather(1, picks.clamp(min=0)), float("-inf"))
        return torch.equal(got, top.values)

    same_picks = same_scores(prefix_topk(full, lens, k))
    prefix_t = _time_us(lambda i: prefix_topk(full, lens, k), 2)
    same_select = same_scores(prefix_topk(full, lens, k, "select"))
    select_t = _time_us(lambda i: prefix_topk(full, lens, k, "select"), 2)
    same_chunked = same_scores(prefix_topk(full, lens, k, "chunked"))
    chunked_p = _time_us(lambda i: prefix_topk(full, lens, k, "chunked"), 2)
    same_torch = same_scores(prefix_topk(full, lens, k, "torch"))
    torch_p = _time_us(lambda i: prefix_topk(full, lens, k, "torch"), 2)
    short = v4.v4_index_scores(iq, iw, keys, live_slots, 0)
    scores_l = _time_us(lambda i: v4.v4_index_scores(iq, iw, keys, live_slots, 0), 2)
    topk_l = _time_us(lambda i: short.topk(min(k, live), dim=-1), 2)
    print(
        f"csa indexer rows={n} entries={t} live={live} top-{k}: over all {scores_t:.2f} us scores "
        f"+ {topk_t:.2f} us topk (chunks of {chunk}: {chunked_t:.2f} us, values equal: {same}; "
        f"prefix_topk {prefix_t:.2f} us, same picks: {same_picks}; "
        f"select {select_t:.2f} us, same picks: {same_select}; "
        f"chunked {chunked_p:.2f} us, same picks: {same_chunked}; "
        f"torch {torch_p:.2f} us, same picks: {same_torch}); "
        f"over the live {scores_l:.2f} + {topk_l:.2f} us",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", default="1,8,32,2048", help="comma-separated query rows")
    ap.add_argument("--entries", type=int, default=16, help="compressed entries a row attends")
    ap.add_argument(
        "--dry-run", action="store_true", help="check the script on CPU (Triton's interpreter)"
    )
    ap.add_argument(
        "--csa-topk",
        default=None,
        help="only the CSA indexer's scores and top-k at these live entries (comma-separated)",
    )
    ap.add_argument("--max-positions", type=int, default=1 << 20, help="with --csa-topk")
    ap.add_argument("--topk", type=int, default=512, help="with --csa-topk: index_topk")
    ap.add_argument("--chunk", type=int, default=4096, help="with --csa-topk: chunked_topk's")
    a = ap.parse_args()
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("bench_v4_kernels: needs a CUDA device (or --dry-run)")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    name = "CPU, Triton's interpreter (dry run)" if a.dry_run else torch.cuda.get_device_name(0)
    print(f"# {name}; DeepSeek-V4-Flash: {HEADS} heads of {D}, window {WINDOW}")
    if a.csa_topk:
        for n in (int(r) for r in a.rows.split(",")):
            for live in (int(x) for x in a.csa_topk.split(",")):
                bench_csa_topk(n, live, a.max_positions, a.topk, a.chunk, gen)
        return
    slots = 4096 if a.dry_run else CACHE_BYTES // (WIDTH * 2)
    for n in (int(r) for r in a.rows.split(",")):
        copies = 2 if a.dry_run or n >= 512 else 16
        bench_attention(n, a.entries, slots, copies, gen)
        for rate, overlap in ((128, False), (4, True)):
            bench_pool(n, rate, overlap, slots, copies, gen)
        bench_hc_mix(n, gen)
        bench_rope(n, gen)


if __name__ == "__main__":
    main()

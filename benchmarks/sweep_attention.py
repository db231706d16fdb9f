"""Decode attention at the model shapes: GPU time of forced launch plans (needs a CUDA GPU).

    python benchmarks/sweep_attention.py [--json FILE]

For each shape (SmolLM2-135M bs=1, Llama-3.2-1B bs=32, Llama-3.1-8B bs=1, KV capacity 2048 as in
the graph-safe launch) and context length, the GPU time of one call replayed from a CUDA graph for
split counts x keys per tile x warps, next to the default plan (`plan_attention`, graph-safe).
Also the host cost of the pieces of one eager call (Triton launches, graph launches).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
import triton
import triton.testing

from atomrt.workers.kernels.attention.paged_attention import (
    launch_attention,
    plan_attention,
    unified_attention,
    write_kv_cache,
)

SHAPES = {  # name: (batch, kv heads, group, head dim)
    "SmolLM2-135M bs=1": (1, 3, 3, 64),
    "Llama-3.2-1B bs=32": (32, 8, 4, 64),
    "Llama-3.2-1B bs=1": (1, 8, 4, 64),
    "Llama-3.1-8B bs=1": (1, 8, 4, 128),
}
CAPACITY, BLOCK = 2048, 16


def setup(bs, kvh, group, hd, ctx):
    dev, dt = "cuda", torch.bfloat16
    max_blocks = CAPACITY // BLOCK
    num_blocks = bs * max_blocks
    k_cache = torch.randn(num_blocks, BLOCK, kvh, hd, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=dev).to(torch.int32).view(bs, max_blocks)
    q = torch.randn(bs, kvh * group, hd, device=dev, dtype=dt)
    out = torch.empty_like(q)
    cu = torch.arange(bs + 1, dtype=torch.int32, device=dev)
    lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, out, cu, lens, tables


def gpu_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    return triton.testing.do_bench(g.replay) * 1e3 / 20


def host_us(fn, n=300) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


def sweep(rows: list) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (bs, kvh, group, hd) in SHAPES.items():
        for ctx in (256, 1024):
            args = setup(bs, kvh, group, hd, ctx)
            q, k_cache, v_cache, out, cu, lens, tables = args
            base = plan_attention(bs, 1, CAPACITY, kvh, group, hd, sms)

            def run(plan):
                return lambda: launch_attention(
                    plan,
                    q,
                    k_cache,
                    v_cache,
                    out,
                    cu,
                    lens,
                    tables,
                    hd**-0.5,
                    num_seqs=bs,
                    reduce_rows=bs,
                )

            default = gpu_us(run(base))
            best = (default, base)
            for splits in (1, 2, 4, 8, 16, 32):
                for tile_n in (32, 64, 128):
                    for warps in (2, 4):
                        plan = dataclasses.replace(
                            base, num_splits=splits, tile_n=tile_n, num_warps=warps
                        )
                        try:
                            us = gpu_us(run(plan))
                        except Exception as e:  # a tile that does not compile for this shape
                            print(f"  skip {splits=} {tile_n=} {warps=}: {type(e).__name__}")
                            continue
                        rows.append(
                            dict(
                                shape=name,
                                ctx=ctx,
                                splits=splits,
                                tile_n=tile_n,
                                warps=warps,
                                us=round(us, 2),
                            )
                        )
                        if us < best[0]:
                            best = (us, plan)
            b = best[1]
            print(
                f"{name:22s} ctx={ctx:5d}: default (splits={base.num_splits}, tile_n={base.tile_n}, "
                f"warps={base.num_warps}) {default:6.2f} us; best splits={b.num_splits} tile_n={b.tile_n} "
                f"warps={b.num_warps} {best[0]:6.2f} us",
                flush=True,
            )


def host_costs() -> None:
    bs, kvh, group, hd = SHAPES["SmolLM2-135M bs=1"]
    q, k_cache, v_cache, out, cu, lens, tables = setup(bs, kvh, group, hd, 1024)
    k = torch.randn(bs, kvh, hd, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(bs, device="cuda")
    x = torch.zeros(16, device="cuda")
    cu_cpu, lens_cpu = [0, 1], [1024]
    one = torch.cuda.CUDAGraph()
    with torch.cuda.graph(one):
        x.add_(1)
    many = torch.cuda.CUDAGraph()
    with torch.cuda.graph(many):
        for _ in range(430):
            x.add_(1)
    for label, fn in [
        ("torch x.add_(1)", lambda: x.add_(1)),
        ("torch.empty(4096)", lambda: torch.empty(4096, device="cuda")),
        ("write_kv_cache (1 Triton launch)", lambda: write_kv_cache(k, k, k_cache, v_cache, slots)),
        (
            "unified_attention eager, ctx 1024 (host plan)",
            lambda: unified_attention(
                q,
                k_cache,
                v_cache,
                out,
                cu,
                lens,
                tables,
                hd**-0.5,
                num_seqs=1,
                max_seqlen_q=1,
                max_seqlen_k=1024,
                graph_safe=False,
                cu_seqlens_q_cpu=cu_cpu,
                context_lens_cpu=lens_cpu,
            ),
        ),
        (
            "unified_attention graph-safe (split + reduce)",
            lambda: unified_attention(
                q,
                k_cache,
                v_cache,
                out,
                cu,
                lens,
                tables,
                hd**-0.5,
                num_seqs=1,
                max_seqlen_q=1,
                max_seqlen_k=1024,
                graph_safe=True,
            ),
        ),
        ("CUDAGraph.replay, 1 kernel", one.replay),
        ("CUDAGraph.replay, 430 kernels", many.replay),
    ]:
        print(f"host {label:48s} {host_us(fn):7.1f} us/call", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    host_costs()
    rows: list = []
    sweep(rows)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()

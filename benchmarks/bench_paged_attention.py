"""Decode / prefill timings of the paged-attention kernels (needs a CUDA GPU):

    python benchmarks/bench_paged_attention.py

One line per configuration: GPU time of one call replayed from a CUDA graph (no host overhead),
the host-side cost of one eager call, and the KV bytes read per second against the GPU time.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton.testing

from atomrt.workers.kernels.attention.paged_attention import unified_attention


def bench(
    batch_size: int,
    ctx: int,
    num_q: int,
    graph_safe: bool,
    num_kv_heads: int = 8,
    group: int = 4,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    dev = "cuda"
    max_blocks = triton.cdiv(ctx, block_size)
    num_blocks = batch_size * max_blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = (
        torch.randperm(num_blocks, device=dev).to(torch.int32).view(batch_size, max_blocks)
    )
    q = torch.randn(batch_size * num_q, num_kv_heads * group, head_dim, device=dev, dtype=dtype)
    out = torch.empty_like(q)
    cu_cpu = [i * num_q for i in range(batch_size + 1)]
    ctx_cpu = [ctx] * batch_size
    cu = torch.tensor(cu_cpu, dtype=torch.int32, device=dev)
    context_lens = torch.tensor(ctx_cpu, dtype=torch.int32, device=dev)

    def call() -> None:
        unified_attention(
            q,
            k_cache,
            v_cache,
            out,
            cu,
            context_lens,
            block_tables,
            head_dim**-0.5,
            num_seqs=batch_size,
            max_seqlen_q=num_q,
            max_seqlen_k=ctx,
            graph_safe=graph_safe,
            cu_seqlens_q_cpu=cu_cpu,
            context_lens_cpu=ctx_cpu,
        )

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    gpu_ms = triton.testing.do_bench(graph.replay)
    t0 = time.perf_counter()
    for _ in range(200):
        call()
    host_us = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    kv_bytes = 2 * batch_size * ctx * num_kv_heads * head_dim * k_cache.element_size()
    return dict(
        bs=batch_size,
        ctx=ctx,
        num_q=num_q,
        graph_safe=graph_safe,
        gpu_us=round(gpu_ms * 1e3, 1),
        host_us=round(host_us, 1),
        kv_gbps=round(kv_bytes / gpu_ms / 1e6),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.parse_args()
    rows = []
    for bs, ctx, num_q in [
        (1, 1024, 1),
        (32, 1024, 1),
        (1, 8192, 1),
        (64, 4096, 1),
        (16, 2048, 4),
        (1, 4096, 2048),
    ]:
        for graph_safe in (False, True):
            row = bench(bs, ctx, num_q, graph_safe)
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

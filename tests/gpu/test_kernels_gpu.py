"""Paged-attention Triton kernels on CUDA at real sizes, in fp16/bf16, against a float64 reference.

Run on the GPU machine:  python -m pytest -m gpu tests/gpu/test_kernels_gpu.py
(the decode speed figures print even without -s). The CPU tier (tests/test_kernels.py) checks the
same kernels through Triton's interpreter at tiny sizes.

Every cache slot that no sequence owns and every padded q row holds NaN, so any out-of-bounds or
unmasked read shows up as a NaN in the output.
"""

from __future__ import annotations

import functools

import pytest
import test_kernels as cpu_tier
import torch
from test_kernels import PagedBatch  # the batch layout the CPU tier uses too

from atomrt.workers.kernels.attention.paged_attention import (
    rope_write_kv,
    unified_attention,
    write_kv_cache,
)
from atomrt.workers.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.gpu

SENTINEL = 7.0
TOLERANCES = {torch.float16: dict(atol=5e-3, rtol=1e-2), torch.bfloat16: dict(atol=3e-2, rtol=5e-2)}


# The CPU tier's batch builder and float64 reference, on the GPU at real sizes.
make_batch = functools.partial(cpu_tier.make_batch, device="cuda")
reference_attention = cpu_tier.reference_attention


def run_attention(
    batch: PagedBatch, out: torch.Tensor, *, graph_safe: bool, max_seqlen_q: int
) -> None:
    unified_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        out,
        batch.cu_seqlens_q,
        batch.context_lens,
        batch.block_tables,
        batch.q.shape[2] ** -0.5,
        num_seqs=batch.num_seqs,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max(batch.context_lens_cpu),
        graph_safe=graph_safe,
        cu_seqlens_q_cpu=batch.cu_seqlens_q_cpu,
        context_lens_cpu=batch.context_lens_cpu,
    )


def check_output(batch: PagedBatch, out: torch.Tensor) -> None:
    ref = reference_attention(batch, batch.q.shape[2] ** -0.5)
    n = batch.num_real_rows
    assert not torch.isnan(out[:n]).any(), "NaN in output: a masked or out-of-range slot was read"
    torch.testing.assert_close(out[:n].double(), ref, **TOLERANCES[batch.q.dtype])
    assert torch.all(out[n:] == SENTINEL), "padded output rows were written"


def scenario(name: str, seed: int) -> tuple[list[int], list[int]]:
    """(lens_q, lens_k) of a realistic step."""
    g = torch.Generator().manual_seed(seed)
    if name == "decode64":  # a big decode batch, contexts up to 4096
        lens_k = torch.randint(1, 4097, (64,), generator=g).tolist()
        return [1] * 64, lens_k
    if name == "decode1_long":  # one long sequence: the split-KV path
        return [1], [4000]
    if name == "mtp4":  # 4 rows per sequence (MTP verify)
        lens_k = torch.randint(4, 3001, (16,), generator=g).tolist()
        return [4] * 16, lens_k
    if name == "mixed":  # chunked prefill with prior context next to decodes
        return [700, 1, 256, 1, 33, 1], [3000, 2500, 256, 17, 1200, 1]
    raise ValueError(name)


@pytest.mark.parametrize("graph_safe", [False, True], ids=["host", "graph"])
@pytest.mark.parametrize("name", ["decode64", "decode1_long", "mtp4", "mixed"])
@pytest.mark.parametrize("group,head_dim", [(1, 128), (4, 128), (8, 64), (4, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_attention_matches_float64(
    dtype: torch.dtype, group: int, head_dim: int, name: str, graph_safe: bool
) -> None:
    lens_q, lens_k = scenario(name, seed=group + head_dim)
    block_size = 32 if head_dim == 64 else 16
    max_blocks = 4096 // block_size + 1
    batch = make_batch(
        lens_q,
        lens_k,
        num_kv_heads=8 if group < 8 else 4,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        max_blocks=max_blocks,
        dtype=dtype,
        pad_seqs=3 if graph_safe else 0,
        pad_rows=5,
        seed=len(name),
    )
    out = torch.full_like(batch.q, SENTINEL)
    run_attention(batch, out, graph_safe=graph_safe, max_seqlen_q=max(lens_q))
    check_output(batch, out)


def test_compile_ahead_compiles_each_variant_once_and_launches_nothing() -> None:
    """Under `compile_ahead` the attention launches compile their variants on threads and launch
    nothing; after it, the same launches compile nothing more and match float64. A head size
    and block size no other test uses, so the variants are new to this process."""
    from atomrt.workers.kernels.attention.attention_kernels import (
        paged_attention_kernel,
        reduce_splits_kernel,
    )
    from atomrt.workers.kernels.launch import compile_ahead

    def cached() -> int:  # kernels in Triton's in-process caches for this device
        device = torch.cuda.current_device()
        return sum(
            len(k.device_caches[device][0]) for k in (paged_attention_kernel, reduce_splits_kernel)
        )

    batches = [
        make_batch(
            lens_q,
            lens_k,
            num_kv_heads=2,
            group=3,
            head_dim=80,
            block_size=8,
            max_blocks=4096 // 8 + 1,
            dtype=torch.float16,
            seed=i,
        )
        for i, (lens_q, lens_k) in enumerate(
            [([1], [4000]), ([700, 1, 33], [3000, 2500, 1200]), ([5] * 16, [64] * 16)]
        )
    ]

    def rows(batch: PagedBatch) -> int:
        cu = batch.cu_seqlens_q_cpu
        return max(b - a for a, b in zip(cu, cu[1:]))

    before = cached()
    outs = [torch.full_like(b.q, SENTINEL) for b in batches]
    with compile_ahead() as ahead:
        assert ahead
        for batch, out in zip(batches, outs):
            run_attention(batch, out, graph_safe=False, max_seqlen_q=rows(batch))
    torch.cuda.synchronize()
    ahead_compiled = cached() - before
    assert ahead_compiled >= 2, ahead_compiled  # tile variants (the split merge may be cached)
    assert all(torch.all(out == SENTINEL) for out in outs), "a launch ran under compile_ahead"
    for batch, out in zip(batches, outs):
        run_attention(batch, out, graph_safe=False, max_seqlen_q=rows(batch))
        check_output(batch, out)
    assert cached() - before == ahead_compiled, "a variant compiled after compile_ahead"


def _compiled(kernel) -> list:
    """The compiled kernels in Triton's in-process cache for this device."""
    return list(kernel.device_caches[torch.cuda.current_device()][0].values())


def test_compile_ahead_loads_what_it_compiled_and_covers_gemm_and_argmax() -> None:
    """The skinny GEMM and the argmax launch through `launch` too: under `compile_ahead` they
    compile and launch nothing; every kernel compiled there is loaded onto the device there (its
    module is in, so the first launch loads nothing); after it the launches compile nothing more
    and match torch. Shapes no other test uses, so the variants are new to this process."""
    from atomrt.workers.kernels.argmax import argmax_rows, argmax_rows_kernel
    from atomrt.workers.kernels.gemm.skinny_gemm import skinny_linear
    from atomrt.workers.kernels.gemm.skinny_kernels import skinny_gemm_kernel
    from atomrt.workers.kernels.launch import compile_ahead

    torch.manual_seed(0)
    xs = [torch.randn(m, 328, device="cuda", dtype=torch.bfloat16) for m in (1, 3, 7)]
    weight = torch.randn(200, 328, device="cuda", dtype=torch.bfloat16) / 16
    logits = torch.randn(5, 50_021, device="cuda", dtype=torch.float32)
    kernels = (skinny_gemm_kernel, argmax_rows_kernel)
    before = {k: len(_compiled(k)) for k in kernels}
    with compile_ahead() as ahead:
        assert ahead
        ys = [skinny_linear(x, weight) for x in xs]
        argmax_rows(logits)
    torch.cuda.synchronize()
    new = {k: _compiled(k)[before[k] :] for k in kernels}
    assert new[skinny_gemm_kernel] and new[argmax_rows_kernel], "nothing compiled ahead"
    for k, compiled in new.items():
        for c in compiled:
            assert getattr(c, "module", None) is not None, f"{k.__name__} compiled, not loaded"
    counts = {k: len(_compiled(k)) for k in kernels}
    ys = [skinny_linear(x, weight) for x in xs]
    tokens = argmax_rows(logits)
    for x, y in zip(xs, ys):
        ref = (x.double() @ weight.double().T).to(torch.bfloat16)
        torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert {k: len(_compiled(k)) for k in kernels} == counts, "compiled after compile_ahead"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache(dtype: torch.dtype, block_size: int) -> None:
    num_tokens, num_kv_heads, head_dim, num_blocks = 300, 8, 128, 40
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    k_cache = torch.full(
        (num_blocks, block_size, num_kv_heads, head_dim), SENTINEL, device="cuda", dtype=dtype
    )
    v_cache = torch.full_like(k_cache, -SENTINEL)
    slot_mapping = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slot_mapping[::7] = -1
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    written = slot_mapping >= 0
    k_flat, v_flat = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )
    assert torch.equal(k_flat[slot_mapping[written]], k[written])
    assert torch.equal(v_flat[slot_mapping[written]], v[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device="cuda")
    untouched[slot_mapping[written]] = False
    assert torch.all(k_flat[untouched] == SENTINEL) and torch.all(v_flat[untouched] == -SENTINEL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 64), (32, 8, 128)])
def test_rope_write_kv(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """The fused rotary + KV write at the model shapes against float64, q and k strided views of one
    qkv row; within one rounding of the unfused torch rotary (RotaryEmbedding) as well."""
    num_tokens, num_blocks, block_size = 300, 40, 16
    rotary = RotaryEmbedding(head_dim, max_position=4096, theta=500000.0).cuda()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device="cuda", dtype=dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = (t.reshape(num_tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
    slot_mapping = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slot_mapping[::7] = -1
    k_cache = torch.full(
        (num_blocks, block_size, num_kv_heads, head_dim), SENTINEL, device="cuda", dtype=dtype
    )
    v_cache = torch.full_like(k_cache, -SENTINEL)
    q_rot = rope_write_kv(
        q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_cache, v_cache, slot_mapping
    )
    cos, sin = rotary.cos_cache[positions].to(dtype), rotary.sin_cache[positions].to(dtype)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(q_rot.double(), cpu_tier._rotate_ref(q, cos, sin), **tol)
    written = slot_mapping >= 0
    k_flat, v_flat = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )
    torch.testing.assert_close(
        k_flat[slot_mapping[written]].double(), cpu_tier._rotate_ref(k, cos, sin)[written], **tol
    )
    assert torch.equal(v_flat[slot_mapping[written]], v[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device="cuda")
    untouched[slot_mapping[written]] = False
    assert torch.all(k_flat[untouched] == SENTINEL) and torch.all(v_flat[untouched] == -SENTINEL)
    q_torch, _ = rotary(positions, q, k)
    torch.testing.assert_close(q_rot, q_torch, **tol)


@pytest.mark.parametrize("max_seqlen_q", [1, 4])
def test_cuda_graph_replay_with_new_metadata(max_seqlen_q: int) -> None:
    """FULL mode: capture unified_attention(graph_safe=True) for a bucket, then put other lengths,
    block tables and q into the same buffers, replay, and compare with eager and float64."""
    dtype, bucket_seqs, block_size, max_blocks = torch.bfloat16, 8, 16, 256  # KV capacity 4096
    layout = dict(
        num_kv_heads=8,
        group=4,
        head_dim=128,
        block_size=block_size,
        max_blocks=max_blocks,
        dtype=dtype,
        num_blocks=bucket_seqs * max_blocks,
    )
    rows = bucket_seqs * max_seqlen_q

    def bucket_batch(lens_k: list[int], seed: int) -> PagedBatch:
        """Real sequences first, then padded ones (0 rows, 0 context), then padded rows up to the bucket."""
        lens_q = [min(max_seqlen_q, n) for n in lens_k]
        return make_batch(
            lens_q,
            lens_k,
            pad_seqs=bucket_seqs - len(lens_k),
            pad_rows=rows - sum(lens_q),
            seed=seed,
            **layout,
        )

    static = bucket_batch([100, 4096, 1, 37, 2000, 16], seed=1)
    out = torch.full_like(static.q, SENTINEL)
    run_attention(
        static, out, graph_safe=True, max_seqlen_q=max_seqlen_q
    )  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_attention(static, out, graph_safe=True, max_seqlen_q=max_seqlen_q)

    for seed, lens_k in [(2, [4000, 3]), (3, [1, 2, 3, 4, 5, 6, 7, 3333]), (4, [4096])]:
        new = bucket_batch(lens_k, seed)
        for name in ("q", "k_cache", "v_cache", "cu_seqlens_q", "context_lens", "block_tables"):
            getattr(static, name).copy_(getattr(new, name))
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        eager = torch.full_like(out, SENTINEL)
        run_attention(new, eager, graph_safe=False, max_seqlen_q=max_seqlen_q)
        n = new.num_real_rows
        torch.testing.assert_close(out[:n], eager[:n], atol=2e-2, rtol=2e-2)
        check_output(new, out)


@pytest.mark.parametrize("batch_size", [1, 32])
def test_decode_speed(batch_size: int, capsys: pytest.CaptureFixture[str]) -> None:
    """Prints decode figures at context 1024 (Llama-3-8B-like heads: 32 q / 8 kv, head_dim 128, bf16):
    GPU time of one call replayed from a CUDA graph, and host time of one eager (host-planned) call.
    More configurations: python benchmarks/bench_paged_attention.py"""
    import time

    import triton.testing

    ctx, dtype = 1024, torch.bfloat16
    batch = make_batch(
        [1] * batch_size,
        [ctx] * batch_size,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        block_size=16,
        max_blocks=ctx // 16,
        dtype=dtype,
    )
    out = torch.full_like(batch.q, SENTINEL)
    run_attention(batch, out, graph_safe=True, max_seqlen_q=1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_attention(batch, out, graph_safe=True, max_seqlen_q=1)
    gpu_ms = triton.testing.do_bench(graph.replay)
    check_output(batch, out)
    start = time.perf_counter()
    for _ in range(100):
        run_attention(batch, out, graph_safe=False, max_seqlen_q=1)
    host_us = (time.perf_counter() - start) * 1e4
    torch.cuda.synchronize()
    kv_bytes = 2 * batch_size * ctx * 8 * 128 * batch.k_cache.element_size()
    with capsys.disabled():
        print(
            f"\ndecode bs={batch_size} ctx={ctx} bf16: GPU {gpu_ms * 1e3:.1f} us/call ({kv_bytes / gpu_ms / 1e6:.0f} GB/s "
            f"of KV), host {host_us:.0f} us per eager call"
        )


def test_plain_launches_repeat_through_the_kernels_memo() -> None:
    """`launch` keeps each fitting call's compiled kernel: the norm and the rotary + KV write
    launched again on new tensors (new addresses, the same specialization) run the kept kernel,
    not Triton's dispatch, and still match their float64 references."""
    from atomrt.workers.kernels import launch as launch_mod
    from atomrt.workers.kernels.attention.paged_attention import rope_write_kv_kernel
    from atomrt.workers.kernels.rms_norm import add_rms_norm, add_rms_norm_kernel

    gen = torch.Generator(device="cuda").manual_seed(3)
    for m in (7, 300, 7):  # the grid is not part of the key
        x, update = (torch.randn(m, 2048, device="cuda", generator=gen).half() for _ in range(2))
        weight = (1 + 0.1 * torch.randn(2048, device="cuda", generator=gen)).half()
        h, out = add_rms_norm(x, update, weight, 1e-5)
        h64 = (x + update).double()
        want = weight.double() * (h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5))
        assert torch.equal(h, x + update)
        torch.testing.assert_close(out.double(), want, **TOLERANCES[torch.float16])
    assert launch_mod._MEMOS[add_rms_norm_kernel].hits >= 2

    test_rope_write_kv(torch.bfloat16, 32, 8, 128)  # its references, through a kept launch now
    hits = launch_mod._MEMOS[rope_write_kv_kernel].hits
    test_rope_write_kv(torch.bfloat16, 32, 8, 128)
    assert launch_mod._MEMOS[rope_write_kv_kernel].hits == hits + 1

"""The one-launch decode kernel on CUDA at the model shapes, fp16/bf16, against float64: rotary, KV
write and attention, split and unsplit, and replayed from a CUDA graph with new lengths each time
(the split counters must be back at zero after every launch, in and out of graphs).

Run on the GPU machine:  python -m pytest -m gpu tests/gpu/test_decode_attention_gpu.py
The CPU tier (tests/test_decode_attention.py) runs the same checks through Triton's interpreter.
"""

from __future__ import annotations

import functools

import pytest
import test_decode_attention as cpu_tier
import torch

from atomrt.workers.kernels.attention import decode_attention as decode_module
from atomrt.workers.kernels.attention.decode_attention import (
    attention_step,
    prepare_decode_counters,
)

pytestmark = pytest.mark.gpu

TOLERANCES = {torch.float16: dict(atol=5e-3, rtol=1e-2), torch.bfloat16: dict(atol=3e-2, rtol=5e-2)}
make_case = functools.partial(cpu_tier.make_decode_case, device="cuda")


def step(case: cpu_tier.DecodeCase, out: torch.Tensor, *, graph_safe: bool) -> None:
    b, r = case.batch, case.rotary
    attention_step(
        b.q,
        case.k,
        case.v,
        out,
        case.positions,
        r.cos_cache,
        r.sin_cache,
        b.k_cache,
        b.v_cache,
        case.slot_mapping,
        b.cu_seqlens_q,
        b.context_lens,
        b.block_tables,
        b.q.shape[2] ** -0.5,
        num_seqs=b.num_seqs,
        max_seqlen_q=1,
        max_seqlen_k=max(b.context_lens_cpu),
        graph_safe=graph_safe,
        cu_seqlens_q_cpu=b.cu_seqlens_q_cpu,
        context_lens_cpu=b.context_lens_cpu,
    )


def check(case: cpu_tier.DecodeCase, out: torch.Tensor) -> None:
    cpu_tier.check(case, out, **TOLERANCES[case.batch.q.dtype])
    assert torch.all(prepare_decode_counters(out.device) == 0), "split counters not reset"


def copy_case(static: cpu_tier.DecodeCase, new: cpu_tier.DecodeCase) -> None:
    """Write `new`'s inputs, caches and metadata into `static`'s tensors (same shapes)."""
    for name in ("q", "k_cache", "v_cache", "cu_seqlens_q", "context_lens", "block_tables"):
        getattr(static.batch, name).copy_(getattr(new.batch, name))
    for name in ("k", "v", "positions", "slot_mapping"):
        getattr(static, name).copy_(getattr(new, name))


def bucket_case(lens_k: list[int], seed: int, bucket_seqs: int) -> cpu_tier.DecodeCase:
    """A Llama-8B-shaped bf16 decode case padded to `bucket_seqs` sequences, 257 blocks each (a
    KV capacity of 4112 keys): cases of one bucket fit the same tensors (copy_case)."""
    return make_case(
        lens_k,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        pad_seqs=bucket_seqs - len(lens_k),
        pad_rows=bucket_seqs - len(lens_k),
        dtype=torch.bfloat16,
        seed=seed,
        max_blocks=257,
        num_blocks=bucket_seqs * 257 + 3,
    )


SCENARIOS = {
    "bs1_short": [170],  # the latency benchmark's context
    "bs1_long": [4000],  # split over the SMs
    "bs3_mixed": [1, 300, 3999],  # one split launch, each sequence its own number of working splits
    "bs64": [
        int(x) for x in torch.randint(1, 4001, (64,), generator=torch.Generator().manual_seed(0))
    ],
}


@pytest.mark.parametrize("graph_safe", [False, True], ids=["host", "graph"])
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize(
    "group,head_dim,num_kv_heads",
    [(3, 64, 3), (4, 64, 8), (4, 128, 8), (8, 128, 1)],
    ids=["smollm", "llama1b", "llama8b", "gqa8-1kv"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_matches_float64(
    dtype: torch.dtype, group: int, head_dim: int, num_kv_heads: int, name: str, graph_safe: bool
) -> None:
    case = make_case(
        SCENARIOS[name],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        pad_seqs=2 if graph_safe else 0,
        pad_rows=3,
        dtype=dtype,
        seed=len(name) + group,
        max_blocks=300,
    )  # a KV capacity of 4800 keys: the graph-safe plan splits small batches
    out = torch.full_like(case.batch.q, cpu_tier.SENTINEL)
    step(case, out, graph_safe=graph_safe)
    check(case, out)


@pytest.mark.parametrize("bucket_seqs", [1, 4])
def test_graph_replay_with_new_lengths(bucket_seqs: int) -> None:
    """Capture a decode bucket once (split: the capacity is 4096 keys), then replay it with contexts
    that need 1, a few and all of its splits, each against float64, and the counters at zero."""
    dtype, head_dim, num_kv_heads = torch.bfloat16, 128, 8  # bucket_case's

    static = bucket_case([4096] * bucket_seqs, 1, bucket_seqs)
    out = torch.full_like(static.batch.q, cpu_tier.SENTINEL)
    step(static, out, graph_safe=True)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static, out, graph_safe=True)
    lens_list = (
        [[170], [1], [4096], [2000], [300]]
        if bucket_seqs == 1
        else [[1, 4096, 700], [170] * 4, [3000, 2]]
    )
    for seed, lens_k in enumerate(lens_list, start=2):
        new = bucket_case(lens_k, seed, bucket_seqs)
        sb, nb = static.batch, new.batch
        copy_case(static, new)
        out.fill_(cpu_tier.SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_k, _ = cpu_tier.expected(new)  # from the new case's own (unwritten) caches
        n = nb.num_real_rows
        assert not torch.isnan(out[:n]).any()
        torch.testing.assert_close(out[:n].double(), ref_out, **TOLERANCES[dtype])
        assert torch.all(out[n:] == cpu_tier.SENTINEL)
        written = new.slot_mapping >= 0
        torch.testing.assert_close(
            sb.k_cache.view(-1, num_kv_heads, head_dim)[new.slot_mapping[written]].double(),
            ref_k,
            **TOLERANCES[dtype],
        )
        assert torch.all(prepare_decode_counters(out.device) == 0)


def test_repeated_launches_come_from_the_memo_and_stay_exact() -> None:
    """Eager decode launches past the first of each specialization skip Triton's dispatch: new
    cases of the same shapes (new tensors, new lengths, split and unsplit) count as memo hits, and
    each still matches float64 with the split counters back at zero."""
    memo = decode_module._DECODE_LAUNCHES
    scenarios = [[170], [4000], [1, 300, 3999]]
    for lens_k in scenarios:  # first launches: compile and keep
        case = make_case(
            lens_k, num_kv_heads=8, group=4, head_dim=128, dtype=torch.bfloat16, max_blocks=300
        )
        step(case, torch.full_like(case.batch.q, cpu_tier.SENTINEL), graph_safe=False)
    hits = memo.hits
    for seed in range(1, 4):
        for lens_k in scenarios:
            case = make_case(
                lens_k,
                num_kv_heads=8,
                group=4,
                head_dim=128,
                dtype=torch.bfloat16,
                seed=seed,
                max_blocks=300,
            )
            out = torch.full_like(case.batch.q, cpu_tier.SENTINEL)
            step(case, out, graph_safe=False)
            check(case, out)
    assert memo.hits - hits == 3 * len(scenarios), (memo.hits, memo.misses)


def test_bound_launches_follow_new_data_in_the_same_tensors(monkeypatch) -> None:
    """An eager region passes the same tensors at every step: after the first launch of each plan
    the whole launch is bound and repeated. New q/k/v, caches and lengths written into the same
    tensors -- contexts that need one, a few and all splits -- each match float64, and the bound
    launches are what ran (memo hits, no new dispatch)."""
    dtype, head_dim, seqs = torch.bfloat16, 128, 3

    static = bucket_case([170, 5, 9], 1, seqs)
    out = torch.full_like(static.batch.q, cpu_tier.SENTINEL)
    planned = []  # calls of the unbound path
    unbound = decode_module._decode_launch
    monkeypatch.setattr(
        decode_module, "_decode_launch", lambda *a, **kw: planned.append(1) or unbound(*a, **kw)
    )
    lens_list = [[170, 5, 9], [4000, 3000, 2], [1, 300, 4000], [170, 5, 9], [4000, 3000, 2]]
    for seed, lens_k in enumerate(lens_list, start=2):
        new = bucket_case(lens_k, seed, seqs)
        sb, nb = static.batch, new.batch
        copy_case(static, new)
        out.fill_(cpu_tier.SENTINEL)
        calls = len(planned)
        attention_step(
            sb.q, static.k, static.v, out, static.positions,
            static.rotary.cos_cache, static.rotary.sin_cache, sb.k_cache, sb.v_cache,
            static.slot_mapping, sb.cu_seqlens_q, sb.context_lens, sb.block_tables,
            head_dim**-0.5, num_seqs=seqs, max_seqlen_q=1, max_seqlen_k=max(lens_k),
            graph_safe=False, cu_seqlens_q_cpu=nb.cu_seqlens_q_cpu, context_lens_cpu=nb.context_lens_cpu,
        )  # fmt: skip
        torch.cuda.synchronize()
        ref_out, _, _ = cpu_tier.expected(new)
        n = nb.num_real_rows
        torch.testing.assert_close(out[:n].double(), ref_out, **TOLERANCES[dtype])
        assert torch.all(prepare_decode_counters(out.device) == 0)
        if seed >= 5:  # the plans of the first three steps are bound: the launch was repeated
            assert len(planned) == calls
    assert any(len(plans) >= 2 for _, plans in decode_module._BOUND.values())

"""The CPU reference attention: a decode step's one batched SDPA against per-sequence attention."""

import random

import pytest
import torch

from atomrt.workers.layers.attention_ref import causal_sdpa, paged_attention_ref


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_decode_step_matches_per_sequence_attention(num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    block_size, head_dim, num_blocks, max_blocks = 4, 8, 40, 6
    context_lens = [1, 7, 13, 4, 21]  # one block, partial blocks, the longest sets the padding
    num_seqs = len(context_lens)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)
    block_tables = torch.full((num_seqs, max_blocks), -1, dtype=torch.int32)
    for s, n in enumerate(context_lens):
        used = -(-n // block_size)
        block_tables[s, :used] = torch.tensor(order[s * max_blocks : s * max_blocks + used])
    q = torch.randn(num_seqs + 2, num_heads, head_dim, generator=gen)  # two padded rows
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    paged_attention_ref(
        q,
        k_cache,
        v_cache,
        out,
        list(range(num_seqs + 1)),
        context_lens,
        block_tables,
        scale,
        num_seqs,
    )
    for s, n in enumerate(context_lens):
        blocks = block_tables[s, : -(-n // block_size)].long()
        keys, values = k_cache[blocks].flatten(0, 1)[:n], v_cache[blocks].flatten(0, 1)[:n]
        want = causal_sdpa(q[s : s + 1], keys, values, scale, n - 1)
        torch.testing.assert_close(out[s : s + 1], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[num_seqs:], torch.zeros_like(out[num_seqs:]))

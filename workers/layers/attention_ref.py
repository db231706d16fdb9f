"""Torch reference attention over the paged KV cache: the CPU path of the attention op.

Plain torch, eager (it runs inside the opaque custom op, never traced). A decode step (one query
row per sequence) gathers every sequence's context in one index of the block tables, padded to the
longest, and runs one SDPA with a key mask: per-sequence calls would cost the host more than the
arithmetic. Other steps loop over sequences: each gathers its context with one index of its
block_table and runs SDPA with the causal mask shifted to the sequence's position.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] at slot_mapping (rows with -1 are skipped);
    an FP8 cache takes k / k_scale and v / v_scale, saturated to e4m3's range."""
    num_tokens = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    # [num_blocks, block_size, num_kv_heads, head_dim] -> [num_slots, num_kv_heads, head_dim]
    copy_rows(k_cache.view(-1, *k_cache.shape[2:]), slots, k[:num_tokens][valid], k_scale)
    copy_rows(v_cache.view(-1, *v_cache.shape[2:]), slots, v[:num_tokens][valid], v_scale)


def copy_rows(
    cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: float = 1.0
) -> None:
    """cache[slots] = rows in the cache's dtype, an e4m3 cache's over its per-tensor `scale` (it
    copies bytes: CPU's index_copy_ has no float8 kernel)."""
    rows = to_cache_dtype(rows, cache.dtype, scale)
    if cache.dtype == torch.float8_e4m3fn:
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache.index_copy_(0, slots, rows)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x in a cache's dtype: an e4m3 cache holds x / scale (its per-tensor scale, the factor that
    dequantizes it) saturated at +-448; any other cache is a plain cast."""
    if dtype == torch.float8_e4m3fn:
        if scale != 1.0:
            x = x.float() / scale
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(dtype)


def from_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache rows widened to `dtype`: an e4m3 cache's times its per-tensor `scale`."""
    if x.dtype == torch.float8_e4m3fn and scale != 1.0:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first_pos: int
) -> torch.Tensor:
    """Attention of q [n_q, num_heads, head_dim] over k, v [n_k, num_kv_heads, head_dim].

    Query row j sits at position first_pos + j and sees keys 0..first_pos + j. Returns
    [n_q, num_heads, head_dim].
    """
    n_q, num_heads, _ = q.shape
    n_k, num_kv_heads, _ = k.shape
    qh = q.transpose(0, 1)  # [num_heads, n_q, head_dim]
    kh = k.transpose(0, 1)  # [num_kv_heads, n_k, head_dim]
    vh = v.transpose(0, 1)
    if num_heads != num_kv_heads:  # GQA: query head h reads kv head h // group
        group = num_heads // num_kv_heads
        kh = kh.repeat_interleave(group, dim=0)  # [num_heads, n_k, head_dim]
        vh = vh.repeat_interleave(group, dim=0)
    mask: Optional[torch.Tensor] = None
    if not (n_q == 1 and first_pos == n_k - 1):  # a decode row sees every key: no mask
        key_pos = torch.arange(n_k, device=q.device)
        query_pos = first_pos + torch.arange(n_q, device=q.device)
        mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [n_q, n_k]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)  # [n_q, num_heads, head_dim]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q_cpu: list[int],
    context_lens_cpu: list[int],
    block_tables: torch.Tensor,
    scale: float,
    num_seqs: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Causal attention of each sequence's query rows over its cached context, written into out
    (an FP8 cache's rows dequantized by k_scale / v_scale)."""
    if num_seqs > 0 and cu_seqlens_q_cpu[: num_seqs + 1] == list(range(num_seqs + 1)):
        decode_attention_ref(
            q,
            k_cache,
            v_cache,
            out,
            context_lens_cpu[:num_seqs],
            block_tables,
            scale,
            k_scale,
            v_scale,
        )
        return
    block_size = k_cache.shape[1]
    for s in range(num_seqs):
        q_start, q_end = cu_seqlens_q_cpu[s], cu_seqlens_q_cpu[s + 1]
        n_q, context_len = q_end - q_start, context_lens_cpu[s]
        if n_q == 0:
            continue
        num_blocks = -(-context_len // block_size)
        blocks = block_tables[s, :num_blocks].long()
        # [context_len, num_kv_heads, head_dim], widened from an FP8 cache
        keys = from_cache_dtype(k_cache[blocks].flatten(0, 1)[:context_len], q.dtype, k_scale)
        values = from_cache_dtype(v_cache[blocks].flatten(0, 1)[:context_len], q.dtype, v_scale)
        out[q_start:q_end] = causal_sdpa(q[q_start:q_end], keys, values, scale, context_len - n_q)
    out[cu_seqlens_q_cpu[num_seqs] :] = 0


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    context_lens_cpu: list[int],
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attention of one query row per sequence (row s at position context_lens_cpu[s] - 1, which sees
    its whole context) over the paged cache, written into out[:num_seqs]; rows past them are zeroed."""
    num_seqs = len(context_lens_cpu)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_blocks = -(-max(context_lens_cpu) // block_size)
    max_len = num_blocks * block_size
    # Table entries past a sequence's end (-1) read block 0: their keys are masked.
    blocks = (
        block_tables[:num_seqs, :num_blocks].long().clamp_min(0).flatten()
    )  # [num_seqs * num_blocks]
    # [num_blocks_total, block_size, num_kv_heads, head_dim] -> [num_seqs, num_kv_heads, max_len, head_dim]
    keys = from_cache_dtype(  # widened from an FP8 cache
        k_cache.index_select(0, blocks).view(num_seqs, max_len, num_kv_heads, head_dim),
        q.dtype,
        k_scale,
    ).transpose(1, 2)
    values = from_cache_dtype(
        v_cache.index_select(0, blocks).view(num_seqs, max_len, num_kv_heads, head_dim),
        q.dtype,
        v_scale,
    ).transpose(1, 2)
    context_lens = torch.tensor(context_lens_cpu, device=q.device)
    mask = torch.arange(max_len, device=q.device) < context_lens.unsqueeze(1)  # [num_seqs, max_len]
    queries = q[:num_seqs].unsqueeze(2)  # [num_seqs, num_heads, 1, head_dim]
    attn = F.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=mask.view(num_seqs, 1, 1, max_len),
        scale=scale,
        enable_gqa=queries.shape[1] != num_kv_heads,
    )
    out[:num_seqs] = attn.squeeze(2)
    out[num_seqs:] = 0


def causal_attention_no_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q_cpu: list[int],
    scale: float,
) -> None:
    """Profiling/dummy runs: each sequence attends causally to its own rows only."""
    for s in range(len(cu_seqlens_q_cpu) - 1):
        start, end = cu_seqlens_q_cpu[s], cu_seqlens_q_cpu[s + 1]
        if end > start:
            out[start:end] = causal_sdpa(q[start:end], k[start:end], v[start:end], scale, 0)
    out[cu_seqlens_q_cpu[-1] :] = 0

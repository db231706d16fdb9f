"""Torch reference of multi-head latent attention over the paged latent cache: the CPU path of the
MLA op, and what its Triton kernels are checked against.

Plain torch, eager (it runs inside the opaque custom op, never traced). A latent cache row is
[kv_c (kv_lora_rank) | k_pe (rope_dim, rotated)]. Two ways to attend, equal up to rounding:

- decompressed (prompt chunks): each sequence's latent context goes through
  kv_b_proj into per-head keys [k_nope | k_pe] (qk_nope + rope wide) and values (v_head_dim wide),
  then causal attention as any other;
- absorbed (decode and verify rows): W_UK is folded into the query
  (q_nope @ W_UK -> kv_lora_rank wide), so every head attends the latent rows themselves (MQA,
  keys the whole row, values its first kv_lora_rank columns), and W_UV maps the result back to
  v_head_dim. The context is never decompressed.

`mla_paged_ref` attends the step's sequences each way it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atomrt.workers.layers.attention_ref import causal_sdpa, from_cache_dtype


@dataclass(frozen=True)
class MLAWeights:
    """A layer's heads on this rank: kv_b_proj and the absorbed weights derived from it."""

    kv_b: torch.Tensor  # [num_heads * (qk_nope + v_head_dim), kv_lora_rank]
    w_uk: torch.Tensor  # [num_heads, qk_nope, kv_lora_rank]
    w_uv: torch.Tensor  # [num_heads, kv_lora_rank, v_head_dim]


def absorb_query(q: torch.Tensor, w_uk: torch.Tensor, qk_nope: int) -> torch.Tensor:
    """q [n, H, qk_nope + rope] (q_pe rotated) -> [n, H, kv_lora_rank + rope]: q_nope @ W_UK, q_pe."""
    q_nope, q_pe = q[..., :qk_nope], q[..., qk_nope:]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [n, H, kv_lora_rank]
    return torch.cat((q_latent, q_pe), dim=-1)


def unabsorb_output(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """[n, H, kv_lora_rank] -> [n, H, v_head_dim]: each head's latent output through its W_UV."""
    return torch.bmm(out_latent.transpose(0, 1), w_uv).transpose(0, 1)


def decompress(
    latent: torch.Tensor, kv_b: torch.Tensor, num_heads: int, qk_nope: int, kv_lora_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows [n, kv_lora_rank + rope] -> keys [n, H, qk_nope + rope], values [n, H, v]."""
    kv_c, k_pe = latent[:, :kv_lora_rank], latent[:, kv_lora_rank:]
    kv = F.linear(kv_c, kv_b).view(latent.shape[0], num_heads, -1)  # [n, H, qk_nope + v]
    k_nope, values = kv[..., :qk_nope], kv[..., qk_nope:]
    keys = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, num_heads, -1)), dim=-1)
    return keys, values


def _context(kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's latent rows [context_len, kv_lora_rank + rope] from the paged cache."""
    num_blocks = -(-context_len // kv_cache.shape[1])
    blocks = block_table[:num_blocks].long()
    return kv_cache[blocks].flatten(0, 1)[:context_len]


def mla_paged_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    absorbed: list[tuple[int, int, int, int]],
    decompressed: list[tuple[int, int, int, int]],
    block_tables: torch.Tensor,
    weights: MLAWeights,
    scale: float,
    kv_scale: float = 1.0,
) -> None:
    """Attention of each (sequence index, first row, rows, context length) in `absorbed` (decode
    and verify rows) and in `decompressed` (prompt chunks) over the paged latent cache (an FP8
    cache widened over `kv_scale`): q [n, H, qk_nope + rope] -> out [n, H, v_head_dim] at those
    rows."""
    args = (block_tables, weights, scale, kv_scale)
    _absorbed_ref(q, kv_cache, out, absorbed, *args)
    _decompressed_ref(q, kv_cache, out, decompressed, *args)


def _decompressed_ref(q, kv_cache, out, seqs, block_tables, weights, scale, kv_scale) -> None:
    """Decompressed causal attention, one SDPA a sequence."""
    num_heads, qk_nope, kv_lora_rank = weights.w_uk.shape
    for s, start, n_q, context_len in seqs:
        latent = from_cache_dtype(
            _context(kv_cache, block_tables[s], context_len), q.dtype, kv_scale
        )
        keys, values = decompress(latent, weights.kv_b, num_heads, qk_nope, kv_lora_rank)
        out[start : start + n_q] = causal_sdpa(
            q[start : start + n_q], keys, values, scale, context_len - n_q
        )


def _absorbed_ref(q, kv_cache, out, seqs, block_tables, weights, scale, kv_scale) -> None:
    """Absorbed attention, one SDPA over all of `seqs`: row j of a sequence of n rows sees keys
    0..context_len - n + j."""
    if not seqs:
        return
    num_heads, qk_nope, kv_lora_rank = weights.w_uk.shape
    block_size = kv_cache.shape[1]
    max_q = max(n for _, _, n, _ in seqs)
    max_blocks = -(-max(max(c for _, _, _, c in seqs), 1) // block_size)
    max_len = max_blocks * block_size
    rows = torch.tensor(
        [[start + min(j, n - 1) for j in range(max_q)] for _, start, n, _ in seqs],
        device=q.device,
    )  # [S, max_q]: a short sequence repeats its last row (its extra outputs are dropped)
    tables = block_tables[[s for s, _, _, _ in seqs], :max_blocks].long().clamp_min(0)
    latent = kv_cache.index_select(0, tables.flatten()).view(len(seqs), 1, max_len, -1)
    latent = from_cache_dtype(latent, q.dtype, kv_scale)  # widened from an FP8 cache
    queries = absorb_query(q[rows.flatten()], weights.w_uk, qk_nope)
    queries = queries.view(len(seqs), max_q, num_heads, -1).transpose(1, 2)  # [S, H, max_q, L + R]
    first = torch.tensor([c - n for _, _, n, c in seqs], device=q.device)
    limit = first.unsqueeze(1) + torch.arange(max_q, device=q.device).clamp_max(
        torch.tensor([n - 1 for _, _, n, _ in seqs], device=q.device).unsqueeze(1)
    )  # [S, max_q]: the last key each row sees
    mask = torch.arange(max_len, device=q.device) <= limit.unsqueeze(-1)  # [S, max_q, max_len]
    attn = F.scaled_dot_product_attention(
        queries,
        latent,
        latent[..., :kv_lora_rank],
        attn_mask=mask.unsqueeze(1),
        scale=scale,
        enable_gqa=True,
    )  # [S, H, max_q, kv_lora_rank]
    attended = unabsorb_output(attn.transpose(1, 2).flatten(0, 1), weights.w_uv)
    attended = attended.view(len(seqs), max_q, num_heads, -1)
    for i, (_, start, n, _) in enumerate(seqs):
        out[start : start + n] = attended[i, :n]


def mla_no_cache_ref(
    q: torch.Tensor,
    latent: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q_cpu: list[int],
    weights: MLAWeights,
    scale: float,
) -> None:
    """Profiling / dummy runs: each sequence attends causally to its own rows' latents
    [n, kv_lora_rank + rope], decompressed."""
    num_heads, qk_nope, kv_lora_rank = weights.w_uk.shape
    keys, values = decompress(latent, weights.kv_b, num_heads, qk_nope, kv_lora_rank)
    for start, end in zip(cu_seqlens_q_cpu, cu_seqlens_q_cpu[1:]):
        if end > start:
            out[start:end] = causal_sdpa(q[start:end], keys[start:end], values[start:end], scale, 0)
    out[cu_seqlens_q_cpu[-1] :] = 0

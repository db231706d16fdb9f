"""DeepSeek sparse attention (DSA) over multi-head latent attention: DeepSeek-V3.2's attention,
and its one custom op, `torch.ops.atomrt.dsa_mla_attention`.

MLA (workers/layers/mla.py) whose queries each attend only the `index_topk` earlier tokens a
lightning indexer scores highest (every token when fewer are visible):

    score_t = sum_h w_h * relu(q^I_h . k^I_t / sqrt(Di)),  w = weights_proj(x) / sqrt(Hi)
    q^I = rope(wq_b q_res) [Hi, Di],  k^I = rope(LayerNorm(wk x)) [Di]

the rotary embedding on the first `qk_rope_head_dim` channels in halves (not interleaved, unlike
MLA's own), with MLA's cos / sin. `wk` and `weights_proj` read the same normed hidden state as the
latent projections, so they join the fused `fused_qkv_a_proj` GEMM.

The cache: one row per token, the MLA latent row [kv_c | k_pe] then the indexer's key k^I
(`DSALayerSpec`, kind "dsa_mla"). The eager region `_dsa_attend` decompresses each sequence's
latents through kv_b_proj and attends with the indexer's mask, planned from the step's sequences;
under a request graph's metadata (FULL records the region inline) it is planned from shapes alone:
every slot of a row's block table scored (the Triton indexer kernel on CUDA), the top-k's latents
attended with absorbed weights.
Tensor parallelism splits the query heads and kv_b_proj as MLA's; the indexer is whole on each
rank.
"""

# No `from __future__ import annotations` here: the op's schema is inferred from real annotations.

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from atomrt.compile.custom_register import direct_register_custom_op
from atomrt.graphs.markers import eager_region
from atomrt.workers.layers.attention import paged_layer_state
from atomrt.workers.layers.linear import MergedColumnParallelLinear
from atomrt.workers.layers.mla import MLAAttention, write_latent_ref
from atomrt.workers.layers.mla_ref import decompress
from atomrt.workers.layers.paged_rows import (
    index_scores,
    read_rows,
    returns_nothing,
    row_seqs,
    sequence_rows,
    step_sequences,
)
from atomrt.workers.layers.rotary import _rotate


@dataclass(frozen=True)
class DSALayerSpec:
    layer_idx: int
    latent_width: int  # kv_lora_rank + qk_rope_head_dim
    index_head_dim: int
    kind = "dsa_mla"

    def elements_per_token(self) -> int:
        return self.latent_width + self.index_head_dim

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> "DSACacheTensor":
        shape = (num_blocks, block_size, self.elements_per_token())
        return DSACacheTensor(self.layer_idx, torch.zeros(shape, dtype=dtype, device=device))


@dataclass
class DSACacheTensor:
    layer_idx: int
    kv_cache: torch.Tensor  # [num_blocks, block_size, kv_lora_rank + rope + index_head_dim]


class DSAIndexer(nn.Module):
    """`wq_b` and `k_norm` (the checkpoint's `self_attn.indexer.*`; `wk` and `weights_proj` live in
    the fused projection)."""

    def __init__(self, q_lora_rank: int, n_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)


class DSAMLAAttention(MLAAttention):
    def __init__(
        self,
        *mla_args: object,
        index_n_heads: int,
        index_head_dim: int,
        index_topk: int,
        shares_topk: bool = False,
        index_rope_interleave: bool = False,
        **mla_kwargs: object,
    ) -> None:
        """MLAAttention's arguments, then the indexer's."""
        super().__init__(*mla_args, **mla_kwargs)
        self.index_topk, self.index_rope_interleave = index_topk, index_rope_interleave
        # a layer that shares the top-k reuses the previous indexer layer's picks (GLM-5)
        self.indexer = (
            None if shares_topk else DSAIndexer(self.q_lora_rank, index_n_heads, index_head_dim)
        )
        if self.indexer is not None:
            # the latent projections, then the indexer's key and head weights: one GEMM
            fused = self.fused_qkv_a_proj  # [q_lora_rank, latent] wide, whole on every rank
            self.fused_qkv_a_proj = MergedColumnParallelLinear(
                fused.weight.shape[1],
                [*fused.output_sizes_per_rank, index_head_dim, index_n_heads],
                fused.bias is not None,
            )

    def kv_cache_spec(self) -> DSALayerSpec:
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        return DSALayerSpec(self.layer_idx, latent, self.indexer.head_dim if self.indexer else 0)

    def forward(self, positions: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """a: the normed input through `in_proj` [n, q_lora + latent (+ Di + Hi)] -> [n, hidden]."""
        idx = self.indexer
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        if idx is None:
            return self._forward(positions, *a.split([self.q_lora_rank, latent], -1), None, None)
        return self._forward(
            positions, *a.split([self.q_lora_rank, latent, idx.head_dim, idx.n_heads], -1)
        )

    def _forward(
        self,
        positions: torch.Tensor,
        q_c: torch.Tensor,
        kv_a: torch.Tensor,
        k_i: "Optional[torch.Tensor]",
        w_i: "Optional[torch.Tensor]",
    ) -> torch.Tensor:
        idx = self.indexer
        q_res = self.q_a_layernorm(q_c)
        q = self.q_b_proj(q_res)
        kv_c, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        q = q.view(-1, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        iq = iw = None
        if idx is not None:
            iq = idx.wq_b(q_res).view(-1, idx.n_heads, idx.head_dim)
            k_i = F.layer_norm(k_i, (idx.head_dim,), idx.k_norm.weight, idx.k_norm.bias, 1e-6)
            iw = w_i.float() * idx.n_heads**-0.5
        output = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        torch.ops.atomrt.dsa_mla_attention(
            q, kv_c, k_pe, iq, k_i, iw, output, positions, self.layer_idx
        )
        return self.o_proj(output.view(-1, self.num_heads * self.v_head_dim))


def _rope_head(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """The first 2 * cos.shape[-1] channels of x rotated, in halves (DeepSeek-V3.2) or in
    interleaved pairs (GLM-5; written back de-interleaved, as MLA's rotary does: only the
    indexer's dot products read them); the rest as they are."""
    rd = 2 * cos.shape[-1]
    return torch.cat((_rotate(x[..., :rd], cos, sin, interleaved), x[..., rd:]), dim=-1)


# The picks of the last indexer layer, per (step metadata, sequence): what a layer that shares
# the top-k attends (the layers of a step run in order; each microbatch has its own metadata).
_LAST_PICKS: dict = {}


def dsa_mla_attention(
    q: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    iq: Optional[torch.Tensor],
    ik: Optional[torch.Tensor],
    iw: Optional[torch.Tensor],
    output: torch.Tensor,
    positions: torch.Tensor,
    layer_idx: int,
) -> None:
    """q [n, H, nope + rope]; kv_c_normed [n, kv_lora]; k_pe [n, rope]; iq [n, Hi, Di]; ik [n, Di]
    (normed); iw [n, Hi] float32; output [n, H, v_head_dim]. Rotates, writes the rows, attends."""
    layer, md, cache = paged_layer_state(layer_idx)
    nope = layer.qk_nope_head_dim
    q_pe, k_pe = layer.rotary(positions, q[..., nope:], k_pe.unsqueeze(1))
    q = torch.cat((q[..., :nope], q_pe), dim=-1)
    parts = [kv_c_normed, k_pe.squeeze(1)]
    if iq is not None:
        cos = layer.rotary.cos_cache[positions].unsqueeze(1).to(iq.dtype)
        sin = layer.rotary.sin_cache[positions].unsqueeze(1).to(iq.dtype)
        iq = _rope_head(iq, cos, sin, layer.index_rope_interleave)
        parts.append(_rope_head(ik.unsqueeze(1), cos, sin, layer.index_rope_interleave).squeeze(1))
    rows = torch.cat(parts, dim=-1)
    if cache is not None and md is not None:
        _write_rows(rows, cache.kv_cache, md.slot_mapping, layer.kv_lora_rank)
    _dsa_attend(q, rows, iq, iw, output, positions, layer_idx)


def _write_rows(
    rows: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_lora_rank: int
) -> None:
    """The step's cache rows at slot_mapping, a negative slot's skipped, as MLA writes its latent
    rows: the first kv_lora_rank columns as the latent, the rest (k_pe, then the indexer's key)
    as its k_pe. On CUDA this runs in the recording, through the write kernel, which skips the
    padded rows on the device (picking them with a mask would wait for it: a capture forbids)."""
    latent, rest = rows[:, :kv_lora_rank], rows[:, kv_lora_rank:]
    if rows.is_cuda:
        from atomrt.workers.kernels.attention.mla_write import mla_write_kv_cache

        mla_write_kv_cache(latent, rest, kv_cache, slot_mapping)
    else:
        write_latent_ref(latent, rest, kv_cache, slot_mapping)


# planned on the host from the step's sequences, at replay too: not `request_fixed` (a request
# bucket's recording of it would replay the capture's sequences); under graph-safe metadata (FULL
# records it inline) planned from shapes alone
@eager_region
def _dsa_attend(
    q: torch.Tensor,
    rows: torch.Tensor,
    iq: Optional[torch.Tensor],
    iw: Optional[torch.Tensor],
    output: torch.Tensor,
    positions: torch.Tensor,
    layer_idx: int,
) -> None:
    """Each sequence's queries over its indexer-picked earlier tokens (latents decompressed
    through kv_b_proj). Rows past the step's sequences get zeros."""
    layer, md, cache = paged_layer_state(layer_idx)
    paged = cache is not None and md is not None
    if paged and md.graph_safe:
        _attend_graph_safe(layer, md, cache.kv_cache, q, iq, iw, output, positions)
        return
    output.zero_()
    latent_width = layer.kv_lora_rank + layer.qk_rope_head_dim
    for s, start, n, L in step_sequences(md, q.shape[0], paged):
        if paged:
            seq = sequence_rows(cache.kv_cache, md.block_tables[s], L).to(q.dtype)
        else:
            seq = rows[start : start + n]
        key = (id(md), s)
        picks = _attend_sequence(
            layer,
            q[start : start + n],
            seq,
            latent_width,
            iq,
            iw,
            start,
            output,
            L,
            _LAST_PICKS.get(key),
        )
        _LAST_PICKS[key] = picks
    if len(_LAST_PICKS) > 4096:  # entries of past steps
        _LAST_PICKS.clear()


def _attend_graph_safe(
    layer: DSAMLAAttention,
    md: object,
    kv_cache: torch.Tensor,
    q: torch.Tensor,
    iq: Optional[torch.Tensor],
    iw: Optional[torch.Tensor],
    output: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """The attention of `_dsa_attend` planned from shapes alone, every length read on the device
    (what a request graph records): each row scores every slot its block table can hold (those
    past its position -inf; with `GRAPH_SAFE_PREFIX` its positions up to its own alone), keeps the
    top `index_topk` and attends them with absorbed weights (W_UK, W_UV). A layer that shares the
    top-k attends the slots its indexer layer kept."""
    n, device = q.shape[0], q.device
    table = md.block_tables.long()
    block_size, width = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(-1, width)
    latent_width = layer.kv_lora_rank + layer.qk_rope_head_dim
    seq = row_seqs(md, n, device).clamp(max=table.shape[0] - 1)
    live = torch.arange(n, device=device) < md.cu_seqlens_q[-1]
    t = torch.arange(table.shape[1] * block_size, device=device)
    key = (id(md), "graph_safe")
    shared = _LAST_PICKS.get(key)
    if layer.indexer is None and (shared is None or shared[0].shape[0] != n):
        raise RuntimeError(
            f"layer {layer.layer_idx} shares the top-k of an indexer layer before it, which did "
            "not run for this step"
        )
    picked_slots, picked = [], []
    for a in range(0, n, _GRAPH_SAFE_CHUNK):
        b = min(n, a + _GRAPH_SAFE_CHUNK)
        if layer.indexer is None:
            picked_slots.append(shared[0][a:b])
            picked.append(shared[1][a:b])
            continue
        k = min(layer.index_topk, t.shape[0])
        if GRAPH_SAFE_PREFIX and _use_kernel(iq):  # each row's positions 0..p alone
            from atomrt.workers.kernels.v4.v4_index import prefix_picks

            # a token is an entry of rate 1 whose group is its block
            w = prefix_picks(iq[a:b], iw[a:b], flat, latent_width, positions[a:b], seq[a:b],
                             md.block_tables, 1, 1, block_size, t.shape[0], k)  # fmt: skip
            at = w.clamp(min=0)
            blocks = table[seq[a:b]].gather(1, at // block_size)
            picked_slots.append(blocks.clamp(min=0) * block_size + at % block_size)
            picked.append((w >= 0) & live[a:b, None])
            continue
        blocks = table[seq[a:b]][:, t // block_size]  # [rows, T]
        sees = (t <= positions[a:b, None]) & live[a:b, None] & (blocks >= 0)
        slots = torch.where(sees, blocks.clamp(min=0) * block_size + t % block_size, -1)
        scores = index_scores(iq[a:b], iw[a:b], flat, slots, latent_width, _use_kernel(iq))
        top, index = scores.topk(k, dim=-1)
        picked_slots.append(slots.gather(1, index))
        picked.append(top > -torch.inf)
    picked_slots, picked = torch.cat(picked_slots), torch.cat(picked)
    _LAST_PICKS[key] = (picked_slots, picked)
    nope, lora = layer.qk_nope_head_dim, layer.kv_lora_rank
    for a in range(0, n, _GRAPH_SAFE_CHUNK):
        b = min(n, a + _GRAPH_SAFE_CHUNK)
        kv = read_rows(flat, picked_slots[a:b].clamp(min=0)).to(q.dtype)  # [rows, k, width]
        q_latent = torch.einsum("nhd,hdl->nhl", q[a:b, :, :nope], layer.w_uk)
        logits = torch.einsum("nhl,nkl->nhk", q_latent, kv[..., :lora])
        logits += torch.einsum("nhr,nkr->nhk", q[a:b, :, nope:], kv[..., lora:latent_width])
        logits = (logits * layer.scale).masked_fill(~picked[a:b].unsqueeze(1), -torch.inf)
        probs = torch.softmax(logits.float(), dim=-1).to(q.dtype)
        heads = torch.einsum("nhl,hlv->nhv", torch.einsum("nhk,nkl->nhl", probs, kv[..., :lora]),
                             layer.w_uv)  # fmt: skip
        output[a:b] = torch.where(live[a:b, None, None], heads, 0)


def _attend_sequence(
    layer: DSAMLAAttention,
    q: torch.Tensor,
    seq: torch.Tensor,
    latent_width: int,
    iq: Optional[torch.Tensor],
    iw: Optional[torch.Tensor],
    start: int,
    output: torch.Tensor,
    L: int,
    shared: Optional[torch.Tensor],
) -> torch.Tensor:
    """Attends, and returns the picks [n, L] (this layer's, or those it shares)."""
    n = q.shape[0]
    w = layer.weights()
    keys, values = decompress(
        seq[:, :latent_width], w.kv_b, layer.num_heads, layer.qk_nope_head_dim, layer.kv_lora_rank
    )
    if layer.indexer is None and (shared is None or shared.shape != (n, L)):
        raise RuntimeError(
            f"layer {layer.layer_idx} shares the top-k of an indexer layer before it, which did "
            "not run for this sequence"
        )
    picks = torch.empty(n, L, dtype=torch.bool, device=q.device)
    # in chunks of query rows: a long prompt's scores and logits are [chunk, heads, context]
    for a in range(0, n, _QUERY_CHUNK):
        b = min(n, a + _QUERY_CHUNK)
        pos = torch.arange(L - n + a, L - n + b, device=q.device)
        causal = torch.arange(L, device=q.device).unsqueeze(0) <= pos.unsqueeze(1)  # [rows, L]
        if layer.indexer is None:
            picked = shared[a:b]
        else:
            ikeys = seq[:, latent_width:].float()
            rows = slice(start + a, start + b)
            scores = F.relu(torch.einsum("nhd,td->nht", iq[rows].float(), ikeys))
            scores = scores * layer.indexer.head_dim**-0.5
            scores = (scores * iw[rows].unsqueeze(-1)).sum(1).masked_fill(~causal, -torch.inf)
            picked = torch.zeros_like(causal)
            picked.scatter_(1, scores.topk(min(layer.index_topk, L), dim=-1).indices, True)
        picks[a:b] = picked
        logits = torch.einsum("nhd,thd->nht", q[a:b], keys) * layer.scale
        logits = logits.masked_fill(~(causal & picked).unsqueeze(1), -torch.inf)
        probs = torch.softmax(logits.float(), dim=-1).to(q.dtype)
        output[start + a : start + b] = torch.einsum("nht,thd->nhd", probs, values)
    return picks


_QUERY_CHUNK = 256
# rows a graph-safe step scores and attends at once: each scores [rows, max_model_len]
_GRAPH_SAFE_CHUNK = 64
# the graph-safe path's indexer scores through the Triton kernel off CUDA too (the interpreter)
USE_KERNELS_ON_CPU = False
# the graph-safe path's indexer, where its kernel runs, scores and ranks each row's positions up
# to its own (workers/kernels/v4/v4_index.py, `prefix_picks`, read on the device) rather than
# every slot of the block table's capacity, whose [rows, T] slots and torch's top-k over T cost
# what max_model_len does. With the chunked ranking (v4_index.PICK_FORM), DeepSeek-V3.2's first
# 2 layers at its 163840 default, level 0 FULL+async on one H100 (ee9ba6e, both in one call):
# bs 1 2.183 ms against 2.244 over every slot, bs 32 2.868 against 3.478
GRAPH_SAFE_PREFIX = True


def _use_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda or USE_KERNELS_ON_CPU


direct_register_custom_op(
    "dsa_mla_attention", dsa_mla_attention, mutates_args=["output"], fake_impl=returns_nothing
)

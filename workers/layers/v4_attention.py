"""DeepSeek-V4's attention block and its two custom ops, `torch.ops.atomrt.v4_attn_compress_launch`
and `torch.ops.atomrt.v4_attention`.

The block (one KV head shared by every query head, keys and values the same tensor):

    q_res = q_norm(wq_a x)                    (the query LoRA, q_lora_rank wide)
    q     = rope(rms(wq_b q_res))             per head, head_dim wide, normalised without a weight
    kv    = rope(norm(wkv x))                 one row per token, head_dim wide
    out   = softmax_with_sink(q . [window kv ; compressed entries]) [window kv ; entries]
    y     = wo_b(wo_a_grouped(rope^-1(out)))  the grouped output projection (o_groups groups)

Rotary embeddings rotate the trailing `qk_rope_head_dim` channels of a head in interleaved pairs
(partial rotary); sliding layers use the `main` set, compressed layers the `compress` set (YaRN).
The output's rotated part is turned back by the query's angle, so each value enters by its
distance to the query. Each head has a learned sink logit (`attn_sink`) that joins the softmax
and takes its share of the mass.

What a query at position p attends:
- the window: the keys of tokens p - sliding_window < t <= p (every layer);
- compressed layers, the entries of complete windows: entry w pools tokens [w*m, (w+1)*m) (m the
  layer type's compress rate) and is visible once p >= (w+1)*m - 1;
  - HCA (`heavily_compressed_attention`): every visible entry;
  - CSA (`compressed_sparse_attention`): the `index_topk` visible entries the lightning indexer
    scores highest, score_t = sum_h w_h relu(q^I_h . K^I_t) / sqrt(index_head_dim), with
    w = weights_proj(x) / sqrt(index_n_heads), q^I = rope(indexer.wq_b q_res), K^I the indexer's
    own compressed keys (index_head_dim wide).

The compressor (`compressor.*`, and the indexer's `indexer.compressor.*`) pools a window with a
softmax over its tokens, per channel, of gate + ape (a learned bias per position in the window):
entry = rope(norm(sum_j softmax_j(wgate x_j + ape_j) * wkv x_j)) at position w*m. An HCA window is
its m tokens; a CSA entry pools 2m slots, the first half of the projections (width head_dim) of
window w-1's tokens and the second half of window w's (none before window 0): overlapping windows.

Tensor parallelism splits the query heads (`wq_b`, `attn_sink`) and the output groups (`wo_a`'s
rows, `wo_b`'s columns; a group's heads on one rank), and sums `wo_b`'s partial outputs over the
ranks; the key, the compressors and the indexer are whole on every rank (so is the cache).

The cache (workers/runner/kv_cache.py, `V4LayerSpec`): one row per token in the one block pool,
indexed by the sequence's block table like every other layer's,

    [kv | compressor kv, gate | indexer kv, gate | entry | indexer entry]
     D    c*D        c*D       2*Di       2*Di     D       Di             (c = 2 for CSA, 1 for HCA)

a sliding layer's row is its kv alone. A token's compressor projections stay in its row until
its window is pooled, so the compressor's partial window carries across steps, prefill chunks and
a recomputation after preemption as the keys do. The entry columns hold the compressed entries
instead (workers/layers/v4_rows.py): a sequence's blocks go in groups of k (the model's smallest compress
rate), and the entries whose windows end in a group fill the entry columns of its first block in
the order they end. So the other blocks of a group are read only while their tokens are within
the window or a compressor's reach, and the block manager returns them to the pool behind it
(runtime/driver/block_manager.py, `WindowBlocks`). A full group's blocks are a function of the
tokens up to it: prefix caching reuses whole groups. A draft rejected by speculative decoding
leaves rows that the position's next computation rewrites, entry included.
An e4m3 cache (kv_cache_dtype fp8) holds the rows at scale 1: they are RMS-normalised keys and
entries or projections of normalised rows, inside e4m3's normal range, where a per-tensor scale
does not change the 3-bit mantissa's relative precision; reads widen them.

The ops. A compressed layer first runs `v4_attn_compress_launch` (ahead of its query and key
projections; a splitting op that a token graph records inline; on CUDA forked onto the model's side
stream, workers/layers/v4_streams.py, and joined back by `v4_attention` before its eager region):
its compressors' projections of the step's rows into the cache, and for every row the entry of
the window it would end, kept where it does (planned from the row count: the window's slots
through the block table on the device). Then every layer runs `v4_attention`: the window key
into the rows and the cache, then the attention (`_attend`): each row's window and the entries
it is given, read through the block table on the device and sized by the row count (a token
graph records it inline). HCA gives every entry a row sees, CSA the `index_topk` its indexer
scores highest: the entries' slots, their scores and the top-k (`_index_topk`, planned from the
step's sequences: as wide as the longest context) are the layer's one eager region, which fills
the k picks the recorded attention reads. An HCA decode step's entries are a fixed width, the
most a sequence can have (max positions // rate, masked), so a decode bucket records them; a
prefill step (eager) takes the most its sequences have, as does the CSA region except under
graph-safe metadata (FULL records it inline, over all of them). Without a cache (profiling,
dummy runs) each sequence reads its rows from the step's own. CUDA takes the kernels
(workers/kernels/v4/) for the pooling, the scores and the attention; the CPU the torch reference
below (or the kernels through Triton's interpreter, `USE_KERNELS_ON_CPU`).
"""

# No `from __future__ import annotations` here: the op's schema is inferred from real annotations.

from typing import Optional

import torch
from torch import nn

from atomrt.compile.custom_register import direct_register_custom_op
from atomrt.distributed.communication_op import TPInfo, tp_all_reduce
from atomrt.graphs.markers import eager_region
from atomrt.workers.layers.attention import PagedAttentionLayer, paged_layer_state
from atomrt.workers.layers.paged_rows import index_scores, read_rows, returns_nothing
from atomrt.workers.layers.rotary import RotaryEmbedding
from atomrt.workers.layers.v4_hyper import unweighted_rms_norm
from atomrt.workers.layers.v4_modules import (
    CSA,
    HCA,
    Compressor,
    Indexer,
    Norm,
    V4LayerSpec,
    rope_tail,
)
from atomrt.workers.layers.v4_rows import (
    CompressIndex,
    anchor_slots,
    compress_index,
    entry_slots,
    entry_width,
    key_counts,
    live_entries,
    source_rows,
    step_memo,
    step_seqs,
    window_slots,
    write_rows,
)
from atomrt.workers.layers.v4_streams import V4SideStreams
from atomrt.workers.layers.weight_utils import divide


class V4Attention(PagedAttentionLayer):
    """One layer's attention (this module's docstring); its parameters carry the checkpoint's
    names under `layers.<i>.attn.`."""

    def __init__(
        self,
        layer_idx: int,
        layer_type: str,
        hidden: int,
        num_heads: int,
        head_dim: int,
        q_lora_rank: int,
        rope_dim: int,
        window: int,
        rate: int,
        o_groups: int,
        o_lora_rank: int,
        index_n_heads: int,
        index_head_dim: int,
        index_topk: int,
        eps: float,
        rotary: RotaryEmbedding,
        tp: TPInfo = TPInfo(),
        side_streams: Optional[V4SideStreams] = None,
        anchor_stride: int = 1,
    ) -> None:
        super().__init__()
        self.layer_idx, self.layer_type = layer_idx, layer_type
        # the model's compressor side stream (one per model, shared by its layers)
        self.side_streams = side_streams if side_streams is not None else V4SideStreams()
        self.tp = tp
        # this rank's heads and output groups (whole groups: a group's heads stay together)
        group_width = num_heads * head_dim // o_groups
        num_heads = divide(num_heads, tp.tp_size, "num_attention_heads")
        o_groups = divide(o_groups, tp.tp_size, "o_groups")
        self.num_heads, self.head_dim, self.rope_dim = num_heads, head_dim, rope_dim
        self.window, self.rate, self.index_topk = window, rate, index_topk
        self.anchor_stride = anchor_stride  # the model's smallest compress rate (see the cache)
        self.o_groups, self.eps = o_groups, eps
        self.scale = head_dim**-0.5
        self.rotary = rotary
        self.wq_a = nn.Linear(hidden, q_lora_rank, bias=False)
        self.q_norm = Norm(q_lora_rank, eps)
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wkv = nn.Linear(hidden, head_dim, bias=False)
        self.norm = Norm(head_dim, eps)
        self.wo_a = nn.Linear(group_width, o_groups * o_lora_rank, bias=False)
        self.wo_b = nn.Linear(o_groups * o_lora_rank, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))
        for param, dim in ((self.wq_b.weight, 0), (self.wo_a.weight, 0), (self.wo_b.weight, 1)):
            param.tp_shard_dim = dim  # split over TP ranks (the loader narrows the checkpoint's)
        self.attn_sink.tp_shard_dim = 0
        self.compressor = (
            Compressor(hidden, head_dim, rate, layer_type == CSA, eps)
            if layer_type in (CSA, HCA)
            else None
        )
        self.indexer = (
            Indexer(hidden, q_lora_rank, index_n_heads, index_head_dim, rate, eps)
            if layer_type == CSA
            else None
        )
        c = 2 if layer_type == CSA else 1
        self.spec = V4LayerSpec(
            layer_idx,
            layer_type,
            head_dim,
            c * head_dim if self.compressor is not None else 0,
            2 * index_head_dim if self.indexer is not None else 0,
        )

    def kv_cache_spec(self) -> V4LayerSpec:
        return self.spec

    def _cos_sin(self, positions: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
        return self.rotary.cos_cache[positions], self.rotary.sin_cache[positions]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] (after attn_norm), positions [n] -> [n, hidden]. The compressors go
        first (their launch needs no query), then the query and the window key."""
        n = x.shape[0]
        rows = x.new_zeros(n, self.spec.elements_per_token())
        if self.compressor is not None:  # forks onto the side stream; v4_attention joins
            torch.ops.atomrt.v4_attn_compress_launch(x, rows, positions, self.layer_idx)
        cos, sin = self._cos_sin(positions)
        cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)
        q_res = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_res).view(n, self.num_heads, self.head_dim)
        q = rope_tail(unweighted_rms_norm(q, self.eps), cos_h, sin_h)
        kv = rope_tail(self.norm(self.wkv(x)), cos, sin)
        iq = iw = None
        if self.indexer is not None:
            idx = self.indexer
            iq = rope_tail(idx.wq_b(q_res).view(n, idx.n_heads, idx.head_dim), cos_h, sin_h)
            iw = idx.weights_proj(x).float() * idx.n_heads**-0.5
        out = torch.empty_like(q)
        torch.ops.atomrt.v4_attention(q, kv, rows, positions, iq, iw, out, self.layer_idx)
        out = rope_tail(out, cos_h, -sin_h)  # the values' rotation turned back at the query's angle
        grouped = out.reshape(n, self.o_groups, -1)  # [n, G, H*D/G]
        if hasattr(self.wo_a, "forward_grouped"):  # held in FP8 (quantization/v4_fp8.py)
            projected = self.wo_a.forward_grouped(grouped)
        else:
            w = self.wo_a.weight.view(self.o_groups, -1, grouped.shape[-1])  # [G, o_lora, H*D/G]
            projected = torch.einsum("ngi,goi->ngo", grouped, w)
        return tp_all_reduce(self.wo_b(projected.flatten(1)), self.tp)

    def compressor_rows(self, ckv, cgate, ikv, igate) -> torch.Tensor:
        """This step's cache rows but the window key (written by the attention op) and the entries
        (pooled where a window ends): zeros there."""
        parts = [ckv.new_zeros(ckv.shape[0], self.head_dim), ckv, cgate]
        if ikv is not None:
            parts += [ikv, igate]
        width = self.spec.elements_per_token() - self.spec.entries_at
        return torch.cat(parts + [ckv.new_zeros(ckv.shape[0], width)], dim=-1)


# Use the Triton kernels (workers/kernels/v4/) for the compressor and the attention: always on
# CUDA; on the CPU only when set (tests run them through Triton's interpreter).
USE_KERNELS_ON_CPU = False
# graph-safe CSA regions on the kernels rank each row's live entries, counted on the device
# (workers/kernels/v4/v4_index.py), not all T as [n, T] slots and torch's top-k. On one H100
# (3710b43, V4-Flash's first four layers at the 1M context, `atomrt bench latency --level 0
# --modes FULL+async --batch-sizes 1,32`, one call): 2.698 / 13.078 ms a step at bs 1 / 32 with
# the slots, 2.630 / 11.969 with this and v4_index.PICK_FORM "chunked"
GRAPH_SAFE_PREFIX = True
# query rows per chunk of the CPU reference: a long prompt's logits are [chunk, heads, keys]
_QUERY_CHUNK = 256


def _use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda or USE_KERNELS_ON_CPU


def v4_attn_compress_launch(
    x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, layer_idx: int
) -> None:
    """The split op ahead of a compressed layer's query, x [n, hidden] the attention's input:
    forks onto the model's side stream (workers/layers/v4_streams.py; `v4_attention` joins it)
    and there runs the compressors: the step's projections into `rows` [n, width] and the cache
    (at slot_mapping); then, for each row whose position ends a compressor window, the window's
    entry and the indexer's, pooled from its tokens' rows (the earlier ones from the cache) into
    the row. Sized by the row count: every row pools a candidate, kept where its position ends a
    window; no host data, so a token graph records it inline."""
    layer, md, cache = paged_layer_state(layer_idx)
    index = compress_index(layer, md, cache, rows, positions)
    if rows.is_cuda:
        # x may be an intermediate of a compiled graph (the op not a splitting op, or level 2),
        # whose memory the graph reuses after its last use there, which may come before the
        # join: the side stream reads a copy of its own, made before the fork and kept by it
        x = x.clone()
    keep = (x, rows, positions, *(t for t in index if t is not None))
    with layer.side_streams.fork(layer_idx, rows.device, keep=keep):
        _compress(layer, x, rows, index, layer_idx)


def _compress(
    layer: "V4Attention",
    x: torch.Tensor,
    rows: torch.Tensor,
    index: CompressIndex,
    layer_idx: int,
) -> None:
    """`v4_attn_compress_launch`'s work, on the side stream."""
    _, md, cache = paged_layer_state(layer_idx)
    ikv = igate = None
    if layer.indexer is not None:
        ikv, igate = layer.indexer.compressor.wkv(x), layer.indexer.compressor.wgate(x)
    ckv, cgate = layer.compressor.wkv(x), layer.compressor.wgate(x)
    rows.copy_(layer.compressor_rows(ckv, cgate, ikv, igate))
    tokens_cols, entry_cols = slice(0, layer.spec.entries_at), slice(layer.spec.entries_at, None)
    write_rows(md, cache, rows, tokens_cols, index.writes)
    r, cols = layer.rate, layer.spec.columns()
    source = source_rows(md, cache, rows)
    if not _use_kernels(rows):
        src = read_rows(source, index.slots.clamp(min=0)).to(rows.dtype)  # [n, span, width]
    comps = [(layer.compressor, "ckv", "cgate", "centry")]
    if layer.indexer is not None:
        comps.append((layer.indexer.compressor, "ikv", "igate", "ientry"))
    for comp, kv_name, gate_name, entry_name in comps:
        (kv_at, kv_width), gate_at = cols[kv_name], cols[gate_name][0]
        if _use_kernels(rows):
            from atomrt.workers.kernels.v4.v4_kernels import v4_pool

            pooled = rows.new_empty(rows.shape[0], comp.dim)
            # only the rows that end a window pool (a prefill's other rows read nothing)
            v4_pool(source, index.slots, index.pooled, comp.ape, comp.norm.weight, kv_at,
                    gate_at, comp.norm.eps, comp.overlap, pooled)  # fmt: skip
            pooled = rope_tail(pooled, index.cos, index.sin)
        else:
            kv_src = src[..., kv_at : kv_at + kv_width]
            gate_src = src[..., gate_at : gate_at + kv_width]
            prev = (kv_src[:, :r], gate_src[:, :r]) if comp.overlap else (None, None)
            cos, sin = layer.rotary.cos_cache, layer.rotary.sin_cache
            pooled = comp.pool(kv_src[:, -r:], gate_src[:, -r:], *prev, index.windows, cos, sin)
        at, width = cols[entry_name]
        entry = rows[:, at : at + width]
        entry.copy_(torch.where(index.ends, pooled.to(rows.dtype), entry))
    # the entries into their group's first block
    write_rows(md, cache, rows, entry_cols, index.entry_writes)


def v4_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    iq: Optional[torch.Tensor],
    iw: Optional[torch.Tensor],
    output: torch.Tensor,
    layer_idx: int,
) -> None:
    """q, output [n, H, D]; kv [n, D] the window keys; rows [n, width] (`v4_attn_compress_launch`'s
    for a compressed layer, zeros otherwise); positions [n]; iq [n, Hi, Di]; iw [n, Hi] float32.
    Writes the keys into the rows and the cache, then attends each row's window and: HCA every
    entry it sees, CSA the `index_topk` its indexer scores highest (`_index_topk`, the layer's one
    eager region)."""
    layer, md, cache = paged_layer_state(layer_idx)
    # the compressors' side stream joins here, before the eager region: one recorded segment
    layer.side_streams.join(layer_idx, rows.device)
    rows[:, : kv.shape[1]] = kv
    write_rows(md, cache, rows, slice(0, kv.shape[1]))
    if layer.compressor is None:  # sliding
        _attend(layer, q, rows, positions, output)
        return
    if layer.indexer is None:  # HCA: every entry a row sees, [n, T]
        entries = entry_slots(layer, rows, positions)
    else:  # CSA: the indexer's picks, [n, k], made in the eager region
        k = min(layer.index_topk, entry_width(layer, rows))
        picked = torch.empty(rows.shape[0], k, dtype=torch.long, device=q.device)
        # graph-safe: the region ranks every entry, their slots made here (recorded, they follow
        # the positions a replay finds); otherwise it makes the context's own
        graph_safe = md is not None and md.graph_safe
        prefix = graph_safe and GRAPH_SAFE_PREFIX and cache is not None and _use_kernels(q)
        every = entry_slots(layer, rows, positions) if graph_safe and not prefix else None
        _index_topk(iq, iw, rows, positions, every, picked, layer_idx)
        entries = picked
    _attend(layer, q, rows, positions, output, entries)


def _attend(
    layer: "V4Attention",
    q: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    output: torch.Tensor,
    entries: Optional[torch.Tensor] = None,
) -> None:
    """Each row's queries over the keys of its window, the tokens p - window < t <= p of its
    sequence (p its position), and the entries in the slots `entries` [n, k] names (-1: none),
    with the head's sink in the softmax and the keys as the values. A row's entries are at most
    the (p + 1) // rate it sees, first, -1 after them (HCA's every entry, CSA's picks in score
    order), so the kernel's walk stops after them (`key_counts`): HCA's fixed width is max
    positions // rate, most of it past a row's. No host data: sized by the row count, so a token
    graph records it inline."""
    _, md, cache = paged_layer_state(layer.layer_idx)
    source = source_rows(md, cache, rows)
    slots = window_slots(layer, md, cache, rows, positions)
    cols = layer.spec.columns()
    groups = [(slots, cols["kv"][0])]
    if entries is not None:
        groups.append((entries, cols["centry"][0]))
    n, width, d = q.shape[0], source.shape[-1], q.shape[-1]
    if _use_kernels(q):
        from atomrt.workers.kernels.v4.v4_kernels import v4_sparse_attention

        key = ("window offsets", id(slots), width, cols["kv"][0])
        parts = [step_memo(key, lambda: torch.where(slots >= 0, slots * width + cols["kv"][0], -1))]
        parts += [torch.where(s >= 0, s * width + c, -1) for s, c in groups[1:]]
        offsets = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        lens = None
        if entries is not None:
            lens = key_counts(md, positions, layer.rate, entries.shape[1], slots.shape[1])
        v4_sparse_attention(q, source, offsets, layer.attn_sink, layer.scale, output, lens)
        return
    for a in range(0, n, _QUERY_CHUNK):
        b = min(n, a + _QUERY_CHUNK)
        keys = torch.cat(
            [read_rows(source, s[a:b].clamp(min=0))[..., c : c + d] for s, c in groups], dim=1
        ).to(q.dtype)  # [m, K, D]
        invalid = torch.cat([s[a:b] < 0 for s, _ in groups], dim=1)
        logits = torch.einsum("nhd,nwd->nhw", q[a:b], keys) * layer.scale
        logits = logits.masked_fill(invalid.unsqueeze(1), float("-inf"))
        sink = layer.attn_sink.to(logits.dtype).view(1, -1, 1).expand(b - a, -1, 1)
        combined = torch.cat((logits, sink), dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        output[a:b].copy_(torch.einsum("nhw,nwd->nhd", probs, keys))


# planned on the host from the step's sequences, at replay too: not `request_fixed` (a request
# bucket's recording of it would replay the capture's sequences)
@eager_region
def _index_topk(
    iq: torch.Tensor,
    iw: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    every: Optional[torch.Tensor],
    picked: torch.Tensor,
    layer_idx: int,
) -> None:
    """A CSA layer's eager region: into `picked` [n, k] the slots of the (at most) k entries the
    indexer scores highest for each row, score order, -1 past those a row sees. Under graph-safe
    metadata (a request graph records it inline: no host data) over `every` [n, T], all the
    entries a row could have; otherwise over as many as the step's longest sequence has, their
    slots made here (planned from the step's sequences: a segment-by-segment replay costs what
    the context does, not max positions)."""
    layer, md, cache = paged_layer_state(layer_idx)
    paged = cache is not None and md is not None
    t = layer.rotary.cos_cache.shape[0] // layer.rate
    at = layer.spec.columns()["ientry"][0]
    source = cache.rows.view(-1, cache.rows.shape[-1]) if paged else rows
    if every is None and md is not None and md.graph_safe:  # GRAPH_SAFE_PREFIX
        from atomrt.workers.kernels.v4.v4_index import prefix_picks

        seq, r, stride = step_seqs(md, iq.shape[0], iq.device), layer.rate, layer.anchor_stride
        w = prefix_picks(iq, iw, source, at, positions, seq, md.block_tables, r, stride,
                         cache.rows.shape[1], t, picked.shape[1])  # fmt: skip
        picked.copy_(anchor_slots(md, cache, seq, w, r, stride))
        return
    if every is not None:
        entries, t = every, every.shape[1]
    else:  # the memo: a host-planned forward context holds one forward (a step, a draft pass)
        t = min(t, live_entries(layer, iq.shape[0]))
        entries = entry_slots(layer, rows, positions, t) if t else None  # [n, t]
    picked.fill_(-1)
    k = min(picked.shape[1], t)
    if not k:
        return
    scores = index_scores(iq, iw, source, entries, at, _use_kernels(iq), _QUERY_CHUNK)
    top = scores.topk(k, dim=-1)
    picked[:, :k] = torch.where(top.values > float("-inf"), entries.gather(1, top.indices), -1)


direct_register_custom_op(
    "v4_attn_compress_launch",
    v4_attn_compress_launch,
    mutates_args=["rows"],
    fake_impl=returns_nothing,
)
direct_register_custom_op(
    "v4_attention", v4_attention, mutates_args=["rows", "output"], fake_impl=returns_nothing
)

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

    [kv | compressor kv, gate | entry | indexer kv, gate | indexer entry]
     D    c*D        c*D       D       2*Di       2*Di     Di             (c = 2 for CSA, 1 for HCA)

a sliding layer's row is its kv alone. A token's compressor projections stay in its row until
its window is pooled, so the compressor's partial window carries across steps, prefill chunks and
a recomputation after preemption as the keys do; an entry lives in the row of its window's last
token. A full block's rows are a function of the tokens up to it: prefix caching reuses them.
Blocks behind the window are not freed (their rows hold the entries). A draft rejected by
speculative decoding leaves rows that the position's next computation rewrites, entry included.

The ops. A compressed layer first runs `v4_attn_compress_launch` (ahead of its query and key
projections; a splitting op that a token graph records inline; on CUDA forked onto the model's side
stream, workers/layers/v4_streams.py, and joined back by `v4_attention` before its eager region):
its compressors' projections of the step's rows into the cache, and for every row the entry of
the window it would end, kept where it does (planned from the row count: the window's slots
through the block table on the device). Then every layer runs `v4_attention`: the window key
into the rows and the cache, then the layer's eager region, planned from the step's sequences:
CSA the indexer's scores and top-k (`_index_topk`), HCA the attention over the window and every
visible entry (`_v4_attend`); `_window_attend` attends a sliding layer's window and a CSA layer's
window and picked entries through the block table on the device, sized by the row count (a token
graph records it inline). CUDA takes the kernels (workers/kernels/v4/) for the pooling, the
scores and the attention; the CPU the torch reference below (or the kernels through Triton's
interpreter, `USE_KERNELS_ON_CPU`).
"""

# No `from __future__ import annotations` here: the op's schema is inferred from real annotations.

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from atomrt.compile.custom_register import direct_register_custom_op
from atomrt.distributed.communication_op import TPInfo, tp_all_reduce
from atomrt.graphs.markers import eager_region
from atomrt.workers.layers.attention import PagedAttentionLayer, paged_layer_state
from atomrt.workers.layers.attention_ref import to_cache_dtype
from atomrt.workers.layers.rotary import RotaryEmbedding
from atomrt.workers.layers.v4_hyper import unweighted_rms_norm
from atomrt.workers.layers.v4_streams import V4SideStreams
from atomrt.workers.layers.weight_utils import divide

# the layer types (config.json `layer_types`)
SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x in interleaved pairs, in float32.
    cos, sin broadcast against x[..., :half] (one angle per pair)."""
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepSeek-V4 RMSNorm: in float32, times the weight, back to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


class Norm(nn.Module):
    """A weighted RMSNorm whose parameter is the checkpoint's `<name>.weight` (float32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Compressor(nn.Module):
    """`wkv`, `wgate` (c * dim wide: c = 2 for overlapping CSA windows), `ape` [rate, c * dim]
    and the pooled entry's `norm`."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        c = 2 if overlap else 1
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.wkv = nn.Linear(hidden, c * dim, bias=False)
        self.wgate = nn.Linear(hidden, c * dim, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, c * dim, dtype=torch.float32))
        self.norm = Norm(dim, eps)

    def pool(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        kv_prev: Optional[torch.Tensor],
        gate_prev: Optional[torch.Tensor],
        windows: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Entries of `windows` [m] from their tokens' projections kv, gate [m, rate, c*dim] (and,
        for overlapping windows, the previous window's, ignored for window 0) -> [m, dim], rotated
        at w * rate."""
        d = self.dim
        g = gate.float() + self.ape  # [m, r, c*dim]
        v = kv
        if self.overlap:
            first = (windows == 0).view(-1, 1, 1)
            g_a = (gate_prev[..., :d].float() + self.ape[:, :d]).masked_fill(first, float("-inf"))
            v_a = kv_prev[..., :d].masked_fill(first, 0.0)
            g = torch.cat((g_a, g[..., d:]), dim=1)  # [m, 2r, dim]
            v = torch.cat((v_a, v[..., d:]), dim=1)
        probs = torch.softmax(g, dim=1, dtype=torch.float32).to(v.dtype)
        pooled = self.norm((v * probs).sum(dim=1))
        at = windows * self.rate
        return rope_tail(pooled, cos[at].to(pooled.dtype), sin[at].to(pooled.dtype))


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its compressor (index_head_dim), `wq_b` from the
    query LoRA and `weights_proj`."""

    def __init__(
        self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, rate: int, eps: float
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.compressor = Compressor(hidden, head_dim, rate, True, eps)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


@dataclass(frozen=True)
class V4LayerSpec:
    """A DeepSeek-V4 layer's cache: one row per token (see this module's docstring)."""

    layer_idx: int
    layer_type: str
    head_dim: int
    compress_width: int  # c * head_dim of the compressor's projections (0: sliding)
    index_width: int  # 2 * index_head_dim of the indexer's (0: not CSA)

    @property
    def kind(self) -> str:
        return self.layer_type

    def elements_per_token(self) -> int:
        d, di = self.head_dim, self.index_width // 2
        n = d
        if self.compress_width:
            n += 2 * self.compress_width + d
        if self.index_width:
            n += 2 * self.index_width + di
        return n

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> "V4CacheTensor":
        width = self.elements_per_token()
        storage = torch.zeros(num_blocks * block_size + 1, width, dtype=dtype, device=device)
        rows = storage[:-1].view(num_blocks, block_size, width)
        return V4CacheTensor(self.layer_idx, rows, storage)


@dataclass
class V4CacheTensor:
    layer_idx: int
    rows: torch.Tensor  # [num_blocks, block_size, V4LayerSpec.elements_per_token()]
    # rows plus one scratch row last, where a padded row's write goes: a write is one
    # index_copy_ of every row, with no host synchronisation (a token graph records it)
    storage: torch.Tensor


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
        w = self.wo_a.weight.view(self.o_groups, -1, grouped.shape[-1])  # [G, o_lora, H*D/G]
        return tp_all_reduce(
            self.wo_b(torch.einsum("ngi,goi->ngo", grouped, w).flatten(1)), self.tp
        )

    # ---- the cache rows ------------------------------------------------------------------------

    def columns(self) -> "dict[str, tuple[int, int]]":
        """Name -> (first column, width) of a cache row."""
        d, cw, iw = self.head_dim, self.spec.compress_width, self.spec.index_width
        cols, at = {"kv": (0, d)}, d
        if cw:
            for name, width in (("ckv", cw), ("cgate", cw), ("centry", d)):
                cols[name], at = (at, width), at + width
        if iw:
            for name, width in (("ikv", iw), ("igate", iw), ("ientry", iw // 2)):
                cols[name], at = (at, width), at + width
        return cols

    def compressor_rows(self, ckv, cgate, ikv, igate) -> torch.Tensor:
        """This step's cache rows but the window key (written by the attention op) and the entries
        (pooled where a window ends): zeros there."""
        parts = [ckv.new_zeros(ckv.shape[0], self.head_dim), ckv, cgate]
        parts.append(ckv.new_zeros(ckv.shape[0], self.head_dim))
        if ikv is not None:
            parts += [ikv, igate, ikv.new_zeros(ikv.shape[0], ikv.shape[1] // 2)]
        return torch.cat(parts, dim=-1)


def _col(rows: torch.Tensor, cols: dict, name: str) -> torch.Tensor:
    at, width = cols[name]
    return rows[..., at : at + width]


def _sequences(md: object, num_rows: int, paged: bool) -> "list[tuple[int, int, int, int]]":
    """(index, first row, rows, context length) of each sequence of the step. Without a cache
    (profiling, dummy runs) each sequence is its rows alone from position 0; with no metadata, all
    rows are one."""
    if md is None or (md.cu_seqlens_q_cpu is None and md.cu_seqlens_q is None):
        return [(0, 0, num_rows, num_rows)]
    cu = md.cu_seqlens_q_cpu if md.cu_seqlens_q_cpu is not None else md.cu_seqlens_q.tolist()
    num_seqs = md.num_seqs or len(cu) - 1
    lens = getattr(md, "context_lens_cpu", None)
    if lens is None and getattr(md, "context_lens", None) is not None:
        lens = md.context_lens.tolist()
    out = []
    for s in range(num_seqs):
        n = cu[s + 1] - cu[s]
        if n:
            out.append((s, cu[s], n, lens[s] if paged and lens is not None else n))
    return out


# Use the Triton kernels (workers/kernels/v4/) for the compressor and the attention: always on
# CUDA; on the CPU only when set (tests run them through Triton's interpreter).
USE_KERNELS_ON_CPU = False


def _use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda or USE_KERNELS_ON_CPU


def _token_slots(md: object, block_size: int, tokens: torch.Tensor) -> torch.Tensor:
    """Cache slots of `tokens` [n, k] (positions in row i's sequence; < 0: none, slot -1),
    through the block table on the device."""
    n = tokens.shape[0]
    cu = md.cu_seqlens_q.long()
    seq = torch.searchsorted(cu[1:], torch.arange(n, device=tokens.device), right=True)
    seq = seq.clamp(max=md.block_tables.shape[0] - 1)
    t = tokens.clamp(min=0)
    blocks = md.block_tables.long()[
        seq.unsqueeze(1), (t // block_size).clamp(max=md.block_tables.shape[1] - 1)
    ]
    return torch.where(tokens >= 0, blocks.clamp(min=0) * block_size + t % block_size, -1)


def _source_rows(
    md: object,
    cache: Optional["V4CacheTensor"],
    rows: torch.Tensor,
    positions: torch.Tensor,
    tokens: torch.Tensor,
) -> torch.Tensor:
    """The cache rows of `tokens` [n, k] (token positions in row i's sequence, >= 0): through the
    block table on the device, or without a cache from this step's rows (each sequence's rows
    from its first position). Planned from the row count alone."""
    n = rows.shape[0]
    if cache is None or md is None:
        if md is None or md.cu_seqlens_q is None:
            first = torch.zeros(n, dtype=torch.long, device=rows.device)
        else:
            cu = md.cu_seqlens_q.long()
            seq = torch.searchsorted(cu[1:], torch.arange(n, device=rows.device), right=True)
            first = cu[seq.clamp(max=cu.shape[0] - 1)]
        src = first.unsqueeze(1) + tokens - positions[first].unsqueeze(1)
        return rows[src.clamp(0, n - 1)]
    slots = _token_slots(md, cache.rows.shape[1], tokens).clamp(min=0)
    return _read(cache.rows.view(-1, cache.rows.shape[-1]), slots).to(rows.dtype)


def _read(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index] (an e4m3 cache is indexed as bytes: CPU has no float8 indexing kernel)."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8)[index].view(cache.dtype)
    return cache[index]


def _write_rows(md: object, cache: Optional["V4CacheTensor"], rows: torch.Tensor) -> None:
    """The step's rows at slot_mapping (a padded row's, slot < 0, into the scratch row)."""
    if cache is None or md is None:
        return
    slots = md.slot_mapping[: rows.shape[0]]
    slots = torch.where(slots >= 0, slots, cache.storage.shape[0] - 1)
    values = to_cache_dtype(rows, cache.storage.dtype)
    storage = cache.storage
    if storage.dtype == torch.float8_e4m3fn:  # CPU's index_copy_ has no float8 kernel
        storage, values = storage.view(torch.uint8), values.view(torch.uint8)
    storage.index_copy_(0, slots, values)


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
    layer = paged_layer_state(layer_idx)[0]
    if rows.is_cuda:
        # x may be an intermediate of a compiled graph (the op not a splitting op, or level 2),
        # whose memory the graph reuses after its last use there, which may come before the
        # join: the side stream reads a copy of its own, made before the fork and kept by it
        x = x.clone()
    with layer.side_streams.fork(layer_idx, rows.device, keep=(x, rows, positions)):
        _compress(layer, x, rows, positions, layer_idx)


def _compress(
    layer: V4Attention, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, layer_idx: int
) -> None:
    """`v4_attn_compress_launch`'s work, on the side stream."""
    _, md, cache = paged_layer_state(layer_idx)
    ikv = igate = None
    if layer.indexer is not None:
        ikv, igate = layer.indexer.compressor.wkv(x), layer.indexer.compressor.wgate(x)
    ckv, cgate = layer.compressor.wkv(x), layer.compressor.wgate(x)
    rows.copy_(layer.compressor_rows(ckv, cgate, ikv, igate))
    _write_rows(md, cache, rows)
    r, cols = layer.rate, layer.columns()
    windows = ((positions + 1) // r - 1).clamp(min=0)  # the window each row would end
    span = 2 * r if layer.compressor.overlap else r
    tokens = (positions + 1 - span).unsqueeze(1) + torch.arange(span, device=rows.device)
    cos, sin = layer.rotary.cos_cache, layer.rotary.sin_cache
    ends = ((positions + 1) % r == 0).unsqueeze(1)
    paged = cache is not None and md is not None
    if paged and _use_kernels(rows):
        from atomrt.workers.kernels.v4.v4_kernels import v4_pool

        slots = _token_slots(md, cache.rows.shape[1], tokens)
        flat = cache.rows.view(-1, cache.rows.shape[-1])
    else:
        src = _source_rows(md, cache, rows, positions, tokens.clamp(min=0))  # [n, span, width]
    for comp, kv_name, gate_name, entry_name in (
        (layer.compressor, "ckv", "cgate", "centry"),
        (layer.indexer.compressor if layer.indexer is not None else None, "ikv", "igate", "ientry"),
    ):
        if comp is None:
            continue
        if paged and _use_kernels(rows):
            pooled = v4_pool(
                flat,
                slots,
                windows,
                comp.ape,
                comp.norm.weight,
                cols[kv_name][0],
                cols[gate_name][0],
                comp.norm.eps,
                comp.overlap,
                rows.new_empty(rows.shape[0], comp.dim),
            )
            at = windows * r
            pooled = rope_tail(pooled, cos[at].to(pooled.dtype), sin[at].to(pooled.dtype))
        else:
            kv_src, gate_src = _col(src, cols, kv_name), _col(src, cols, gate_name)
            prev = (kv_src[:, :r], gate_src[:, :r]) if comp.overlap else (None, None)
            pooled = comp.pool(kv_src[:, -r:], gate_src[:, -r:], *prev, windows, cos, sin)
        entry = _col(rows, cols, entry_name)
        entry.copy_(torch.where(ends, pooled.to(rows.dtype), entry))
    _write_rows(md, cache, rows)


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
    Writes the keys into the rows and the cache, then attends: a compressed layer in
    `_v4_attend`, its eager region; a sliding layer over the cache in `_window_attend`, planned
    from the row count (recorded inline)."""
    layer, md, cache = paged_layer_state(layer_idx)
    # the compressors' side stream joins here, before the eager region: one recorded segment
    layer.side_streams.join(layer_idx, rows.device)
    rows[:, : kv.shape[1]] = kv
    _write_rows(md, cache, rows)  # whole rows: the compressor's columns are in `rows` too
    if cache is None or md is None or layer.layer_type == HCA:
        _v4_attend(q, rows, iq, iw, output, layer_idx)
    elif layer.indexer is None:  # sliding
        _window_attend(layer, md, cache, q, positions, output)
    else:  # CSA: the indexer's picks (eager), then the attention over them (recorded)
        picked = torch.full((q.shape[0], layer.index_topk), -1, dtype=torch.long, device=q.device)
        _index_topk(iq, iw, picked, layer_idx)
        _window_attend(layer, md, cache, q, positions, output, picked)


def _window_attend(
    layer: V4Attention,
    md: object,
    cache: "V4CacheTensor",
    q: torch.Tensor,
    positions: torch.Tensor,
    output: torch.Tensor,
    picked: Optional[torch.Tensor] = None,
) -> None:
    """Each row's queries over the keys of its window, the tokens p - window < t <= p of its
    sequence (p its position), read through the block table on the device, and (CSA) the entries
    in the cache rows `picked` [n, index_topk] names (-1: none). No host data: sized by the row
    count, so a token graph records it inline."""
    n, width = q.shape[0], cache.rows.shape[-1]
    tokens = positions.long().unsqueeze(1) - torch.arange(
        layer.window - 1, -1, -1, device=q.device
    )  # [n, W], < 0 before the sequence's start
    slots = _token_slots(md, cache.rows.shape[1], tokens)
    cols = layer.columns()
    groups = [(slots, cols["kv"][0])]
    if picked is not None:
        groups.append((picked, cols["centry"][0]))
    if _use_kernels(q):
        from atomrt.workers.kernels.v4.v4_kernels import v4_sparse_attention

        offsets = torch.cat([torch.where(s >= 0, s * width + c, -1) for s, c in groups], dim=1)
        v4_sparse_attention(q, cache.rows, offsets, layer.attn_sink, layer.scale, output)
        return
    flat, d = cache.rows.view(-1, width), q.shape[-1]
    for a in range(0, n, _QUERY_CHUNK):
        b = min(n, a + _QUERY_CHUNK)
        keys = torch.cat(
            [_read(flat, s[a:b].clamp(min=0))[..., c : c + d] for s, c in groups], dim=1
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
def _index_topk(iq: torch.Tensor, iw: torch.Tensor, picked: torch.Tensor, layer_idx: int) -> None:
    """A CSA layer's eager region: the indexer's scores of each sequence's visible entries (their
    count, context length // rate, planned from the step's sequences) and their top
    `index_topk`, as cache slots of the entries' rows into `picked` [n, index_topk] (-1: none)."""
    layer, md, cache = paged_layer_state(layer_idx)
    picked.fill_(-1)
    r, cols = layer.rate, layer.columns()
    bs, width = cache.rows.shape[1], cache.rows.shape[2]
    flat = cache.rows.view(-1, width)
    for s, start, n, context_len in _sequences(md, iq.shape[0], True):
        num_entries = context_len // r
        if not num_entries:
            continue
        device = iq.device
        table = md.block_tables[s].long()
        ent = (torch.arange(num_entries, device=device) + 1) * r - 1  # an entry's row: its last
        ent_slots = table[ent // bs] * bs + ent % bs
        pos = torch.arange(context_len - n, context_len, device=device)
        w = torch.arange(num_entries, device=device)
        visible = w.unsqueeze(0) < ((pos + 1) // r).unsqueeze(1)  # [n, T]
        rows_iq, rows_iw = iq[start : start + n], iw[start : start + n]
        if _use_kernels(iq):
            from atomrt.workers.kernels.v4.v4_kernels import v4_index_scores

            cand = torch.where(visible, ent_slots.unsqueeze(0), -1)
            scores = v4_index_scores(rows_iq, rows_iw, flat, cand, cols["ientry"][0])
        else:
            at, di = cols["ientry"]
            ikeys = _read(flat, ent_slots)[:, at : at + di].to(iq.dtype)
            scores = torch.einsum("nhd,td->nht", rows_iq.float(), ikeys.float())
            scores = F.relu(scores) * layer.indexer.head_dim**-0.5
            scores = (
                (scores * rows_iw.unsqueeze(-1)).sum(dim=1).masked_fill(~visible, float("-inf"))
            )
        top = scores.topk(min(layer.index_topk, num_entries), dim=-1)
        chosen = torch.where(top.values > float("-inf"), ent_slots[top.indices], -1)
        picked[start : start + n, : chosen.shape[1]] = chosen


# planned from the step's sequences, as `_index_topk`
@eager_region
def _v4_attend(
    q: torch.Tensor,
    rows: torch.Tensor,
    iq: Optional[torch.Tensor],
    iw: Optional[torch.Tensor],
    output: torch.Tensor,
    layer_idx: int,
) -> None:
    """Each sequence's queries over its window and its compressed entries (CSA: those the
    indexer picks), planned from the step's sequences. Rows past them get zeros."""
    layer, md, cache = paged_layer_state(layer_idx)
    output.zero_()
    paged = cache is not None and md is not None
    block_size = cache.rows.shape[1] if paged else 0
    for s, start, n, context_len in _sequences(md, q.shape[0], paged):
        if paged and _use_kernels(q):
            _attend_sequence_kernels(
                layer,
                q[start : start + n],
                None if iq is None else iq[start : start + n],
                None if iw is None else iw[start : start + n],
                output[start : start + n],
                context_len,
                cache.rows,
                md.block_tables[s],
            )
            continue
        if paged:
            table = md.block_tables[s, : -(-context_len // block_size)].long()
            seq_rows = _read(cache.rows, table).flatten(0, 1)[:context_len]
        else:  # profiling / dummy run: the sequence is this step's rows alone
            seq_rows = rows[start : start + n]
        _attend_sequence(
            layer,
            q[start : start + n],
            seq_rows.to(q.dtype),
            None if iq is None else iq[start : start + n],
            None if iw is None else iw[start : start + n],
            output[start : start + n],
            context_len,
        )


def _attend_sequence(
    layer: V4Attention,
    q: torch.Tensor,
    seq_rows: torch.Tensor,
    iq: Optional[torch.Tensor],
    iw: Optional[torch.Tensor],
    out: torch.Tensor,
    context_len: int,
) -> None:
    """A sequence's query rows (the last of its `context_len` tokens), in chunks of
    `_QUERY_CHUNK` rows: a long prompt's logits are [chunk, heads, context], not [rows, ...]."""
    n, L = q.shape[0], context_len
    pos = torch.arange(L - n, L, device=q.device)
    for a in range(0, n, _QUERY_CHUNK):
        b = min(n, a + _QUERY_CHUNK)
        _attend_rows(
            layer,
            q[a:b],
            seq_rows,
            None if iq is None else iq[a:b],
            None if iw is None else iw[a:b],
            out[a:b],
            pos[a:b],
            L,
        )


_QUERY_CHUNK = 256


def _attend_rows(
    layer: V4Attention,
    q: torch.Tensor,
    seq_rows: torch.Tensor,
    iq: Optional[torch.Tensor],
    iw: Optional[torch.Tensor],
    out: torch.Tensor,
    pos: torch.Tensor,
    L: int,
) -> None:
    n = q.shape[0]
    device = q.device
    cols = layer.columns()
    keys = _col(seq_rows, cols, "kv")  # [L, D]
    t = torch.arange(L, device=device)
    mask = (t.unsqueeze(0) <= pos.unsqueeze(1)) & (t.unsqueeze(0) > pos.unsqueeze(1) - layer.window)
    if layer.compressor is not None:
        r = layer.rate
        num_entries = L // r
        ent = _col(seq_rows, cols, "centry")[r - 1 :: r][:num_entries]
        w = torch.arange(num_entries, device=device)
        visible = w.unsqueeze(0) < ((pos + 1) // r).unsqueeze(1)  # [n, T]
        if layer.indexer is not None and num_entries:
            ikeys = _col(seq_rows, cols, "ientry")[r - 1 :: r][:num_entries]
            visible = visible & _index_select(layer, iq, iw, ikeys, visible)
        keys = torch.cat((keys, ent), dim=0)
        mask = torch.cat((mask, visible), dim=1)
    logits = torch.einsum("nhd,kd->nhk", q, keys) * layer.scale
    logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
    sink = layer.attn_sink.to(logits.dtype).view(1, -1, 1).expand(n, -1, 1)
    combined = torch.cat((logits, sink), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    out.copy_(torch.einsum("nhk,kd->nhd", probs, keys))


def _attend_sequence_kernels(
    layer: V4Attention,
    q: torch.Tensor,
    iq: Optional[torch.Tensor],
    iw: Optional[torch.Tensor],
    out: torch.Tensor,
    context_len: int,
    cache_rows: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    """`_attend_sequence` through the kernels: each query row's keys as element offsets into the
    cache (its window's, then its compressed entries': HCA every visible one, CSA the indexer's
    top `index_topk` by `v4_index_scores`), then `v4_sparse_attention`."""
    from atomrt.workers.kernels.v4.v4_kernels import v4_index_scores, v4_sparse_attention

    n, L = q.shape[0], context_len
    device = q.device
    bs, width = cache_rows.shape[1], cache_rows.shape[2]
    table = block_table.long()
    flat = cache_rows.view(-1, width)

    def slots_of(tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.clamp(min=0)
        return torch.where(tokens >= 0, table[t // bs] * bs + t % bs, -1)

    pos = torch.arange(L - n, L, device=device)
    window = pos.unsqueeze(1) - torch.arange(layer.window - 1, -1, -1, device=device)
    win_slots = slots_of(window)
    offsets = [torch.where(win_slots >= 0, win_slots * width, -1)]
    if layer.compressor is not None and L // layer.rate:
        r, cols = layer.rate, layer.columns()
        num_entries = L // r
        ent_slots = slots_of((torch.arange(num_entries, device=device) + 1) * r - 1)
        visible = torch.arange(num_entries, device=device).unsqueeze(0) < (
            (pos + 1) // r
        ).unsqueeze(1)
        picked = torch.where(visible, ent_slots.unsqueeze(0), -1)  # [n, T]
        if layer.indexer is not None:
            scores = v4_index_scores(iq, iw, flat, picked, cols["ientry"][0])
            top = scores.topk(min(layer.index_topk, num_entries), dim=-1)
            picked = torch.where(
                top.values > float("-inf"), ent_slots[top.indices], torch.full_like(top.indices, -1)
            )
        offsets.append(torch.where(picked >= 0, picked * width + cols["centry"][0], -1))
    v4_sparse_attention(q, cache_rows, torch.cat(offsets, dim=1), layer.attn_sink, layer.scale, out)


def _index_select(
    layer: V4Attention,
    iq: torch.Tensor,
    iw: torch.Tensor,
    ikeys: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """[n, T] bool: the top `index_topk` visible entries of each query by the indexer's score."""
    scores = torch.einsum("nhd,td->nht", iq.float(), ikeys.float())
    scores = F.relu(scores) * layer.indexer.head_dim**-0.5
    scores = (scores * iw.unsqueeze(-1)).sum(dim=1).masked_fill(~visible, float("-inf"))
    k = min(layer.index_topk, scores.shape[1])
    picked = torch.zeros_like(visible)
    picked.scatter_(1, scores.topk(k, dim=-1).indices, True)
    return picked


def _compress_fake(
    x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, layer_idx: int
) -> None:
    return None


direct_register_custom_op(
    "v4_attn_compress_launch",
    v4_attn_compress_launch,
    mutates_args=["rows"],
    fake_impl=_compress_fake,
)


def _v4_attention_fake(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    iq: Optional[torch.Tensor],
    iw: Optional[torch.Tensor],
    output: torch.Tensor,
    layer_idx: int,
) -> None:
    return None


direct_register_custom_op(
    "v4_attention", v4_attention, mutates_args=["rows", "output"], fake_impl=_v4_attention_fake
)

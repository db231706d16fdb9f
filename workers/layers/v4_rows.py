"""Where DeepSeek-V4's cache rows are (workers/layers/v4_attention.py): a token's row through the
block table, a compressed entry's in the first block of its group, or without a cache (profiling,
dummy runs) the step's own rows; and the writes of a step's row columns. All planned from the row
count, through tensors on the device (a token graph records them).

Every layer of a kind asks the same of a step (each row's sequence, its window's slots, the
entries it sees, the compressors' windows: `window_slots`, `entry_slots`, `compress_index`):
tens of small kernels a layer. `step_memo` makes each answer once per forward and hands the same
tensors to the layers after the first.
"""

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch

from atomrt.graphs import region_graph
from atomrt.runtime.forward_context import get_forward_context
from atomrt.workers.layers.attention import paged_layer_state
from atomrt.workers.layers.attention_ref import copy_rows
from atomrt.workers.layers.paged_rows import row_seqs, step_sequences
from atomrt.workers.layers.v4_modules import V4CacheTensor

# Off: every layer makes its own answers (the comparison, e.g. `bench latency` of
# DeepSeek-V4-Flash's layers as a variant with this line changed)
STEP_MEMO = True


def step_memo(key: tuple, make: Callable[[], Any]) -> Any:
    """What `make()` returns, made the first time a forward asks for `key` and then the same
    tensors for the rest of it. `key` names all the value depends on (the metadata object and the
    positions' tensor, which the memo keeps alive, `held`; the row count; the layer kind's sizes)
    but the device contents of the step's metadata, which a forward does not change. The model
    empties the memo as each forward starts (`clear_step_memo`): a graph's capture makes its own,
    never reading what the warm-up before it made. Ask on the stream the layers run on, not the
    compressors' side stream: the side stream gets what it needs made before the fork."""
    if not STEP_MEMO:
        return make()
    memo = get_forward_context().step_memo
    value = memo.get(key)
    if value is None:
        value = memo[key] = make()
    return value


def clear_step_memo() -> None:
    """Forget the last forward's answers (the model's forward calls it first)."""
    get_forward_context().step_memo.clear()


def held(obj: object) -> int:
    """id(obj), for a memo key: the memo keeps `obj` as long as its answers, so that no other
    object takes that id while they may be read."""
    if STEP_MEMO:
        get_forward_context().step_memo.setdefault(("held", id(obj)), obj)
    return id(obj)


def held_ptr(t: torch.Tensor) -> int:
    """t.data_ptr(), for a memo key, `t` kept as `held` keeps an object: no other tensor takes its
    memory while the answers made from it may be read."""
    held(t)
    return t.data_ptr()


def md_key(md: object, n: int) -> tuple:
    """The part of a memo key every answer depends on: the metadata object and the row count."""
    return (held(md), n)


def key_counts(
    md: object, positions: torch.Tensor, rate: int, entries: int, window: int
) -> torch.Tensor:
    """[n] the keys of each row's attention list, its `window` keys then its entries: at most
    (p + 1) // rate of the `entries` (those it sees, or its picks of them, come first), made once
    per forward (`step_memo`) for the layers of one rate and width."""
    key = ("key counts", *md_key(md, positions.shape[0]), held_ptr(positions), rate, entries,
           window)  # fmt: skip
    return step_memo(key, lambda: ((positions.long() + 1) // rate).clamp(0, entries) + window)


def step_seqs(md: object, n: int, device: torch.device) -> Optional[torch.Tensor]:
    """`row_seqs`, made once per forward (`step_memo`)."""
    if md is None or md.cu_seqlens_q is None:
        return None
    return step_memo(("seq", *md_key(md, n)), lambda: row_seqs(md, n, device))


def table_slots(
    md: object, block_size: int, seq: torch.Tensor, index: torch.Tensor, row: torch.Tensor
) -> torch.Tensor:
    """The slots of row `row` of block `index` [n, k] of row i's block table (index < 0: none,
    slot -1), through the block table on the device (as int64 once per forward)."""
    table = step_memo(("table", held(md)), md.block_tables.long)
    seq = seq.clamp(max=table.shape[0] - 1).unsqueeze(1)
    blocks = table[seq, index.clamp(0, table.shape[1] - 1)]
    return torch.where(index >= 0, blocks.clamp(min=0) * block_size + row, -1)


def source_rows(md: object, cache: Optional[V4CacheTensor], rows: torch.Tensor) -> torch.Tensor:
    """The rows `row_source`'s slots index: the cache's [num_slots, width], or without a cache
    this step's `rows`."""
    if cache is not None and md is not None:
        return cache.rows.view(-1, cache.rows.shape[-1])
    return rows


def row_source(
    md: object,
    cache: Optional[V4CacheTensor],
    rows: torch.Tensor,
    positions: torch.Tensor,
    tokens: torch.Tensor,
    seq: Optional[torch.Tensor] = None,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Where the rows of `tokens` [n, k] (positions in row i's sequence; < 0: none) are, as
    (rows [num_slots, width], slots [n, k], -1: none): the cache's, through the block table on the
    device, or without a cache this step's (each sequence's rows from its first position). Planned
    from the row count alone; `seq`: `row_seqs`' answer, when the caller has it."""
    n = rows.shape[0]
    seq = row_seqs(md, n, rows.device) if seq is None else seq
    if cache is not None and md is not None:
        bs, t = cache.rows.shape[1], tokens.clamp(min=0)
        slots = table_slots(md, bs, seq, torch.where(tokens >= 0, t // bs, -1), t % bs)
        return source_rows(md, cache, rows), slots
    if seq is None:
        first = torch.zeros(n, dtype=torch.long, device=rows.device)
    else:
        cu = md.cu_seqlens_q.long()
        first = cu[seq.clamp(max=cu.shape[0] - 1)]
    src = first.unsqueeze(1) + tokens - positions[first].unsqueeze(1)
    return rows, torch.where(src >= first.unsqueeze(1), src.clamp(max=n - 1), -1)


def anchor_slots(
    md: object, cache: V4CacheTensor, seq: torch.Tensor, w: torch.Tensor, rate: int, stride: int
) -> torch.Tensor:
    """The cache slots of entries `w` [n, k] (< 0: none) of row i's sequence. The blocks of a
    sequence go in groups of k (`stride`, the model's smallest compress rate); the entries whose
    windows end in a group live in the entry columns of its first block, in the order they end:
    with a rate r >= k a group of k * block_size tokens ends at most block_size of them. A group's
    first block is allocated before its tokens end any, and holds nothing its group's tokens do
    not determine (prefix caching shares whole groups), so the blocks after it can be freed once
    behind every token's reach."""
    bs, k, r = cache.rows.shape[1], stride, rate
    end = (w.clamp(min=0) + 1) * r - 1  # the position that ends the window
    group, at = end // (k * bs), (end % (k * bs)) // r
    return table_slots(md, bs, seq, torch.where(w >= 0, group * k, -1), at)


def write_slots(
    md: object, cache: V4CacheTensor, n: int, slots: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Where `write_rows` puts n rows: at `slots`, a padded row's (slot < 0) at the scratch row;
    by default at slot_mapping's, made once per forward (`step_memo`)."""
    scratch = cache.storage.shape[0] - 1
    if slots is None:
        return step_memo(
            ("write", *md_key(md, n), scratch),
            lambda: write_slots(md, cache, n, md.slot_mapping[:n]),
        )
    return torch.where(slots >= 0, slots, scratch)


def write_rows(
    md: object,
    cache: Optional[V4CacheTensor],
    rows: torch.Tensor,
    columns: slice,
    targets: Optional[torch.Tensor] = None,
) -> None:
    """`columns` of the step's rows at `targets` (`write_slots`; slot_mapping's by default)."""
    if cache is None or md is None:
        return
    targets = write_slots(md, cache, rows.shape[0]) if targets is None else targets
    copy_rows(cache.storage[:, columns], targets, rows[:, columns])


class CompressIndex(NamedTuple):
    """What a compressed layer's compressors read of the step's positions (`compress_index`)."""

    windows: torch.Tensor  # [n] the window each row would end
    ends: torch.Tensor  # [n, 1] bool: the row's position ends it
    pooled: torch.Tensor  # [n] that window where the row ends it, -1 elsewhere (v4_pool's rows)
    slots: torch.Tensor  # [n, span] the window's tokens' slots in `row_source`'s rows
    cos: torch.Tensor  # [n, rope] the compress rotation at each row's window start
    sin: torch.Tensor
    writes: Optional[torch.Tensor]  # [n] where the step's rows go (None: no cache)
    entry_writes: Optional[torch.Tensor]  # [n] where the entries the rows end go


def compress_index(
    layer: Any, md: object, cache: object, rows: torch.Tensor, positions: torch.Tensor
) -> CompressIndex:
    """The compressors' index arithmetic for the step, made once per forward for each rate and
    window kind (`step_memo`), on the current stream: the fork's side stream reads it."""
    n, r, overlap = rows.shape[0], layer.rate, layer.compressor.overlap
    paged = cache is not None and md is not None
    scratch = cache.storage.shape[0] - 1 if paged else None
    key = (
        "compress", *md_key(md, n), held_ptr(positions), r, overlap, layer.anchor_stride,
        cache.rows.shape[1] if paged else None, scratch, id(layer.rotary), rows.dtype,
    )  # fmt: skip

    def make() -> CompressIndex:
        windows = ((positions + 1) // r - 1).clamp(min=0)
        span = 2 * r if overlap else r
        tokens = (positions + 1 - span).unsqueeze(1) + torch.arange(span, device=rows.device)
        ends = ((positions + 1) % r == 0).unsqueeze(1)
        seq = step_seqs(md, n, rows.device)
        slots = row_source(md, cache, rows, positions, tokens, seq)[1]
        at = windows * r
        cos = layer.rotary.cos_cache[at].to(rows.dtype)
        sin = layer.rotary.sin_cache[at].to(rows.dtype)
        writes = entry_writes = None
        if paged:
            writes = write_slots(md, cache, n)
            ended = ends.squeeze(1) & (md.slot_mapping[:n] >= 0)
            w = torch.where(ended, (positions + 1) // r - 1, -1).unsqueeze(1)
            anchors = anchor_slots(md, cache, seq, w, r, layer.anchor_stride)[:, 0]
            entry_writes = write_slots(md, cache, n, anchors)
        pooled = torch.where(ends.squeeze(1), windows, -1)
        return CompressIndex(windows, ends, pooled, slots, cos, sin, writes, entry_writes)

    return step_memo(key, make)


def window_slots(
    layer: Any, md: object, cache: object, rows: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """[n, W] the slots of each row's window tokens, p - window < t <= p (-1 before the sequence's
    start), in `row_source`'s rows; once per forward for each window (`step_memo`)."""
    n = rows.shape[0]
    paged = cache is not None and md is not None
    key = ("window", *md_key(md, n), held_ptr(positions), layer.window,
           cache.rows.shape[1] if paged else None)  # fmt: skip

    def make() -> torch.Tensor:
        back = torch.arange(layer.window - 1, -1, -1, device=rows.device)
        tokens = positions.long().unsqueeze(1) - back
        return row_source(md, cache, rows, positions, tokens, step_seqs(md, n, rows.device))[1]

    return step_memo(key, make)


def entry_width(layer: Any, rows: torch.Tensor) -> int:
    """T, the entries a compressed layer (a V4Attention) gives each row of a step room for: a
    recorded step (a token graph's or a drafter's recording, any CUDA graph capture) or a request
    graph's (graph-safe metadata) the most a sequence can have (max positions // rate, masked),
    an eager step the most the step's sequences have."""
    _, md, _ = paged_layer_state(layer.layer_idx)
    if (md is not None and md.graph_safe) or region_graph.recording():
        return layer.rotary.cos_cache.shape[0] // layer.rate
    return live_entries(layer, rows.shape[0])


def live_entries(layer: Any, num_rows: int) -> int:
    """The most entries a sequence of the step has (host data)."""
    _, md, cache = paged_layer_state(layer.layer_idx)
    seqs = step_sequences(md, num_rows, cache is not None and md is not None)
    return max((s.context_len // layer.rate for s in seqs), default=0)


def entry_slots(
    layer: Any,
    rows: torch.Tensor,
    positions: torch.Tensor,
    num_entries: Optional[int] = None,
) -> torch.Tensor:
    """[n, T] the slots of the compressed entries each row sees (entry w, in the row of its
    window's last token, once p >= (w + 1) * rate - 1; -1 past them), in `row_source`'s rows;
    T `num_entries`, by default `entry_width`'s."""
    _, md, cache = paged_layer_state(layer.layer_idx)
    r = layer.rate
    if num_entries is None:
        num_entries = entry_width(layer, rows)
    n, paged = rows.shape[0], cache is not None and md is not None
    key = ("entries", *md_key(md, n), held_ptr(positions), r, layer.anchor_stride, num_entries,
           cache.rows.shape[1] if paged else None)  # fmt: skip

    def make() -> torch.Tensor:
        w = torch.arange(num_entries, device=rows.device)
        visible = w.unsqueeze(0) < ((positions.long() + 1) // r).unsqueeze(1)  # [n, T]
        seq = step_seqs(md, n, rows.device)
        if paged:
            return anchor_slots(
                md, cache, seq, torch.where(visible, w.unsqueeze(0), -1), r, layer.anchor_stride
            )
        tokens = torch.where(visible, (w.unsqueeze(0) + 1) * r - 1, -1)
        return row_source(md, cache, rows, positions, tokens, seq)[1]

    return step_memo(key, make)

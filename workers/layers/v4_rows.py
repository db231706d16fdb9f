"""Where DeepSeek-V4's cache rows are (workers/layers/v4_attention.py): a token's row through the
block table, a compressed entry's in the first block of its group, or without a cache (profiling,
dummy runs) the step's own rows; and the writes of a step's row columns. All planned from the row
count, through tensors on the device (a token graph records them)."""

from typing import Optional

import torch

from atomrt.workers.layers.attention_ref import copy_rows
from atomrt.workers.layers.v4_modules import V4CacheTensor


def row_seqs(md: object, n: int, device: torch.device) -> Optional[torch.Tensor]:
    """[n] each row's sequence (its row of the block tables), None without metadata."""
    if md is None or md.cu_seqlens_q is None:
        return None
    cu = md.cu_seqlens_q.long()
    return torch.searchsorted(cu[1:], torch.arange(n, device=device), right=True)


def table_slots(
    md: object, block_size: int, seq: torch.Tensor, index: torch.Tensor, row: torch.Tensor
) -> torch.Tensor:
    """The slots of row `row` of block `index` [n, k] of row i's block table (index < 0: none,
    slot -1), through the block table on the device."""
    table = md.block_tables.long()
    seq = seq.clamp(max=table.shape[0] - 1).unsqueeze(1)
    blocks = table[seq, index.clamp(0, table.shape[1] - 1)]
    return torch.where(index >= 0, blocks.clamp(min=0) * block_size + row, -1)


def row_source(
    md: object,
    cache: Optional[V4CacheTensor],
    rows: torch.Tensor,
    positions: torch.Tensor,
    tokens: torch.Tensor,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Where the rows of `tokens` [n, k] (positions in row i's sequence; < 0: none) are, as
    (rows [num_slots, width], slots [n, k], -1: none): the cache's, through the block table on the
    device, or without a cache this step's (each sequence's rows from its first position). Planned
    from the row count alone."""
    n = rows.shape[0]
    seq = row_seqs(md, n, rows.device)
    if cache is not None and md is not None:
        bs, t = cache.rows.shape[1], tokens.clamp(min=0)
        slots = table_slots(md, bs, seq, torch.where(tokens >= 0, t // bs, -1), t % bs)
        return cache.rows.view(-1, cache.rows.shape[-1]), slots
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


def write_rows(
    md: object,
    cache: Optional[V4CacheTensor],
    rows: torch.Tensor,
    columns: slice,
    slots: Optional[torch.Tensor] = None,
) -> None:
    """`columns` of the step's rows at `slots` (slot_mapping by default); a padded row's (slot <
    0) into the scratch row."""
    if cache is None or md is None:
        return
    slots = md.slot_mapping[: rows.shape[0]] if slots is None else slots
    scratch = cache.storage.shape[0] - 1
    copy_rows(cache.storage[:, columns], torch.where(slots >= 0, slots, scratch), rows[:, columns])

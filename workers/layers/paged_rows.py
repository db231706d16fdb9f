"""Per-token cache rows through block tables: what the layers that keep one row per token share
(DeepSeek-V4's, workers/layers/v4_attention.py, and DSA's, workers/layers/dsa_mla.py), their
lightning indexer's scores in torch among it."""

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


class StepSequence(NamedTuple):
    index: int  # the sequence's row in the step's block tables
    start: int  # its first query row
    num_rows: int  # its query rows
    context_len: int  # its tokens so far, the query rows included


def step_sequences(md: object, num_rows: int, paged: bool) -> "list[StepSequence]":
    """The step's sequences that have query rows, from the host's copy of its metadata. Without a
    cache (`paged` False: profiling, dummy runs) each sequence is its rows alone from position 0;
    with no metadata, all rows are one."""
    if md is None or (md.cu_seqlens_q_cpu is None and md.cu_seqlens_q is None):
        return [StepSequence(0, 0, num_rows, num_rows)]
    cu = md.cu_seqlens_q_cpu if md.cu_seqlens_q_cpu is not None else md.cu_seqlens_q.tolist()
    num_seqs = md.num_seqs or len(cu) - 1
    lens = getattr(md, "context_lens_cpu", None)
    if lens is None and getattr(md, "context_lens", None) is not None:
        lens = md.context_lens.tolist()
    out = []
    for s in range(num_seqs):
        n = cu[s + 1] - cu[s]
        if n:
            out.append(StepSequence(s, cu[s], n, lens[s] if paged and lens is not None else n))
    return out


def row_seqs(md: object, n: int, device: torch.device) -> Optional[torch.Tensor]:
    """[n] each row's sequence (its row of the block tables), None without metadata; read on the
    device."""
    if md is None or md.cu_seqlens_q is None:
        return None
    cu = md.cu_seqlens_q.long()
    return torch.searchsorted(cu[1:], torch.arange(n, device=device), right=True)


def index_scores_ref(
    iq: torch.Tensor, iw: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, col: int
) -> torch.Tensor:
    """The lightning indexer's scores [n, T] float32 of the rows at `slots` [n, T] (-1: none,
    -inf there), their keys at column `col` of `rows`: sum_h iw_h relu(iq_h . k / sqrt(Di)). The
    torch form of `v4_index_scores` (workers/kernels/v4/v4_kernels.py)."""
    di = iq.shape[-1]
    keys = read_rows(rows, slots.clamp(min=0))[..., col : col + di].float()
    scores = F.relu(torch.einsum("nhd,ntd->nht", iq.float(), keys)) * di**-0.5
    return (scores * iw.unsqueeze(-1)).sum(dim=1).masked_fill(slots < 0, float("-inf"))


def index_scores(
    iq: torch.Tensor,
    iw: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    col: int,
    kernel: bool,
    chunk: int = 256,
) -> torch.Tensor:
    """`index_scores_ref`'s scores by the Triton kernel (`kernel`: CUDA, or the interpreter) or
    by torch, `chunk` query rows at a time (each chunk's products are [chunk, H, T])."""
    if kernel:
        from atomrt.workers.kernels.v4.v4_kernels import v4_index_scores

        return v4_index_scores(iq, iw, rows, slots, col)
    n = iq.shape[0]
    if n <= chunk:
        return index_scores_ref(iq, iw, rows, slots, col)
    return torch.cat(
        [
            index_scores_ref(iq[a : a + chunk], iw[a : a + chunk], rows, slots[a : a + chunk], col)
            for a in range(0, n, chunk)
        ]
    )


def read_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index] (an e4m3 cache is indexed as bytes: CPU has no float8 indexing kernel)."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8)[index].view(cache.dtype)
    return cache[index]


def sequence_rows(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """A sequence's rows [context_len, width] of a cache [num_blocks, block_size, width] through
    its block table [max_blocks]."""
    table = block_table[: -(-context_len // cache.shape[1])].long()
    return read_rows(cache, table).flatten(0, 1)[:context_len]


def returns_nothing(*args: object, **kwargs: object) -> None:
    """The fake of an op that writes its outputs in place (it returns nothing to trace)."""
    return None

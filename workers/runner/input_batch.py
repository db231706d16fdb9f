# Hot path (worker, once per step): turning a RankBatch plan into host arrays for the runner.
# What may live here: the worker's mirror of its sequences and numpy arithmetic. No torch.
"""The worker's view of its sequences, and one step's inputs as host (numpy) arrays.

The driver ships a decode step's new tokens and new block-table entries only (distributed.messages);
the worker keeps the rest in `SeqMirror`s: the block table, the sampling parameters and, for
penalties, the token history.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from atomrt.distributed.messages import (
    DRAFT_TOKEN,
    PENDING_TOKEN,
    RankBatch,
    WorkerSamplingParams,
)

if TYPE_CHECKING:
    from atomrt.workers.runner.token_pool import TokenPool


@dataclass
class SeqMirror:
    sampling_params: WorkerSamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    block_table_row: int = -1  # the sequence's row of `BlockTables.table`


class BlockTables:
    """Every mirrored sequence's block table, one row each of a persistent int32 array, -1 past
    its end. A step's tables are then one gather of its rows, not a copy per row from a list."""

    def __init__(self, num_rows: int = 64, width: int = 16) -> None:
        self.table = np.full((num_rows, width), -1, dtype=np.int32)  # [rows, max blocks so far]
        self.lengths = np.zeros(num_rows, dtype=np.int64)  # entries per row
        self._free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: lowest row first

    def add_row(self) -> int:
        if not self._free_rows:
            self._grow(rows=2 * self.table.shape[0], width=self.table.shape[1])
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self.truncate(row, 0)
        self._free_rows.append(row)

    def truncate(self, row: int, length: int) -> None:
        """Keep the row's first `length` entries."""
        self.table[row, length : self.lengths[row]] = -1
        self.lengths[row] = min(int(self.lengths[row]), length)

    def update(self, row: int, start: int, blocks: np.ndarray) -> None:
        """The row's entries from `start` on become `blocks` (the driver sends only what we lack)."""
        if (
            start > self.lengths[row]
        ):  # a plan from the driver that skips entries: never silently leave a gap
            raise RuntimeError(
                f"block-table update at {start} past the row's end {self.lengths[row]}"
            )
        end = start + blocks.shape[0]
        if end > self.table.shape[1]:
            self._grow(rows=self.table.shape[0], width=max(end, 2 * self.table.shape[1]))
        self.truncate(row, start)
        self.table[row, start:end] = blocks
        self.lengths[row] = end

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """int32 [len(rows), max(their lengths, 1)]: the rows' tables, -1 past each one's end."""
        width = max(int(self.lengths[rows].max(initial=0)), 1)
        return self.table[rows, :width]

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.table.shape
        table = np.full((rows, width), -1, dtype=np.int32)
        table[:old_rows, :old_width] = self.table
        self.table = table
        self.lengths = np.concatenate([self.lengths, np.zeros(rows - old_rows, dtype=np.int64)])
        self._free_rows.extend(range(rows - 1, old_rows - 1, -1))


@dataclass
class PromptRows:
    """The rows of a step whose logits score a prompt token, for the sequences that asked for
    prompt logprobs: sequence i's `num_positions[i]` rows come in turn, in row order."""

    seq_ids: np.ndarray  # int64 [m]
    num_positions: np.ndarray  # int32 [m]
    rows: np.ndarray  # int64 [sum(num_positions)]: the step rows
    token_ids: np.ndarray  # int64 [sum(num_positions)]: the prompt token each row's logits score
    k: int  # top alternatives returned per row: the largest prompt_logprobs asked


@dataclass
class StepInputs:
    """One forward's inputs as host arrays, the rows `StepBuffers` stages: a plan's `RankBatch`
    built out with this worker's mirror (`SeqMirrors.build`, rows in plan order), or made up with
    no plan (capture, an idle DP rank, kernel warm-up). Not a batch: the step path's one batch
    type is `RankBatch`.

    Why the two stay apart (one type would make each worse): a `RankBatch` is what the worker
    lacks (a decode step ships no positions and only the new block-table entries), so these arrays
    need the worker's mirror and token pool, not the message alone: as properties of the message
    they would pull the worker's state into distributed/, as fields they would widen the wire's
    schema with arrays it never carries. And these rows are the forward's, not the plan's: a
    two-microbatch split inserts padding rows (`num_tokens` counts them), dummy steps have no
    plan, and `input_ids` holds the ids the device reads (int64, 0 for a pending or draft row)
    where the plan's hold int32 markers (PENDING_TOKEN, DRAFT_TOKEN)."""

    seq_ids: np.ndarray  # int64 [bs]
    input_ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    slot_mapping: np.ndarray  # int64 [num_tokens]
    cu_seqlens_q: np.ndarray  # int32 [bs + 1]
    context_lens: np.ndarray  # int32 [bs]: KV length after this step
    block_tables: np.ndarray  # int32 [bs, max_blocks], -1 past each table's end
    sample_seq_idx: np.ndarray  # int64 [num_sampled]: which sequences sample this step
    sample_rows: np.ndarray  # int64 [num_sampled]: their last query row
    # int64 [num_tokens] (with a token pool): where each row's token is in the runner's token pool:
    # the row's own staged id (its index), the previous step's sample (TokenPool.prev_base + its
    # row), or the draft model's proposal for a draft row (TokenPool.draft_base + the row)
    token_src: Optional[np.ndarray] = None
    # Speculative decoding: int64 [bs], the drafts each sequence verifies (its last rows), and the
    # rows whose logits the step samples: each sampled sequence's drafts' rows and the row before.
    num_draft_tokens: Optional[np.ndarray] = None
    logits_rows: Optional[np.ndarray] = None
    prompt_rows: Optional[PromptRows] = None  # rows that compute prompt logprobs
    # MTP drafting: int64 [bs], the token after the rows of a sequence that samples nothing this
    # step (a prompt chunk that is not the last), -1 elsewhere (RankBatch.next_token_ids)
    next_token_ids: Optional[np.ndarray] = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """The rows staged, padding rows of a split step included."""
        return int(self.input_ids.shape[0])

    @property
    def max_seqlen_q(self) -> int:
        return int(np.diff(self.cu_seqlens_q).max(initial=0))

    @property
    def max_seqlen_k(self) -> int:
        return int(self.context_lens.max(initial=0))


class SeqMirrors:
    """The worker's sequences: applies a plan's updates and builds its `StepInputs`."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seqs: dict[int, SeqMirror] = {}
        self.block_tables = BlockTables()
        # sequences that asked for prompt logprobs and have prompt tokens left to score
        self.prompt_logprob_seqs: set[int] = set()
        # mirrored sequences whose sampling changes their logits (logit_bias and kin): a step
        # looks for additions only while there are some
        self.num_changing_logits = 0

    def apply(self, batch: RankBatch) -> None:
        if batch.reset:
            self.clear()
        for seq_id in batch.finished_seq_ids.tolist():
            mirror = self.seqs.pop(seq_id, None)
            if mirror is not None:
                self.block_tables.free_row(mirror.block_table_row)
                self.prompt_logprob_seqs.discard(seq_id)
                self.num_changing_logits -= mirror.sampling_params.changes_logits
        for r in batch.new_requests:
            mirror = SeqMirror(r.sampling_params, r.token_ids.tolist(), r.output_token_ids.tolist())
            self.add(r.seq_id, mirror)
            if r.sampling_params.prompt_logprobs is not None:
                self.prompt_logprob_seqs.add(r.seq_id)
        new_block_ids, hi = batch.new_block_ids, 0
        for seq_id, start, n in zip(
            batch.new_block_seq_ids.tolist(),
            batch.new_block_starts.tolist(),
            batch.num_new_blocks.tolist(),
        ):
            lo, hi = hi, hi + n
            self.block_tables.update(self.seqs[seq_id].block_table_row, start, new_block_ids[lo:hi])

    def clear(self) -> None:
        """Forget every sequence."""
        for mirror in self.seqs.values():
            self.block_tables.free_row(mirror.block_table_row)
        self.seqs.clear()
        self.prompt_logprob_seqs.clear()
        self.num_changing_logits = 0

    def add(self, seq_id: int, mirror: SeqMirror) -> None:
        """Mirror a new sequence (a seq_id sent again replaces its mirror); its block table starts empty."""
        old = self.seqs.get(seq_id)
        if old is not None:
            self.block_tables.free_row(old.block_table_row)
            self.num_changing_logits -= old.sampling_params.changes_logits
        mirror.block_table_row = self.block_tables.add_row()
        self.seqs[seq_id] = mirror
        self.num_changing_logits += mirror.sampling_params.changes_logits

    def build(self, batch: RankBatch, tokens: Optional[TokenPool] = None) -> StepInputs:
        """Positions, slots, cu_seqlens and block tables of the plan's rows (vectorised per step).
        `tokens` (async scheduling) says where pending rows find their token."""
        q_lens = batch.num_new_tokens.astype(np.int64)
        computed = batch.num_computed_tokens.astype(np.int64)
        bs = q_lens.shape[0]
        cu = np.zeros(bs + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        if num_tokens == bs and (
            bs == 0 or int(q_lens.max()) == 1
        ):  # one row each (decode): row i is sequence i
            seq_of_row, positions = np.arange(bs), computed
        else:
            seq_of_row = np.repeat(np.arange(bs), q_lens)
            positions = computed[seq_of_row] + (np.arange(num_tokens) - cu[:-1][seq_of_row])
        table_rows = np.asarray(
            [self.seqs[s].block_table_row for s in batch.seq_ids.tolist()], dtype=np.int64
        )
        block_tables = self.block_tables.gather(table_rows)
        blocks = block_tables[seq_of_row, positions // self.block_size].astype(np.int64)
        slot_mapping = blocks * self.block_size + positions % self.block_size
        sample_seq_idx = np.flatnonzero(batch.sample_mask).astype(np.int64, copy=False)
        input_ids = batch.input_ids.astype(np.int64)
        token_src = self._token_src(batch, input_ids, seq_of_row, tokens)
        num_drafts = logits_rows = None
        if batch.num_draft_tokens.size:  # speculative decoding: each sampled row's drafts too
            num_drafts = batch.num_draft_tokens.astype(np.int64)
            ends, counts = cu[1:][sample_seq_idx], num_drafts[sample_seq_idx] + 1
            logits_rows = np.repeat(ends - counts, counts) + (
                np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            )
        prompt_rows = None
        if self.prompt_logprob_seqs:  # prompt logprobs: only sequences that asked
            prompt_rows = self._prompt_rows(batch.seq_ids.tolist(), cu, computed, q_lens)
        return StepInputs(
            seq_ids=batch.seq_ids.astype(np.int64, copy=False),
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            cu_seqlens_q=cu,
            context_lens=(computed + q_lens).astype(np.int32),
            block_tables=block_tables,
            sample_seq_idx=sample_seq_idx,
            sample_rows=cu[1:][sample_seq_idx].astype(np.int64) - 1,
            token_src=token_src,
            num_draft_tokens=num_drafts,
            logits_rows=logits_rows,
            prompt_rows=prompt_rows,
            next_token_ids=batch.next_token_ids.astype(np.int64)
            if batch.next_token_ids.size
            else None,
        )

    def _prompt_rows(
        self, seq_ids: list[int], cu: np.ndarray, computed: np.ndarray, q_lens: np.ndarray
    ) -> Optional[PromptRows]:
        """The rows at positions p < len(prompt) - 1 of the sequences that asked for prompt
        logprobs: row p's logits score prompt token p + 1. A sequence whose rows reach its
        prompt's last token is done (a preemption before that recomputes and scores again)."""
        ids, counts, rows, tokens, k = [], [], [], [], 0
        for i, seq_id in enumerate(seq_ids):
            if seq_id not in self.prompt_logprob_seqs:
                continue
            mirror = self.seqs[seq_id]
            prompt = mirror.prompt_token_ids
            start, q = int(computed[i]), int(q_lens[i])
            end = min(start + q, len(prompt) - 1)
            if start + q >= len(prompt) - 1:
                self.prompt_logprob_seqs.discard(seq_id)
            if end <= start:
                continue
            ids.append(seq_id)
            counts.append(end - start)
            rows.append(np.arange(end - start, dtype=np.int64) + int(cu[i]))
            tokens.append(np.asarray(prompt[start + 1 : end + 1], dtype=np.int64))
            k = max(k, mirror.sampling_params.prompt_logprobs)
        if not ids:
            return None
        return PromptRows(
            seq_ids=np.asarray(ids, dtype=np.int64),
            num_positions=np.asarray(counts, dtype=np.int32),
            rows=np.concatenate(rows),
            token_ids=np.concatenate(tokens),
            k=k,
        )

    def _token_src(
        self,
        batch: RankBatch,
        input_ids: np.ndarray,
        seq_of_row: np.ndarray,
        tokens: Optional[TokenPool],
    ) -> Optional[np.ndarray]:
        """Where each row's token is in the token pool (see StepInputs.token_src). A pending or
        draft row's staged id becomes 0: padding rows of a graph bucket read staged slot 0, which
        must hold a valid token id."""
        pending = np.flatnonzero(input_ids == PENDING_TOKEN)
        drafts = np.flatnonzero(input_ids == DRAFT_TOKEN)
        if tokens is None:
            if pending.size or drafts.size:
                raise RuntimeError(
                    "the plan has pending or draft input tokens, but this worker has no token pool "
                    "(async scheduling or a draft model)"
                )
            return None
        token_src = np.arange(batch.num_tokens, dtype=np.int64)
        if drafts.size:
            token_src[drafts] = tokens.draft_base + drafts
            input_ids[drafts] = 0
        if pending.size:
            seq_ids = batch.seq_ids[seq_of_row[pending]].tolist()
            prev_rows = tokens.prev_rows
            missing = [s for s in seq_ids if s not in prev_rows]
            if missing:
                raise RuntimeError(
                    f"sequences {missing[:5]} have a pending input token but sampled nothing in the previous step"
                )
            token_src[pending] = [tokens.prev_base + prev_rows[s] for s in seq_ids]
            input_ids[pending] = 0
        return token_src

    def record_sampled(self, seq_ids: list[int], token_ids: list) -> None:
        """Append each sequence's sampled token, or its tokens (a list: speculative decoding); one
        freed since its step was launched is skipped."""
        for s, t in zip(seq_ids, token_ids):
            mirror = self.seqs.get(s)
            if mirror is not None:
                if isinstance(t, list):
                    mirror.output_token_ids.extend(t)
                else:
                    mirror.output_token_ids.append(t)


def dummy_decode_inputs(bs: int, max_q_len: int, block_size: int = 0) -> StepInputs:
    """`bs` sequences of `max_q_len` rows at position 0.. reading cache block 0 (in as many table
    entries as `max_q_len` rows span with `block_size`; default: one) and writing no KV: what
    capture records, and what an idle DP rank runs."""
    n = bs * max_q_len
    num_blocks = -(-max_q_len // block_size) if block_size else 1
    cu = np.arange(0, n + 1, max_q_len, dtype=np.int32)
    return StepInputs(
        seq_ids=np.arange(bs, dtype=np.int64),
        input_ids=np.zeros(n, dtype=np.int64),
        positions=np.tile(np.arange(max_q_len, dtype=np.int64), bs),
        slot_mapping=np.full(n, -1, dtype=np.int64),
        cu_seqlens_q=cu,
        context_lens=np.full(bs, max_q_len, dtype=np.int32),
        block_tables=np.zeros((bs, num_blocks), dtype=np.int32),
        sample_seq_idx=np.arange(bs, dtype=np.int64),
        sample_rows=cu[1:].astype(np.int64) - 1,
    )


def dummy_idle_inputs(
    num_tokens: int, max_q_len: int, max_model_len: int, vocab_size: int
) -> StepInputs:
    """What an idle DP rank runs: `num_tokens` rows in sequences of `max_q_len` rows (a decode
    bucket's shape), or, for a prefill step (`max_q_len == num_tokens`), sequences of at most
    `max_model_len` rows (positions stay within the rotary tables). No KV writes. The tokens are
    spread over the vocabulary, so a MoE layer does not route every dummy row to one expert."""
    q = max(1, min(max_q_len, max_model_len))
    lens = np.full(num_tokens // q, q, dtype=np.int64)
    if num_tokens % q:
        lens = np.append(lens, num_tokens % q)
    bs = int(lens.shape[0])
    cu = np.zeros(bs + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1], lens)
    return StepInputs(
        seq_ids=np.arange(bs, dtype=np.int64),
        input_ids=(np.arange(num_tokens, dtype=np.int64) * 7919) % vocab_size,
        positions=positions,
        slot_mapping=np.full(num_tokens, -1, dtype=np.int64),
        cu_seqlens_q=cu,
        context_lens=lens.astype(np.int32),
        block_tables=np.zeros((bs, 1), dtype=np.int32),
        sample_seq_idx=np.zeros(0, dtype=np.int64),
        sample_rows=np.zeros(0, dtype=np.int64),
    )

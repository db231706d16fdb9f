"""The worker's mirror of its sequences (workers/runner/input_batch.py): block tables kept across steps
from the driver's updates, and the step inputs built from them."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_messages import new_blocks

from atomrt.distributed.messages import NewRequest, RankBatch, decode, encode
from atomrt.workers.runner.input_batch import BlockTables, SeqMirrors


def _decode_batch(seq_ids: list[int], context_lens: list[int], **kw) -> RankBatch:
    n = len(seq_ids)
    return RankBatch(
        seq_ids=np.asarray(seq_ids, dtype=np.int64),
        num_new_tokens=np.ones(n, dtype=np.int32),
        num_computed_tokens=np.asarray(context_lens, dtype=np.int32) - 1,
        input_ids=np.arange(n, dtype=np.int32),
        sample_mask=np.ones(n, dtype=np.bool_),
        **kw,
    )


def test_build_reads_tables_kept_from_updates() -> None:
    mirrors = SeqMirrors(block_size=4)
    new = [
        NewRequest(7, np.array([1, 2, 3], dtype=np.int32)),
        NewRequest(8, np.array([4], dtype=np.int32)),
    ]
    mirrors.apply(
        _decode_batch([], [], new_requests=new, **new_blocks({7: (0, [5, 6]), 8: (0, [9])}))
    )
    mirrors.apply(_decode_batch([], [], **new_blocks({7: (2, [11])})))
    inputs = mirrors.build(_decode_batch([8, 7], [2, 9]))
    assert inputs.block_tables.tolist() == [[9, -1, -1], [5, 6, 11]]
    assert inputs.slot_mapping.tolist() == [9 * 4 + 1, 11 * 4 + 0]

    # An update from an earlier index replaces the tail (from 0: a preempted sequence's new table).
    mirrors.apply(_decode_batch([], [], **new_blocks({7: (1, [12]), 8: (0, [3])})))
    assert mirrors.build(_decode_batch([7, 8], [5, 1])).block_tables.tolist() == [[5, 12], [3, -1]]


def test_reset_drops_every_mirror_before_the_batch_applies() -> None:
    mirrors = SeqMirrors(block_size=4)
    mirrors.apply(
        _decode_batch(
            [],
            [],
            new_requests=[NewRequest(1), NewRequest(2)],
            **new_blocks({1: (0, [4, 5]), 2: (0, [6])}),
        )
    )
    again = NewRequest(
        2, np.array([9, 9], dtype=np.int32), output_token_ids=np.array([7], dtype=np.int32)
    )
    mirrors.apply(
        _decode_batch([], [], new_requests=[again], reset=True, **new_blocks({2: (0, [8])}))
    )
    assert sorted(mirrors.seqs) == [2]
    assert mirrors.seqs[2].prompt_token_ids == [9, 9] and mirrors.seqs[2].output_token_ids == [7]
    assert mirrors.build(_decode_batch([2], [1])).block_tables.tolist() == [[8]]


def test_a_freed_row_is_reused_clean() -> None:
    mirrors = SeqMirrors(block_size=4)
    mirrors.apply(
        _decode_batch([], [], new_requests=[NewRequest(1)], **new_blocks({1: (0, [0, 1, 2])}))
    )
    row = mirrors.seqs[1].block_table_row
    mirrors.apply(
        _decode_batch(
            [], [], new_requests=[NewRequest(2)], finished_seq_ids=np.array([1], dtype=np.int64)
        )
    )
    assert 1 not in mirrors.seqs and mirrors.seqs[2].block_table_row == row
    assert mirrors.build(_decode_batch([2], [1])).block_tables.tolist() == [[-1]]


def test_block_tables_match_lists_through_growth() -> None:
    """Random updates, truncations and frees, past the initial rows and width, against plain lists."""
    rng = random.Random(0)
    tables = BlockTables(num_rows=2, width=2)
    reference: dict[int, list[int]] = {}
    for _ in range(500):
        op = rng.random()
        if op < 0.2 or not reference:
            reference[tables.add_row()] = []
        elif op < 0.3:
            row = rng.choice(list(reference))
            tables.free_row(row)
            del reference[row]
        elif op < 0.4:
            row = rng.choice(list(reference))
            tables.truncate(row, 0)
            reference[row] = []
        else:
            row = rng.choice(list(reference))
            start = rng.randint(0, len(reference[row]))
            blocks = [rng.randrange(1000) for _ in range(rng.randint(0, 5))]
            tables.update(row, start, np.asarray(blocks, dtype=np.int32))
            reference[row] = reference[row][:start] + blocks
        rows = list(reference)
        width = max([len(t) for t in reference.values()] + [1])
        expected = [t + [-1] * (width - len(t)) for t in reference.values()]
        assert tables.gather(np.asarray(rows, dtype=np.int64)).tolist() == expected
    assert tables.table.shape[0] > 2 and tables.table.shape[1] > 2


def test_mixed_step_positions_and_slots() -> None:
    """A prefill chunk next to a decode row: positions count on from each sequence's computed tokens."""
    mirrors = SeqMirrors(block_size=4)
    updates = new_blocks({1: (0, [3, 8]), 2: (0, [5])})
    mirrors.apply(_decode_batch([], [], new_requests=[NewRequest(1), NewRequest(2)], **updates))
    batch = RankBatch(
        seq_ids=np.array([2, 1], dtype=np.int64),
        num_new_tokens=np.array([1, 3], dtype=np.int32),
        num_computed_tokens=np.array([2, 2], dtype=np.int32),
        input_ids=np.arange(4, dtype=np.int32),
        sample_mask=np.array([True, False]),
    )
    inputs = mirrors.build(batch)
    assert inputs.positions.tolist() == [2, 2, 3, 4]
    assert inputs.slot_mapping.tolist() == [5 * 4 + 2, 3 * 4 + 2, 3 * 4 + 3, 8 * 4 + 0]
    assert inputs.cu_seqlens_q.tolist() == [0, 1, 4] and inputs.context_lens.tolist() == [3, 5]
    assert inputs.sample_seq_idx.tolist() == [0] and inputs.sample_rows.tolist() == [0]


def test_as_many_rows_as_sequences_but_not_one_each() -> None:
    """Rows [0, 2]: as many rows as sequences, yet not a decode step; both rows are sequence 2's."""
    mirrors = SeqMirrors(block_size=4)
    updates = new_blocks({1: (0, [3]), 2: (0, [5, 6])})
    mirrors.apply(_decode_batch([], [], new_requests=[NewRequest(1), NewRequest(2)], **updates))
    batch = RankBatch(
        seq_ids=np.array([1, 2], dtype=np.int64),
        num_new_tokens=np.array([0, 2], dtype=np.int32),
        num_computed_tokens=np.array([1, 3], dtype=np.int32),
        input_ids=np.arange(2, dtype=np.int32),
        sample_mask=np.array([False, True]),
    )
    inputs = mirrors.build(batch)
    assert inputs.positions.tolist() == [3, 4]
    assert inputs.slot_mapping.tolist() == [5 * 4 + 3, 6 * 4 + 0]


def test_an_update_past_the_end_is_an_error() -> None:
    tables = BlockTables(num_rows=2, width=4)
    row = tables.add_row()
    tables.update(row, 0, np.array([7, 8], dtype=np.int32))
    with pytest.raises(RuntimeError, match="past the row's end 2"):
        tables.update(row, 3, np.array([9], dtype=np.int32))


def test_flat_updates_round_trip_and_apply_like_per_sequence_updates() -> None:
    """Steps of random updates (new, growing, rewound, preempted and finished sequences), flat in a
    RankBatch through the codec: the mirrors' tables are those of one BlockTables.update per sequence."""
    rng = random.Random(1)
    mirrors = SeqMirrors(block_size=4)
    reference: dict[int, list[int]] = {}  # seq_id -> its block table, from the per-sequence updates
    for _ in range(60):
        finished = rng.sample(sorted(reference), k=min(len(reference), rng.randint(0, 2)))
        for s in finished:
            del reference[s]
        new = [s for s in rng.sample(range(100), k=rng.randint(0, 4)) if s not in reference]
        reference.update({s: [] for s in new})
        updates = {}
        for s in rng.sample(sorted(reference), k=rng.randint(0, len(reference))):
            start = rng.randint(0, len(reference[s]))
            updates[s] = (start, [rng.randrange(4096) for _ in range(rng.randint(0, 40))])
            reference[s] = reference[s][:start] + updates[s][1]
        batch = decode(
            encode(
                _decode_batch(
                    [],
                    [],
                    new_requests=[NewRequest(s) for s in new],
                    finished_seq_ids=np.array(finished, dtype=np.int64),
                    **new_blocks(updates),
                )
            )
        )
        mirrors.apply(batch)
        assert sorted(mirrors.seqs) == sorted(reference)
        for s, table in reference.items():
            row = mirrors.seqs[s].block_table_row
            assert (
                mirrors.block_tables.table[row, : mirrors.block_tables.lengths[row]].tolist()
                == table
            ), s


def test_draft_rows_read_the_token_pool_and_are_sampled() -> None:
    """Speculative decoding: a verify row's drafts are its last rows; a draft model's (DRAFT_TOKEN)
    read the token pool's draft part at their row; the logits rows are each sampled sequence's
    drafts' rows and the row before."""
    from atomrt.distributed.messages import DRAFT_TOKEN
    from atomrt.workers.runner.token_pool import TokenPool

    mirrors = SeqMirrors(block_size=4)
    new = [NewRequest(s, np.arange(8, dtype=np.int32)) for s in (1, 2, 3)]
    blocks = new_blocks({1: (0, [1, 2]), 2: (0, [3, 4, 5]), 3: (0, [6, 7])})
    mirrors.apply(RankBatch(new_requests=new, **blocks))
    pool = TokenPool(max_num_tokens=16, max_num_seqs=4, device="cpu", drafts=True)
    d = DRAFT_TOKEN
    batch = RankBatch(  # seq 1: a prompt chunk (4 rows); seq 2: t + 2 drafts; seq 3: one row
        seq_ids=np.array([1, 2, 3], dtype=np.int64),
        num_new_tokens=np.array([4, 3, 1], dtype=np.int32),
        num_computed_tokens=np.array([0, 8, 7], dtype=np.int32),
        input_ids=np.array([0, 1, 2, 3, 9, d, d, 5], dtype=np.int32),
        sample_mask=np.array([False, True, True]),
        num_draft_tokens=np.array([0, 2, 0], dtype=np.int32),
    )
    inputs = mirrors.build(batch, pool)
    assert inputs.num_draft_tokens.tolist() == [0, 2, 0]
    assert inputs.logits_rows.tolist() == [4, 5, 6, 7]
    assert inputs.sample_rows.tolist() == [6, 7]
    assert inputs.token_src.tolist() == [0, 1, 2, 3, 4, pool.draft_base + 5, pool.draft_base + 6, 7]
    assert inputs.input_ids.tolist() == [0, 1, 2, 3, 9, 0, 0, 5]  # a draft row's staged id: 0
    assert inputs.positions[4:7].tolist() == [8, 9, 10]
    assert inputs.context_lens.tolist() == [4, 11, 8]
    with pytest.raises(RuntimeError, match="no token pool"):
        mirrors.build(batch)

"""BlockManager with a windowed model's blocks (`WindowBlocks`, DeepSeek-V4): a sequence's blocks
behind the reach return to the pool but the first of each group, prefix-cache hits are whole
groups, and the ref counts stay exact."""

from collections import Counter

from atomrt.runtime.driver.block_manager import BlockManager, WindowBlocks
from atomrt.runtime.driver.sequence import Sequence


def check_counts(bm: BlockManager, holders: list[Sequence]) -> None:
    """Ref counts equal the sequences holding each block (-1: a place returned to the pool)."""
    counts = Counter(b for s in holders for b in s.block_table if b >= 0)
    for block in bm.blocks:
        assert block.ref_count == counts[block.block_id], (block, counts[block.block_id])
    assert set(bm._free) == {b.block_id for b in bm.blocks if b.ref_count == 0}


def step(bm: BlockManager, seq: Sequence, num_new: int) -> None:
    """What a scheduled step does to the table: grow it, then mark the tokens computed."""
    if seq.block_table or seq.num_computed_tokens:
        bm.append_slots(seq, num_new)
    else:
        bm.allocate(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.cache_computed_blocks(seq)


def test_blocks_behind_the_reach_return_but_each_groups_first() -> None:
    window = WindowBlocks(anchor_stride=3, reach=6, free_behind=True)
    bm = BlockManager(num_blocks=64, block_size=4, window=window)
    seq = Sequence("a", list(range(8)))
    step(bm, seq, 8)
    for t in range(60):  # decode one token at a time
        seq.token_ids.append(100 + t)
        step(bm, seq, 1)
        # every block a step may still read is there: the reach behind the next position
        first_needed = max(0, seq.num_computed_tokens - window.reach) // 4
        kept = [i for i, b in enumerate(seq.block_table) if b >= 0]
        assert set(range(first_needed, len(seq.block_table))) <= set(kept)
        assert all(i % 3 for i, b in enumerate(seq.block_table) if b < 0)  # never a first
        check_counts(bm, [seq])
    held = sum(1 for b in seq.block_table if b >= 0)
    assert held < len(seq.block_table) // 2 and bm.num_window_freed_blocks > 0
    assert bm.num_used_blocks == held
    bm.free(seq)
    assert bm.num_free_blocks == 64
    check_counts(bm, [])


def test_margin_keeps_what_a_rejected_draft_steps_back_to() -> None:
    tight = BlockManager(64, 4, window=WindowBlocks(2, 4, True))
    loose = BlockManager(64, 4, window=WindowBlocks(2, 4, True, margin=8))
    for bm in (tight, loose):
        seq = Sequence("a", list(range(40)))
        step(bm, seq, 40)
        step(bm, seq, 1)
    assert loose.num_window_freed_blocks < tight.num_window_freed_blocks


def test_prefix_hits_are_whole_groups() -> None:
    bm = BlockManager(num_blocks=64, block_size=4, window=WindowBlocks(3, 100, True))
    a = Sequence("a", list(range(30)))
    step(bm, a, 30)
    b = Sequence("b", list(range(22)) + [99, 98])  # 5 shared full blocks: one group of 3
    assert bm.num_cached_tokens(b) == 12
    step(bm, b, 12)
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    check_counts(bm, [a, b])
    plain = BlockManager(num_blocks=64, block_size=4)
    step(plain, Sequence("a", list(range(30))), 30)
    assert plain.num_cached_tokens(Sequence("b", list(range(22)) + [99, 98])) == 20


def test_blocks_stay_without_free_behind() -> None:
    bm = BlockManager(64, 4, window=WindowBlocks(2, 4, free_behind=False))
    seq = Sequence("a", list(range(40)))
    step(bm, seq, 40)
    step(bm, seq, 1)
    assert -1 not in seq.block_table and bm.num_window_freed_blocks == 0


def test_preempted_sequence_recomputes_with_a_fresh_table() -> None:
    """free() skips the returned places; the recomputation allocates again from its hits."""
    bm = BlockManager(num_blocks=64, block_size=4, window=WindowBlocks(2, 4, True))
    seq = Sequence("a", list(range(30)))
    step(bm, seq, 30)
    step(bm, seq, 1)
    assert -1 in seq.block_table
    bm.free(seq)
    seq.num_computed_tokens = 0
    assert seq.block_table == [] and seq.num_blocks_behind == 0
    check_counts(bm, [])
    hits = bm.num_cached_tokens(seq)
    assert hits % (2 * 4) == 0
    step(bm, seq, len(seq.token_ids) - hits)
    check_counts(bm, [seq])

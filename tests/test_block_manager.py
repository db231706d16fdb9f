"""BlockManager: ref counts, free list, prefix caching (chained hashes, LRU reuse)."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from atomrt.runtime.driver.block_manager import BlockManager
from atomrt.runtime.driver.sequence import Sequence


def check_invariants(bm: BlockManager, holders: list[Sequence]) -> None:
    """Ref counts equal the number of sequences holding each block; free + used == total."""
    counts = Counter(b for s in holders for b in s.block_table)
    for s in holders:
        assert len(set(s.block_table)) == len(s.block_table), f"seq {s.seq_id} holds a block twice"
    for block in bm.blocks:
        assert block.ref_count == counts[block.block_id], (block, counts[block.block_id])
    free = {b.block_id for b in bm.blocks if b.ref_count == 0}
    assert set(bm._free) == free
    assert bm.num_free_blocks + sum(1 for b in bm.blocks if b.ref_count > 0) == bm.num_blocks
    for h, block_id in bm._cached.items():
        assert bm.blocks[block_id].block_hash == h
    bs = bm.block_size
    for (
        s
    ) in holders:  # a cached block a sequence holds (shared or not) holds that sequence's tokens
        for i, block_id in enumerate(s.block_table):
            block = bm.blocks[block_id]
            if block.block_hash is not None:
                assert block.token_ids == tuple(s.token_ids[i * bs : (i + 1) * bs]), (s.seq_id, i)
                assert (i + 1) * bs <= s.num_computed_tokens, (
                    "a cached block must be fully computed"
                )


def compute(bm: BlockManager, seq: Sequence, num_new: int) -> None:
    """What a step does: grow the table, then mark the tokens computed and cache full blocks."""
    if seq.block_table or seq.num_computed_tokens:
        bm.append_slots(seq, num_new)
    else:
        bm.allocate(seq, num_new)
    assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + num_new
    seq.num_computed_tokens += num_new
    bm.cache_computed_blocks(seq)


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = Sequence("r", list(range(10)))
    assert bm.can_allocate(seq, 10)
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    check_invariants(bm, [seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    check_invariants(bm, [])


def test_prefix_hit_reuses_the_same_physical_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Sequence("a", list(range(10)))
    compute(bm, a, 10)
    b = Sequence("b", list(range(8)) + [99, 98, 97])
    assert bm.num_cached_tokens(b) == 8
    compute(bm, b, 3)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 11
    assert bm.blocks[a.block_table[0]].ref_count == 2
    check_invariants(bm, [a, b])


def test_hit_leaves_at_least_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Sequence("a", list(range(8)))
    compute(bm, a, 8)
    b = Sequence("b", list(range(8)))  # exactly two full cached blocks
    assert bm.num_cached_tokens(b) == 4
    compute(bm, b, 4)
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_same_tokens_at_another_position_do_not_hit() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    compute(bm, Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]), 9)
    assert bm.num_cached_tokens(Sequence("b", [5, 6, 7, 8, 0])) == 0  # block 2's tokens, no parent


def test_freed_cached_blocks_are_hit_then_evicted_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Sequence("a", [1, 2, 3, 4, 5])
    compute(bm, a, 5)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4
    # The unhashed partial block goes first; the tail full block before the head one.
    assert table == [0, 1, 2] and list(bm._free) == [2, 3, 1, 0]
    b = Sequence("b", [1, 2, 3, 4, 9])
    compute(bm, b, 1)
    assert b.block_table[:2] == table[:2], "a free cached block is still hit"
    check_invariants(bm, [b])
    bm.free(b)
    # Filling the cache evicts the cached blocks: no stale hit survives.
    c = Sequence("c", [7] * 8)
    compute(bm, c, 8)
    assert bm.num_cached_tokens(Sequence("d", [1, 2, 3, 4, 9])) == 0
    check_invariants(bm, [c])


def test_can_allocate_counts_free_hits() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = Sequence("a", [1, 2, 3, 4, 5])
    compute(bm, a, 5)
    bm.free(a)
    b = Sequence("b", [1, 2, 3, 4, 5, 6])  # hits 2 free cached blocks, needs 1 new: 3 in all
    assert bm.can_allocate(b, 2)
    assert not bm.can_allocate(b, 3)
    compute(bm, b, 2)
    assert bm.num_free_blocks == 0
    check_invariants(bm, [b])


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=6),
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()), max_size=40),
    block_size=st.integers(1, 4),
)
def test_random_allocate_grow_free_never_leaks(prompts, ops, block_size) -> None:
    bm = BlockManager(num_blocks=12, block_size=block_size)
    seqs = [Sequence(f"r{i}", p) for i, p in enumerate(prompts)]
    for index, num_new, do_free in ops:
        seq = seqs[index % len(seqs)]
        if do_free:
            bm.free(seq)
            seq.num_computed_tokens = 0
        else:
            if seq.num_computed_tokens == len(seq.token_ids):
                seq.token_ids.append(num_new % 4)  # a sampled token
            if not seq.block_table:
                seq.num_computed_tokens = 0
                num_new = min(num_new, len(seq.token_ids) - bm.num_cached_tokens(seq))
                if bm.can_allocate(seq, num_new):
                    compute(bm, seq, num_new)
            else:
                num_new = min(num_new, len(seq.token_ids) - seq.num_computed_tokens)
                if bm.can_append(seq, num_new):
                    compute(bm, seq, num_new)
        check_invariants(bm, [s for s in seqs if s.block_table])
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks

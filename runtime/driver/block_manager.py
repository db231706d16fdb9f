"""`BlockManager`: the paged KV cache's blocks on the driver: free list, ref counts, prefix cache.

A sequence's token at position p lives in `block_table[p // block_size]`. With prefix caching a
FULL block whose tokens are all computed is registered under a hash chained over
(parent block's hash, the block's token ids); a later sequence whose token_ids start with the same
full blocks shares those physical blocks (ref count + 1) and skips computing them. At least one
token of a sequence is always left to compute, so the step that admits it yields logits and no
shared block is ever written.

Free blocks (ref count 0) sit in one LRU queue: evicted first are blocks that hold nothing
reusable, then cached blocks least recently freed; a free cached block can still be hit (and
leaves the queue) until it is evicted for reuse.

A windowed model (`WindowBlocks`: DeepSeek-V4) reads a token's own row only while the token is
within `reach` of the positions it computes, and keeps what lasts (its compressed entries) in the
first block of each group of `anchor_stride` blocks. Its prefix-cache hits are whole groups, and
the other blocks of a sequence return to the pool once every token in them is behind the reach:
the table keeps their place as -1 (the workers never read them again).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from atomrt.runtime.driver.sequence import Sequence

logger = logging.getLogger(__name__)

_NO_PARENT = 0x9E3779B97F4A7C15  # the chain's seed: the hash of "no parent block"


def hash_block(parent_hash: Optional[int], token_ids: tuple[int, ...]) -> int:
    """Chained block hash: equal iff (parent chain, these tokens) are equal (up to collisions,
    which `BlockManager` rules out by comparing token ids on every hit)."""
    return hash((_NO_PARENT if parent_hash is None else parent_hash, token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: Optional[int] = None  # set while registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens a cached block holds (checked on hits)


@dataclass(frozen=True)
class WindowBlocks:
    """A windowed model's blocks (this module's docstring)."""

    anchor_stride: int  # k: a sequence's blocks go in groups of k, the first of each kept
    reach: int  # tokens back from the first position a step computes that it reads rows of
    free_behind: bool  # whether the other blocks behind the reach return to the pool
    margin: int = 0  # tokens a sequence may step back (rejected speculative tokens)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        recompute_last_hit: bool = False,
        window: Optional[WindowBlocks] = None,
    ) -> None:
        """`recompute_last_hit`: a prefix-cache hit leaves its last block to compute again. An MTP
        drafter's KV at a position depends on the token after it, which a later sequence sharing
        the block need not share; recomputed, the block's last row reads the sequence's own."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"BlockManager: num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.recompute_last_hit = recompute_last_hit
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU of free blocks: popped from the front. Value unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.num_prefix_hit_tokens = 0  # counters for metrics
        self.num_prefix_query_tokens = 0
        self.window = window
        self.num_window_freed_blocks = 0
        if window is not None:
            logger.info(
                "KV blocks: entries kept in every %d-th block; the others %s",
                window.anchor_stride,
                f"freed {window.reach + window.margin} tokens behind"
                if window.free_behind
                else "kept (a drafter model reads the tables)",
            )

    @staticmethod
    def window_for(arch: Any, config: Any) -> Optional[WindowBlocks]:
        """A windowed model's `WindowBlocks` (DeepSeek-V4's; None for any other). Its blocks stay
        while a drafter model reads the same tables whole."""
        v4 = getattr(arch, "v4", None)
        if v4 is None:
            return None
        spec = config.speculative_config
        free = spec is None or not spec.method_type.keeps_window_blocks
        margin = spec.num_speculative_tokens if spec is not None else 0
        return WindowBlocks(v4.anchor_stride, v4.token_reach, free, margin)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of every full block of seq.token_ids, extended incrementally on the sequence."""
        hashes = seq.block_hashes
        bs = self.block_size
        for i in range(len(hashes), len(seq.token_ids) // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        return hashes

    def _lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the cached full blocks that start seq.token_ids (leaving >= 1 token). A
        request that asks for prompt logprobs computes every position: it takes no hit."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        max_blocks = (len(seq.token_ids) - 1) // bs
        hits: list[int] = []
        for i, h in enumerate(self._block_hashes(seq)[:max_blocks]):
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(
                seq.token_ids[i * bs : (i + 1) * bs]
            ):
                break
            hits.append(block_id)
        hits = hits[:-1] if self.recompute_last_hit else hits
        if self.window is not None:  # a group's first block holds entries its later ones end
            hits = hits[: len(hits) // self.window.anchor_stride * self.window.anchor_stride]
        return hits

    def num_cached_tokens(self, seq: Sequence) -> int:
        """How many leading tokens of a not-yet-allocated sequence the prefix cache already holds."""
        if seq.block_table:
            return seq.num_computed_tokens
        return len(self._lookup_prefix(seq)) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `allocate(seq, num_new_tokens)` (or, with blocks, `append_slots`) would succeed.

        For a sequence without blocks, num_new_tokens counts from after its prefix-cache hit
        (`num_cached_tokens(seq)`); hits on free cached blocks take them off the free list too.
        """
        if seq.block_table:
            return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks
        hits = self._lookup_prefix(seq)
        num_free_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        need = self.num_blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return need + num_free_hits <= self.num_free_blocks

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks `append_slots(seq, num_new_tokens)` would take (0: the table already holds them)."""
        return max(
            0,
            -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
            - len(seq.block_table),
        )

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> int:
        """First allocation of a sequence: take its prefix-cache hits, then room for this step.

        Sets seq.num_computed_tokens to the cached tokens and returns that count.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, (
            f"seq {seq.seq_id} already holds blocks"
        )
        hits = self._lookup_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_cached_tokens < 0:  # the first allocation's hits (not a preemption's)
            seq.num_cached_tokens = seq.num_computed_tokens
        self.num_prefix_hit_tokens += seq.num_computed_tokens
        self.num_prefix_query_tokens += len(seq.token_ids)
        self.append_slots(seq, num_new_tokens)
        return seq.num_computed_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq.block_table to hold num_computed_tokens + num_new_tokens tokens."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(
                f"BlockManager: seq {seq.seq_id} needs {need} blocks, {self.num_free_blocks} free "
                "(call can_append first)"
            )
        for _ in range(need):
            seq.block_table.append(self._pop_free())
        if self.window is not None and self.window.free_behind:
            self._free_behind(seq)

    def _free_behind(self, seq: Sequence) -> None:
        """Return the blocks of seq that no step reads again (but each group's first)."""
        w, bs = self.window, self.block_size
        behind = max(0, seq.num_computed_tokens - w.reach - w.margin) // bs
        for i in range(seq.num_blocks_behind, min(behind, len(seq.block_table))):
            if i % w.anchor_stride and seq.block_table[i] >= 0:
                self._release(seq.block_table[i])
                seq.block_table[i] = -1
                self.num_window_freed_blocks += 1
        seq.num_blocks_behind = max(seq.num_blocks_behind, behind)

    def _release(self, block_id: int) -> None:
        """Drop one reference; at ref count 0 the block joins the free LRU (at the very front
        when it holds nothing reusable)."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has ref count {block.ref_count}"
        if block.block_hash is not None:  # evict it from the prefix cache
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the full blocks whose tokens are all computed and known (a pending token's is
        not). A block whose hash another block already holds stays private."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // bs, len(seq.block_table))
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self._block_hashes(seq)
        for i in range(seq.num_cached_blocks, num_full):
            if seq.block_table[i] < 0:  # returned behind the window
                continue
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and hashes[i] not in self._cached:
                block.block_hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self._cached[hashes[i]] = block.block_id
        seq.num_cached_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Blocks reaching ref count 0 join the free LRU: tail blocks
        before head blocks, and blocks holding nothing reusable at the very front."""
        for block_id in reversed(seq.block_table):
            if block_id >= 0:  # -1: returned behind the window
                self._release(block_id)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_blocks_behind = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after new weights are loaded)."""
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = ()
        self._cached.clear()

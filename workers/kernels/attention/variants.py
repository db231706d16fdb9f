# The compiled variants of the host-planned attention launches, and the one-sequence batches that
# launch each of them once:
#   launch_variants  - what Triton compiles a launch planned for (sequences, rows, keys) as
#   warmup_lengths   - (rows per sequence, keys per sequence) of batches covering every variant a
#                      step of the given limits can plan
# A Triton kernel compiles once per variant (its constexprs and launch options: the lengths a step
# changes are not specialized on), the first time a launch needs it. Mid-serving that stalls a step,
# and every rank in step with it, for a second or more; start-up runs the warm-up batches instead
# (workers/runner/kernel_warmup.py). Importing this module needs no GPU.

from __future__ import annotations

from collections.abc import Callable, Hashable

from atomrt.workers.kernels.attention.decode_attention import plan_decode
from atomrt.workers.kernels.attention.paged_attention import plan_attention


def launch_variants(
    num_seqs: int,
    rows: int,
    keys: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    num_sms: int,
    fp8_cache: bool = False,
) -> frozenset[Hashable]:
    """The kernel variants an eager launch of `num_seqs` sequences of at most `rows` query rows
    over at most `keys` keys compiles: the decode kernel's for one row per sequence (over an e4m3
    cache, `fp8_cache`, its own tiles, warps, stages and V widening), otherwise the paged attention
    kernel's and, when it splits the keys, the split merge's."""
    if rows == 1:
        plan = plan_decode(num_seqs, keys, num_kv_heads, group, head_dim, num_sms, fp8_cache)
        decode = ("decode", plan.block_m, plan.tile_n, plan.num_splits > 1)
        decode += (plan.num_warps, plan.num_stages, plan.widen_v_first)
        return frozenset({decode})
    plan = plan_attention(num_seqs, rows, keys, num_kv_heads, group, head_dim, num_sms)
    paged = ("paged", plan.block_q, plan.block_m, plan.num_splits > 1)
    paged += (plan.num_warps, plan.num_stages)
    if plan.num_splits == 1:
        return frozenset({paged})
    return frozenset({paged, ("reduce",)})  # one merge variant for every split count


def _powers_of_two(low: int, high: int) -> list[int]:
    out, p = [], 1
    while p <= high:
        if p >= low:
            out.append(p)
        p *= 2
    return out


def warmup_lengths(
    num_kv_heads: int,
    group: int,
    head_dim: int,
    num_sms: int,
    max_rows: int,
    max_model_len: int,
    fp8_cache: bool = False,
) -> list[tuple[int, int]]:
    """(rows, keys) of one-sequence batches that between them launch every variant a step of at
    most `max_rows` query rows over contexts of at most `max_model_len` keys can plan: the tile
    sizes change where the rows cross a power of two, a split where the keys reach
    MIN_KEYS_PER_SPLIT twice over, and one sequence splits its keys the most. Cheapest first; each
    batch adds a variant. `fp8_cache`: the caches are e4m3, whose decode plans are their own."""
    top = min(max_rows, max_model_len)
    rows_at = sorted(
        {r for p in _powers_of_two(1, top) for r in (p, p + 1, p - 1)} & set(range(1, top + 1))
    )
    batches = [
        (rows, keys)
        for rows in rows_at
        for keys in sorted({rows, max_model_len} | set(_powers_of_two(rows, max_model_len)))
    ]
    heads = (num_kv_heads, group, head_dim, num_sms, fp8_cache)
    return _each_adding_a_variant(batches, lambda b: launch_variants(1, b[0], b[1], *heads), set())


def warmup_decode_seqs(
    num_kv_heads: int,
    group: int,
    head_dim: int,
    num_sms: int,
    max_seqs: int,
    max_model_len: int,
    fp8_cache: bool = False,
) -> list[tuple[int, int]]:
    """(sequences, keys per sequence) of decode batches (one query row a sequence) that launch
    the decode variants warmup_lengths' one-sequence batches cannot: those a plan gives only once
    (sequence, KV head) programs fill the SMs (an e4m3 cache's FP8_PLAN_D128), for batches of at
    most `max_seqs` sequences. Cheapest first; each batch adds a variant."""
    keys_at = sorted({1, max_model_len} | set(_powers_of_two(1, max_model_len)))
    variants = (
        launch_variants(1, 1, k, num_kv_heads, group, head_dim, num_sms, fp8_cache) for k in keys_at
    )
    seen: set[Hashable] = set().union(*variants)
    seqs_at = set(_powers_of_two(2, max_seqs)) | {max_seqs, -(-num_sms // num_kv_heads)}
    batches = [(s, k) for s in sorted(s for s in seqs_at if 2 <= s <= max_seqs) for k in keys_at]
    heads = (num_kv_heads, group, head_dim, num_sms, fp8_cache)
    return _each_adding_a_variant(batches, lambda b: launch_variants(b[0], 1, b[1], *heads), seen)


def _each_adding_a_variant(
    batches: list[tuple[int, int]],
    variants_of: Callable[[tuple[int, int]], frozenset[Hashable]],
    seen: set[Hashable],
) -> list[tuple[int, int]]:
    """The batches, in order, that each launch a variant none before them (nor `seen`) did."""
    chosen = []
    for batch in batches:
        new = variants_of(batch) - seen
        if new:
            seen |= new
            chosen.append(batch)
    return chosen

"""The fused FP8 decode GEMM's launches (`fp8_gemm.w8a8_skinny`): which rows take it, its default
launch, the launches swept per weight shape, where the sum over K is deferred, and the launch
variants (`SkinnyOptions`: split K, persistent programs, load hints) per shape. Pure shape
arithmetic: importing this module needs no GPU."""

from __future__ import annotations

from dataclasses import dataclass

SKINNY_M = 8  # at most this many rows take the broadcast inner product
# the fused decode path (`w8a8_skinny`): K elements per loop step, fp32 products per step
# (BLOCK_N * BLOCK_M * BLOCK_K), warps and pipeline stages per program
# (benchmarks/bench_fp8_gemm.py --sweep on one H100: K steps of 1024 beat 512 by 20-35% at
# Llama-3.1-8B's qkv, gate_up and down). Only per-row scales take it: block-scaled rows ran
# slower fused than in two launches (45 vs 33 us at 8B's qkv), the 1x128 groups' reshapes
SKINNY_BLOCK_K = 1024
SKINNY_PRODUCTS = 8192
SKINNY_WARPS = 4
SKINNY_STAGES = 3
# per-row scales: sum the products across threads once, after the K loop, not at every K step
# (fewer instructions per weight: the sm_90 SASS of 8B's qkv launch has 4.3 against 6.8, at 116
# registers against 64). SKINNY_DEFER_SUM for every shape; SKINNY_DEFER_SHAPES (N, K) where
# bench_fp8_gemm.py --m 1 on an H100 timed it faster: 8B's o 9.58 against 10.19 us, down 24.71
# against 26.66 (qkv 14.21 against 12.51 and gate_up 45.70 against 44.27 went slower)
SKINNY_DEFER_SUM = False
# (V2-Lite's q 4.30 against 4.98 us and o 3.73 against 4.29 on the sweep that set the options below)
SKINNY_DEFER_SHAPES = frozenset({(4096, 4096), (4096, 14336), (3072, 2048), (2048, 2048)})
# (block_k, products, warps, stages) per weight shape (N, K) where the sweep found a faster
# launch than the default at M=1 (bench_fp8_gemm.py --sweep on one H100, µs per call with the
# weights from HBM: benchmarks/notes-deepseek-decode-and-startup.md); other shapes take the default
SKINNY_SHAPE_LAUNCHES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (6144, 4096): (1024, 8192, 4, 1),  # Llama-3.1-8B qkv, 14.4 µs
    (28672, 4096): (1024, 8192, 2, 3),  # Llama-3.1-8B gate_up, 47.5 µs
    (4096, 14336): (1024, 16384, 4, 3),  # Llama-3.1-8B down, 28.5 µs
}


def skinny_launch(n: int, k: int) -> tuple[int, int, int, int]:
    """w8a8_skinny's (block_k, products, warps, stages) for a weight [n, k]."""
    default = (SKINNY_BLOCK_K, SKINNY_PRODUCTS, SKINNY_WARPS, SKINNY_STAGES)
    return SKINNY_SHAPE_LAUNCHES.get((n, k), default)


def skinny_defers_sum(n: int, k: int) -> bool:
    """Whether w8a8_skinny sums a weight [n, k]'s products over K once, after its K loop."""
    return SKINNY_DEFER_SUM or (n, k) in SKINNY_DEFER_SHAPES


WEIGHT_CACHE_MODIFIERS = ("", ".cg")  # tl.load's cache_modifier for weight tiles (.cs: stores only)
WEIGHT_EVICTION_POLICIES = ("", "evict_first")  # and its eviction_policy


@dataclass(frozen=True)
class SkinnyOptions:
    """w8a8_skinny's launch variants beyond (block_k, products, warps, stages), each for a decode
    GEMM that reads its weights once and must keep enough bytes in flight; the defaults are the
    plain launch. Only per-row scales (GROUP 0) take variants.

    split_k: programs per column block, each over its own K range; their float32 partials [split_k,
        M, N] are summed by a second kernel in a fixed order (the same result every run).
    persistent: programs per SM (the grid is that times the SM count, at most one per tile), each
        looping over (column block, split) tiles; 0: one program per tile.
    x_block: K elements per step of the passes over x before the weights stream (the per-token amax,
        the norm's statistics): each step waits on its loads; 0: block_k.
    preload: load the first weight step before those passes, so that its bytes are in flight
        during them (not with persistent).
    weight_cache, weight_evict: tl.load's cache_modifier and eviction_policy for weight tiles,
        which are read once per step."""

    split_k: int = 1
    persistent: int = 0
    x_block: int = 0
    preload: bool = False
    weight_cache: str = ""
    weight_evict: str = ""

    def __post_init__(self) -> None:
        if self.split_k < 1 or self.persistent < 0:
            raise ValueError(
                f"SkinnyOptions: split_k must be >= 1 and persistent >= 0, got split_k="
                f"{self.split_k}, persistent={self.persistent}"
            )
        if self.x_block and (self.x_block < 16 or self.x_block & (self.x_block - 1)):
            raise ValueError(
                f"SkinnyOptions.x_block must be 0 or a power of two >= 16, got {self.x_block}"
            )
        if self.preload and self.persistent:
            raise ValueError(
                "SkinnyOptions: preload loads one tile's first step, so it takes persistent=0"
            )
        if self.weight_cache not in WEIGHT_CACHE_MODIFIERS:
            raise ValueError(
                f"SkinnyOptions.weight_cache must be one of {WEIGHT_CACHE_MODIFIERS}, "
                f"got {self.weight_cache!r}"
            )
        if self.weight_evict not in WEIGHT_EVICTION_POLICIES:
            raise ValueError(
                f"SkinnyOptions.weight_evict must be one of "
                f"{WEIGHT_EVICTION_POLICIES}, got {self.weight_evict!r}"
            )


# the variants per weight shape (N, K) where bench_fp8_gemm.py --variants times one faster than the
# plain launch; other shapes take SkinnyOptions(). One H100 (`--variants --norm`, m=1, 51c1ee8):
# x read 4096 wide for its amax and norm, 8B qkv 13.46 against 14.92 us and gate_up 47.87 against
# 53.00 (both with the add+norm prologue), o 8.82 against 9.28 with its first weight step
# preloaded; split-K and persistent grids lost at every shape. Llama-3.1-8B FP8 bs=1 with these
# (and V2-Lite's SKINNY_DEFER_SHAPES above): 3.812 against 4.119 ms, bf16 5.743 ms in that call
SKINNY_SHAPE_OPTIONS: dict[tuple[int, int], SkinnyOptions] = {
    (6144, 4096): SkinnyOptions(x_block=4096),
    (28672, 4096): SkinnyOptions(x_block=4096),
    (4096, 4096): SkinnyOptions(x_block=4096, preload=True),
}


def skinny_options(n: int, k: int) -> SkinnyOptions:
    """w8a8_skinny's launch variants for a weight [n, k]."""
    return SKINNY_SHAPE_OPTIONS.get((n, k), SkinnyOptions())

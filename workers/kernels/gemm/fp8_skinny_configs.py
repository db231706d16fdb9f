"""The fused FP8 decode GEMM's launches (`fp8_gemm.w8a8_skinny`): which rows take it, its default
launch, the launches swept per weight shape, and where the sum over K is deferred. Pure shape
arithmetic: importing this module needs no GPU."""

from __future__ import annotations

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
SKINNY_DEFER_SHAPES = frozenset({(4096, 4096), (4096, 14336)})
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

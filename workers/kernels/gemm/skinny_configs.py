"""The skinny GEMM's launch configurations (workers/kernels/gemm/skinny_gemm.py runs them): `SkinnyConfig`,
the table of swept configs `CONFIGS` (benchmarks/sweep_gemm.py prints entries to paste here), the
default `heuristic_config`, and `pick_config`, which chooses between them. Pure shape arithmetic:
importing this module needs no GPU."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton

from atomrt.workers.kernels.device_info import H200_NUM_SMS

BROADCAST_MAX_M = 4  # default heuristic: broadcast-sum up to this M, tl.dot above it
_BROADCAST_ELEMS = 8192  # broadcast path: BLOCK_N * BLOCK_M * BLOCK_K fp32 products per K step
_DOT_W_ELEMS = 16384  # dot path: W elements per K step (32 KB of bf16 per pipeline stage)
_MAX_SMEM_BYTES = (
    160 << 10
)  # pipeline stages x (W + x tiles) must fit in shared memory (228 KB on H200)


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch of skinny_gemm_kernel: grid = cdiv(N, block_n) programs."""

    block_n: int  # output columns (W rows) per program
    block_k: int  # K elements per loop step
    use_dot: bool  # tl.dot (M padded to 16) instead of broadcast-multiply + sum
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for knob in ("block_n", "block_k", "num_warps"):
            value = getattr(self, knob)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SkinnyConfig.{knob} must be a power of two, got {value}")
        if self.use_dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(
                f"SkinnyConfig: use_dot needs block_n and block_k >= 16 (tl.dot's minimum), "
                f"got block_n={self.block_n}, block_k={self.block_k}"
            )
        if self.num_stages < 1:
            raise ValueError(f"SkinnyConfig.num_stages must be >= 1, got {self.num_stages}")


# Best measured config per (bucket_m(m), n, k) where it beats heuristic_config by more than the
# noise: benchmarks/sweep_gemm.py on an H200 (weights rotated through HBM, GPU time inside a CUDA
# graph; the figures are the sweep's, cuBLAS in brackets). Shapes missing here take the heuristic.
_B, _D = False, True  # use_dot
CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {
    (1, 3072, 576): SkinnyConfig(8, 1024, _B, 2, 2),  # SmolLM2-135M gate_up, 3.52 us (4.08)
    (1, 16384, 2048): SkinnyConfig(64, 128, _D, 4, 4),  # Llama-3.2-1B gate_up, 17.47 us (18.18)
    (1, 2048, 2048): SkinnyConfig(8, 512, _B, 4, 4),  # Llama-3.2-1B o, 4.75 us (6.01)
    (1, 2048, 8192): SkinnyConfig(8, 1024, _B, 2, 3),  # Llama-3.2-1B down, 10.43 us (12.57)
    # Llama-3.1-8B, swept with the add + RMSNorm on both sides for qkv and gate_up (their NORM
    # prologue against add_rms_norm then cuBLAS: sweep_gemm.py --norm)
    (1, 6144, 4096): SkinnyConfig(8, 256, _B, 2, 3),  # qkv, 17.28 us (17.25)
    (1, 4096, 4096): SkinnyConfig(8, 512, _B, 4, 3),  # o, 10.80 us (12.30)
    (1, 28672, 4096): SkinnyConfig(8, 1024, _B, 2, 1),  # gate_up, 58.21 us (58.44)
    (1, 4096, 14336): SkinnyConfig(8, 1024, _B, 2, 3),  # down, 29.40 us (31.03)
    # DeepSeek-V2-Lite, swept on an H100 (sweep_gemm.py --shapes DeepSeek-V2-Lite --ms 1); its o
    # projection is Llama-3.2-1B's (1, 2048, 2048) above
    (1, 3072, 2048): SkinnyConfig(8, 512, _B, 4, 3),  # q, 6.41 us (6.95)
    (1, 576, 2048): SkinnyConfig(8, 512, _B, 4, 4),  # kv_a, 3.80 us (6.09)
    (1, 5632, 2048): SkinnyConfig(8, 1024, _B, 2, 2),  # shared gate_up, 10.04 us (10.29)
    (1, 2048, 2816): SkinnyConfig(8, 1024, _B, 2, 3),  # shared down, 6.41 us (8.18)
    (1, 21888, 2048): SkinnyConfig(8, 1024, _B, 4, 2),  # dense gate_up, 31.36 us (34.68)
    (1, 2048, 10944): SkinnyConfig(8, 1024, _B, 2, 3),  # dense down, 17.64 us (19.29)
    (1, 102400, 2048): SkinnyConfig(8, 1024, _B, 8, 2),  # lm_head, 134.81 us (149.86)
}


def bucket_m(m: int) -> int:
    """The CONFIGS key for M: its next power of two."""
    return triton.next_power_of_2(max(1, m))


def block_m_for(m: int, use_dot: bool) -> int:
    """Register rows the kernel keeps for M rows of x: M's next power of two, at least 16 for tl.dot."""
    return max(16 if use_dot else 1, triton.next_power_of_2(max(1, m)))


def pick_config(m: int, n: int, k: int, *, num_sms: int = H200_NUM_SMS) -> SkinnyConfig:
    """The launch for an [m, k] x [n, k]^T product: the swept table's entry if it has one, else the
    heuristic. Depends only on shapes (and the GPU's SM count), so a CUDA graph can replay it."""
    return CONFIGS.get((bucket_m(m), n, k)) or heuristic_config(m, n, k, num_sms)


@functools.lru_cache(maxsize=4096)
def heuristic_config(m: int, n: int, k: int, num_sms: int = H200_NUM_SMS) -> SkinnyConfig:
    """Default launch.

    Broadcast path (M <= BROADCAST_MAX_M): 8 weight rows per program and K in steps of 512, or in
    one step when K <= 1024 (one memory round trip for the small models' weights). The H200 sweep
    found this within ~2% of the best config on every model shape at M=1 (and wider column tiles
    up to 15% slower on the 8B gate_up).
    Dot path: the widest column tile that still gives every SM two programs, then the widest K tile
    that keeps one step's shared memory in budget."""
    use_dot = m > BROADCAST_MAX_M
    block_m = block_m_for(m, use_dot)
    if not use_dot:
        block_n = 8
        max_k = 1024 if k <= 1024 else 512
        block_k = max(
            32,
            min(max_k, _BROADCAST_ELEMS // (block_n * block_m), triton.next_power_of_2(max(1, k))),
        )
        num_stages = 2 if triton.cdiv(k, block_k) <= 2 else 3
        return SkinnyConfig(block_n, block_k, False, 4, num_stages)
    block_n = 16
    while block_n < 64 and triton.cdiv(n, 2 * block_n) >= 2 * num_sms:
        block_n *= 2
    block_k = max(32, min(512, _DOT_W_ELEMS // block_n, triton.next_power_of_2(max(1, k))))
    while block_k > 32 and 2 * _stage_bytes(block_n, block_m, block_k) > _MAX_SMEM_BYTES:
        block_k //= 2  # a wide x tile (large M) must leave room for two stages
    step_values = (block_n + block_m) * block_k  # W and x tiles, through shared memory
    num_warps = 2 if step_values <= 2048 else 4 if step_values <= 16384 else 8
    num_stages = 2 if triton.cdiv(k, block_k) <= 2 else 3
    if num_stages * _stage_bytes(block_n, block_m, block_k) > _MAX_SMEM_BYTES:
        num_stages = 2
    return SkinnyConfig(block_n, block_k, True, num_warps, num_stages)


def _stage_bytes(block_n: int, block_m: int, block_k: int) -> int:
    """Shared memory of one pipeline stage: a W tile and an x tile of 2-byte elements."""
    return (block_n + block_m) * block_k * 2

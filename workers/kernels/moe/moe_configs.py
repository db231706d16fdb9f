"""Launch configurations of the fused expert GEMMs (workers/kernels/moe/fused_moe.py runs them).

`MoEConfig` is one launch; `CONFIGS` is the table a sweep on the GPU fills
(benchmarks/sweep_moe.py prints the entries to paste here), keyed by the GEMM (`"gate_up"`: hidden
-> silu(gate) * up, or `"down"`), the number of experts, the GEMM's output width N and its reduction
width K (this rank's shard), then by the token count's bucket (`bucket_tokens`). A shape the table
lacks takes `heuristic_config`. Pure shape arithmetic: importing this module needs no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

GEMMS = ("gate_up", "down")


@dataclass(frozen=True)
class MoEConfig:
    """One launch of fused_moe_kernel: grid = blocks of `block_m` pairs x cdiv(N, block_n)."""

    block_m: int  # (token, expert) pairs per program; each expert's run is padded to it
    block_n: int  # output columns per program
    block_k: int  # reduction elements per loop step
    group_m: int  # programs along M that share a column block (L2 reuse of the expert weights)
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for knob in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, knob)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MoEConfig.{knob} must be a power of two, got {value}")
        if min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError(f"MoEConfig: tl.dot needs blocks of at least 16, got {self}")
        if self.group_m < 1 or self.num_stages < 1:
            raise ValueError(f"MoEConfig: group_m and num_stages must be >= 1, got {self}")


# (gemm, num_experts, N, K) -> {token bucket: config}. Filled from benchmarks/sweep_moe.py runs on
# the GPU machine (their figures: `--record`, docs/perf.md); a shape missing here takes
# heuristic_config.
CONFIGS: dict[tuple[str, int, int, int], dict[int, MoEConfig]] = {
    # DeepSeek-V2-Lite (64 experts, top-6, hidden 2048, intermediate 1408), swept on an H100
    # (sweep_moe.py --shapes DeepSeek-V2-Lite --tokens 1,32 --quick): at 1 token both GEMMs
    # 34.6 us against the heuristic's 38.3 (floor 34.4); at 32 the heuristic was as fast. In the
    # model's bs=1 step (bench latency, level 3, same warm H100): 3.003 against 3.020 ms
    ("down", 64, 2048, 1408): {
        1: MoEConfig(16, 32, 128, 8, 4, 3),
    },
    ("gate_up", 64, 1408, 2048): {
        1: MoEConfig(16, 64, 128, 8, 4, 3),
    },
}


def bucket_tokens(num_tokens: int) -> int:
    """The table's key for a token count: its next power of two."""
    n = max(1, int(num_tokens))
    return 1 << (n - 1).bit_length()


def heuristic_config(
    gemm: str, num_tokens: int, num_experts: int, top_k: int, n: int, k: int
) -> MoEConfig:
    """A launch from the shape alone: blocks of rows sized to the expected pairs per expert (decode
    batches leave most experts a few rows, so small blocks waste less of each padded run), wide
    reduction steps when rows are few (the GEMM then streams weights)."""
    assert gemm in GEMMS, gemm
    per_expert = num_tokens * top_k / max(1, num_experts)
    if per_expert <= 16:
        block_m, block_k, stages = 16, 128 if k >= 128 else 64, 4
    elif per_expert <= 64:
        block_m, block_k, stages = 32, 64, 4
    else:
        block_m, block_k, stages = 64, 64, 3
    block_n = 64 if n >= 64 else 32
    warps = 4 if block_m * block_n <= 64 * 64 else 8
    return MoEConfig(block_m, block_n, block_k, group_m=8, num_warps=warps, num_stages=stages)


def pick_config(
    gemm: str, num_tokens: int, num_experts: int, top_k: int, n: int, k: int
) -> MoEConfig:
    """The table's config for the shape at the nearest swept token bucket at or above
    `num_tokens`'s, or the heuristic when the shape was never swept or `num_tokens` is past its
    largest entry (the sweep leaves out the token counts where the heuristic won, so an entry
    says nothing of larger counts: a decode-only table must not size a prefill's launch).
    Depends only on shapes, so a CUDA graph can replay the launch."""
    table = CONFIGS.get((gemm, num_experts, n, k))
    bucket = bucket_tokens(num_tokens)
    at_or_above = [b for b in table or () if b >= bucket]
    if not at_or_above:
        return heuristic_config(gemm, num_tokens, num_experts, top_k, n, k)
    return table[min(at_or_above)]

"""The paged KV cache: one (k_cache, v_cache) pair per attention layer, and its sizing.

Layout (docs/architecture.md): [num_blocks, block_size, num_kv_heads, head_dim] per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCacheTensor:
    layer_idx: int
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]


@dataclass(frozen=True)
class KVLayerSpec:
    layer_idx: int
    num_kv_heads: int  # on this rank
    head_dim: int


def kv_bytes_per_block(specs: list[KVLayerSpec], block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * s.num_kv_heads * s.head_dim * elem for s in specs)


def allocate_kv_cache(
    specs: list[KVLayerSpec],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, KVCacheTensor]:
    """Allocate every layer's cache, keyed "layers.<i>" as the attention op looks it up (on CUDA with
    the decode kernel's split counters, which must exist before any CUDA-graph capture)."""
    if torch.device(device).type == "cuda":
        from atomrt.workers.kernels.attention.decode_attention import prepare_decode_counters

        prepare_decode_counters(device)
    caches: dict[str, KVCacheTensor] = {}
    for s in specs:
        shape = (num_blocks, block_size, s.num_kv_heads, s.head_dim)
        caches[f"layers.{s.layer_idx}"] = KVCacheTensor(
            s.layer_idx,
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
    return caches


@dataclass(frozen=True)
class KVCacheSizing:
    """What sizing found (a run-time result, not config)."""

    num_blocks: int
    bytes_per_block: int
    peak_activation_bytes: int  # the profile run's peak, the KV budget leaves room for it
    graph_pool_estimate_bytes: int  # the largest capture bucket's forward, measured eagerly


def num_blocks_needed(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """More blocks than this can never be in use at once (+1 for the dummy block capture reads)."""
    return max_num_seqs * -(-max_model_len // block_size) + 1

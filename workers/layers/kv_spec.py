"""What a paged attention layer keeps per token in the KV cache: its spec, which the layer states
(`kv_cache_spec()`, one method on every paged layer) and which lays out and allocates its entry
(workers/runner/kv_cache.py sizes and allocates the cache from the specs alone).

- `KVLayerSpec` (kind "attention"): a (k_cache, v_cache) pair, each [num_blocks, block_size,
  num_kv_heads, head_dim].
- `MLALayerSpec` (kind "mla", multi-head latent attention): one `kv_cache` [num_blocks,
  block_size, kv_lora_rank + qk_rope_head_dim], a row per token: the normalised latent, then the
  rotated key part. It is the same on every TP rank (one latent head, which TP does not split).
Other kinds state their own spec beside their layer (DeepSeek V3.2's `DSALayerSpec`, V4's
`V4LayerSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCacheTensor:
    layer_idx: int
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]


@dataclass
class MLAKVCacheTensor:
    layer_idx: int
    kv_cache: torch.Tensor  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]


@dataclass(frozen=True)
class KVLayerSpec:
    """An attention layer's cache: keys and values per KV head."""

    layer_idx: int
    num_kv_heads: int  # on this rank
    head_dim: int
    kind = "attention"

    def elements_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> KVCacheTensor:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return KVCacheTensor(
            self.layer_idx,
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )


@dataclass(frozen=True)
class MLALayerSpec:
    """A latent-attention layer's cache: one latent row per token, replicated over TP ranks."""

    layer_idx: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    kind = "mla"

    def elements_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> MLAKVCacheTensor:
        shape = (num_blocks, block_size, self.elements_per_token())
        return MLAKVCacheTensor(self.layer_idx, torch.zeros(shape, dtype=dtype, device=device))

"""The paged KV cache: one entry per attention layer, shaped by the layer's kind, and its sizing.

Layouts (docs/architecture.md), every kind indexed by the same block tables and slots:
- attention: a (k_cache, v_cache) pair, each [num_blocks, block_size, num_kv_heads, head_dim];
- mla (multi-head latent attention): one `kv_cache` [num_blocks, block_size, kv_lora_rank +
  qk_rope_head_dim], a row per token: the normalised latent, then the rotated key part. It is the
  same on every TP rank (one latent head, which TP does not split).
A model may mix kinds: each layer has its own spec, and a block's bytes are the sum of its layers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import nn

from atomrt.workers.layers.attention import Attention
from atomrt.workers.layers.mla import MLAAttention

if TYPE_CHECKING:
    from atomrt.workers.runner.kv_scales import KVScales


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


@dataclass(frozen=True)
class MLALayerSpec:
    """A latent-attention layer's cache: one latent row per token, replicated over TP ranks."""

    layer_idx: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    kind = "mla"

    def elements_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


LayerSpec = Union[KVLayerSpec, MLALayerSpec]
CacheEntry = Union[KVCacheTensor, MLAKVCacheTensor]


@dataclass(frozen=True)
class KVKindSize:
    """What one kind of layer costs per token, over all the model's layers of that kind."""

    kind: str  # "attention" | "mla"
    num_layers: int
    bytes_per_token: int  # on this rank


def kv_layer_specs(layers: dict[int, nn.Module]) -> list[LayerSpec]:
    """The cache spec of each paged layer (`collect_attention_layers`), in layer order."""
    specs: list[LayerSpec] = []
    for i, layer in sorted(layers.items()):
        if hasattr(layer, "kv_cache_spec"):  # a layer with its own rows (DeepSeek-V4, V3.2)
            specs.append(layer.kv_cache_spec())
        elif isinstance(layer, MLAAttention):
            specs.append(MLALayerSpec(i, layer.kv_lora_rank, layer.qk_rope_head_dim))
        elif isinstance(layer, Attention):
            specs.append(KVLayerSpec(i, layer.num_kv_heads, layer.head_dim))
        else:
            raise TypeError(f"layer {i}: {type(layer).__name__} has no KV cache layout")
    return specs


FP8_KV_DTYPES = ("fp8", "fp8_e4m3")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype: `cache_config.kv_cache_dtype` "auto" is the model's, "fp8" /
    "fp8_e4m3" e4m3 (written saturated, read back widened: a per-tensor scale of 1.0)."""
    return torch.float8_e4m3fn if kv_cache_dtype in FP8_KV_DTYPES else model_dtype


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_sizes_by_kind(specs: list[LayerSpec], dtype: torch.dtype) -> tuple[KVKindSize, ...]:
    """Bytes per token of every layer kind present, in the order the kinds first appear."""
    sizes: dict[str, list[int]] = {}
    for s in specs:
        layers_bytes = sizes.setdefault(s.kind, [0, 0])
        layers_bytes[0] += 1
        layers_bytes[1] += s.elements_per_token() * _element_size(dtype)
    return tuple(KVKindSize(kind, n, b) for kind, (n, b) in sizes.items())


def kv_bytes_per_block(specs: list[LayerSpec], block_size: int, dtype: torch.dtype) -> int:
    return block_size * sum(s.elements_per_token() for s in specs) * _element_size(dtype)


def allocate_kv_cache(
    specs: list[LayerSpec],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, CacheEntry]:
    """Allocate every layer's cache, keyed "layers.<i>" as the attention ops look it up (on CUDA with
    the decode kernel's split counters, which must exist before any CUDA-graph capture)."""
    if torch.device(device).type == "cuda":
        from atomrt.workers.kernels.attention.decode_attention import prepare_decode_counters

        prepare_decode_counters(device)
    caches: dict[str, CacheEntry] = {}
    for s in specs:
        if hasattr(s, "allocate"):
            caches[f"layers.{s.layer_idx}"] = s.allocate(num_blocks, block_size, dtype, device)
            continue
        if isinstance(s, MLALayerSpec):
            shape = (num_blocks, block_size, s.elements_per_token())
            entry: CacheEntry = MLAKVCacheTensor(
                s.layer_idx, torch.zeros(shape, dtype=dtype, device=device)
            )
        else:
            shape = (num_blocks, block_size, s.num_kv_heads, s.head_dim)
            entry = KVCacheTensor(
                s.layer_idx,
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
        caches[f"layers.{s.layer_idx}"] = entry
    return caches


@dataclass(frozen=True)
class KVCacheSizing:
    """What sizing found (a run-time result, not config)."""

    num_blocks: int
    bytes_per_block: int
    peak_activation_bytes: int  # the profile run's peak, the KV budget leaves room for it
    graph_pool_estimate_bytes: int  # the largest capture bucket's forward, measured eagerly
    by_kind: tuple[KVKindSize, ...] = ()  # the target model's bytes per token, per layer kind
    kv_scales: Optional[KVScales] = None  # an FP8 cache's per-layer scales (runner/kv_scales.py)


def num_blocks_needed(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """More blocks than this can never be in use at once (+1 for the dummy block capture reads)."""
    return max_num_seqs * -(-max_model_len // block_size) + 1

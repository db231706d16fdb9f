"""The paged KV cache: one entry per paged attention layer, laid out by the spec the layer states
(`kv_cache_spec()`: workers/layers/kv_spec.py, and the kinds that state their own), and its
sizing. Every kind is indexed by the same block tables and slots. A model may mix kinds: each
layer has its own spec, and a block's bytes are the sum of its layers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import nn

from atomrt.workers.layers.kv_spec import (
    KVCacheTensor,
    KVLayerSpec,
    MLAKVCacheTensor,
    MLALayerSpec,
)

if TYPE_CHECKING:
    from atomrt.workers.runner.kv_scales import KVScales


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
        if not hasattr(layer, "kv_cache_spec"):
            raise TypeError(f"layer {i}: {type(layer).__name__} states no kv_cache_spec()")
        specs.append(layer.kv_cache_spec())
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
        caches[f"layers.{s.layer_idx}"] = s.allocate(num_blocks, block_size, dtype, device)
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

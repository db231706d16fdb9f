"""Every paged attention layer states its own KV cache spec (`kv_cache_spec()`), and the spec
lays out and allocates its cache entry: the runner's cache asks the layers, never their types."""

import pytest
import torch
from torch import nn

from atomrt.workers.layers.attention import Attention, PagedAttentionLayer
from atomrt.workers.layers.kv_spec import KVLayerSpec, MLALayerSpec
from atomrt.workers.runner.kv_cache import allocate_kv_cache, kv_bytes_per_block, kv_layer_specs


def test_a_layer_states_its_spec_and_the_spec_allocates_its_entry() -> None:
    layers = {3: Attention(3, num_heads=4, num_kv_heads=2, head_dim=8, scale=0.1)}
    specs = kv_layer_specs(layers)
    assert specs == [KVLayerSpec(3, 2, 8)]
    specs.append(MLALayerSpec(5, kv_lora_rank=16, qk_rope_head_dim=4))
    caches = allocate_kv_cache(specs, 6, 4, torch.float16, torch.device("cpu"))
    assert caches["layers.3"].k_cache.shape == caches["layers.3"].v_cache.shape == (6, 4, 2, 8)
    assert caches["layers.5"].kv_cache.shape == (6, 4, 20)
    assert kv_bytes_per_block(specs, 4, torch.float16) == 4 * (2 * 2 * 8 + 20) * 2


def test_a_layer_without_a_spec_is_named() -> None:
    class Bare(PagedAttentionLayer):
        layer_idx = 1

    with pytest.raises(NotImplementedError, match="Bare states no kv_cache_spec"):
        kv_layer_specs({1: Bare()})
    with pytest.raises(TypeError, match="layer 2: Linear states no kv_cache_spec"):
        kv_layer_specs({2: nn.Linear(2, 2)})

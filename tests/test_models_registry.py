"""One registry entry per architecture (workers/models/registry.py): its flags are what the models
built from it are made of, checked on every preset (the model built on the meta device, its
layers' KV cache kinds read from their `kv_cache_spec()`)."""

import pytest
import torch

from atomrt.workers.layers.attention import collect_attention_layers
from atomrt.workers.loading.loader import build_model
from atomrt.workers.loading.presets import PRESETS, preset_config
from atomrt.workers.models.registry import ARCHITECTURES, MODEL_REGISTRY, arch_from_hf_config
from atomrt.workers.runner.kv_cache import kv_layer_specs


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_an_entry_flags_what_its_presets_are_made_of(preset: str) -> None:
    arch = arch_from_hf_config(preset_config(preset), preset)
    entry = ARCHITECTURES[arch.architecture]
    assert (entry.moe, entry.mla) == (arch.is_moe, arch.is_mla)
    assert arch.qk_norm == entry.qk_norm and (arch.qkv_bias or not entry.qkv_bias)
    model = build_model(arch, "meta", torch.bfloat16)
    assert type(model) is entry.model is MODEL_REGISTRY[arch.architecture]
    # a family with MTP layers names the module its MTP drafter builds; the model holds none
    assert entry.mtp == hasattr(type(model), "mtp_layers") and not hasattr(model, "mtp")
    kinds = {s.kind for s in kv_layer_specs(collect_attention_layers(model))}
    assert kinds and kinds <= set(entry.kv_kinds)


def test_an_unknown_architecture_is_named_with_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="here: unsupported architecture 'GPT2LMHeadModel'; "):
        arch_from_hf_config({"architectures": ["GPT2LMHeadModel"]}, "here")

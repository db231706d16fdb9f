"""A checkpoint fills every parameter of the model, each shard of a fused one once: a tensor given
twice does not stand in for a missing one (CausalLM.load_weights)."""

import pytest
import torch

from atomrt.workers.loading.loader import build_model
from atomrt.workers.models.registry import arch_from_hf_config

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def _checkpoint() -> dict[str, torch.Tensor]:
    """Hugging Face's names and shapes for the tiny Llama."""
    a = "model.layers.0.self_attn."
    m = "model.layers.0.mlp."
    out = {
        "model.embed_tokens.weight": torch.randn(64, 16),
        "model.norm.weight": torch.ones(16),
        "lm_head.weight": torch.randn(64, 16),
        "model.layers.0.input_layernorm.weight": torch.ones(16),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(16),
        a + "q_proj.weight": torch.randn(16, 16),
        a + "k_proj.weight": torch.randn(8, 16),
        a + "v_proj.weight": torch.randn(8, 16),
        a + "o_proj.weight": torch.randn(16, 16),
        m + "gate_proj.weight": torch.randn(32, 16),
        m + "up_proj.weight": torch.randn(32, 16),
        m + "down_proj.weight": torch.randn(16, 32),
    }
    return out


def test_every_shard_of_a_fused_parameter_is_needed_once() -> None:
    arch = arch_from_hf_config(TINY, "tiny")
    model = build_model(arch, "cpu", torch.float32)
    weights = _checkpoint()
    model.load_weights(weights.items())
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(model.model.layers[0].self_attn.qkv_proj.weight[:16], q)
    broken = dict(weights)
    del broken["model.layers.0.self_attn.k_proj.weight"]
    items = [*broken.items(), ("model.layers.0.self_attn.q_proj.weight", q)]  # q twice, no k
    with pytest.raises(ValueError, match="missing tensors for 1 parameters.*qkv_proj"):
        model.load_weights(items)

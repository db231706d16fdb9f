"""DeepSeek-family config.json fields (ModelArch), the presets, and the rotary embedding those
models use (interleaved pairs, YaRN) against transformers' own on the same config."""

from __future__ import annotations

import pytest
import torch

from atomrt.workers.layers.rotary import RotaryEmbedding, yarn_softmax_scale
from atomrt.workers.loading.presets import preset_config
from atomrt.workers.models.registry import arch_from_hf_config

YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}


def _tiny(**overrides) -> dict:
    cfg = {
        **preset_config("tiny-deepseek-v3"),
        "architectures": ["DeepseekV3ForCausalLM"],
    }
    cfg.update(overrides)
    return cfg


def test_presets_read_as_published() -> None:
    lite = arch_from_hf_config(preset_config("DeepSeek-V2-Lite"), "lite")
    assert lite.is_mla and lite.is_moe and lite.q_lora_rank is None
    assert (lite.kv_lora_rank, lite.qk_rope_head_dim, lite.head_dim) == (512, 64, 192)
    assert lite.mlp_only_layers == (0,) and lite.n_shared_experts == 2
    assert (lite.topk_method, lite.scoring_func, lite.rope_interleave) == (
        "greedy",
        "softmax",
        True,
    )
    assert lite.rope_scaling["rope_type"] == "yarn"
    v3 = arch_from_hf_config(preset_config("DeepSeek-V3"), "v3")
    assert (v3.topk_method, v3.scoring_func, v3.n_group, v3.topk_group) == (
        "noaux_tc",
        "sigmoid",
        8,
        4,
    )
    assert v3.mlp_only_layers == (0, 1, 2) and v3.num_nextn_predict_layers == 1
    glm = arch_from_hf_config(preset_config("GLM-4.7-Flash"), "glm")
    # the published config names no scoring_func: the class's sigmoid
    assert (glm.topk_method, glm.scoring_func, glm.routed_scaling_factor) == (
        "noaux_tc",
        "sigmoid",
        1.8,
    )
    assert (glm.v_head_dim, glm.head_dim, glm.q_lora_rank) == (256, 256, 768)
    assert glm.eos_token_ids == (154820, 154827, 154829)


def test_dense_layers_follow_first_k_dense_replace_moe_layer_freq_or_mlp_layer_types() -> None:
    arch = arch_from_hf_config(_tiny(first_k_dense_replace=2, moe_layer_freq=2), "t")
    assert arch.mlp_only_layers == (0, 1, 3)  # sparse: layer >= 2 and layer % 2 == 0
    assert [arch.is_moe_layer(i) for i in range(4)] == [False, False, True, False]
    types = ["sparse", "dense", "sparse", "sparse"]
    arch = arch_from_hf_config(_tiny(mlp_layer_types=types), "t")
    assert arch.mlp_only_layers == (1,)
    # transformers' V2 class never groups greedy routing: neither does the arch
    arch = arch_from_hf_config(_tiny(topk_method="greedy", n_group=4, topk_group=2), "t")
    assert (arch.n_group, arch.topk_group) == (1, 1)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(topk_method="top1"), "topk_method 'top1'"),
        (dict(scoring_func="relu"), "scoring_func 'relu'"),
        (dict(n_group=3), "n_group=3 must divide n_routed_experts=8"),
        (dict(topk_group=3), "topk_group=3"),
        (dict(n_group=8, topk_group=2), "noaux_tc scores a group by its two best experts"),
        (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 must be in 1\.\.4"),
        (dict(qk_rope_head_dim=15), "qk_rope_head_dim positive and even"),
        (dict(mlp_layer_types=["dense"]), "mlp_layer_types"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (
            dict(quantization_config={"quant_method": "gptq"}),
            "quant_method .gptq. is not supported",
        ),
    ],
)
def test_bad_fields_are_named(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        arch_from_hf_config(_tiny(**overrides), "folder")


def test_tensor_parallel_size_must_split_whole_heads() -> None:
    """4 heads of 24 + 24 values: widths that 3 ranks divide, heads they do not."""
    from atomrt.workers.loading.loader import check_parallel_layout

    arch = arch_from_hf_config(_tiny(qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24), "t")
    with pytest.raises(ValueError, match="num_attention_heads: 4 is not divisible by.* 3"):
        check_parallel_layout(arch, tensor_parallel_size=3)
    check_parallel_layout(arch, tensor_parallel_size=2)


def test_missing_mla_field_is_named() -> None:
    cfg = _tiny()
    del cfg["kv_lora_rank"]
    with pytest.raises(ValueError, match="lacks the field 'kv_lora_rank'"):
        arch_from_hf_config(cfg, "folder")


@pytest.mark.parametrize("scaling", [None, YARN], ids=["default", "yarn"])
def test_rotary_matches_transformers_deepseek(scaling) -> None:
    """cos / sin (YaRN's attention factor folded in) equal transformers' DeepSeek-V3 rotary, and
    the interleaved rotation of q and k equals its `apply_rotary_pos_emb_interleave` and V2's
    complex-number form; the softmax scale factor equals `yarn_apply_mscale`'s."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import yarn_apply_mscale
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    rope_parameters = {"rope_theta": 10000.0, **(scaling or {"rope_type": "default"})}
    if scaling:
        rope_parameters["rope_type"] = rope_parameters.pop("type")
    cfg = DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=2560,
        rope_parameters=rope_parameters,
    )
    hf = v3.DeepseekV3RotaryEmbedding(cfg)
    positions = torch.randint(0, 2560, (9,))
    cos, sin = hf(torch.zeros(1), positions[None])
    ours = RotaryEmbedding(16, 2560, 10000.0, scaling, interleaved=True)
    assert torch.equal(ours.cos_cache[positions], cos[0, :, :8])
    assert torch.equal(ours.sin_cache[positions], sin[0, :, :8])
    q, k = torch.randn(9, 3, 16), torch.randn(9, 1, 16)
    got_q, got_k = ours(positions, q, k)
    want_q, want_k = v3.apply_rotary_pos_emb_interleave(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=0, atol=1e-6)
    # V2's complex form keeps the pairs interleaved: the same rotation, another order of dims
    freqs = torch.polar(torch.ones_like(cos[..., :8]), torch.atan2(sin[..., :8], cos[..., :8]))
    freqs = freqs * cos[..., :8].hypot(sin[..., :8])
    v2_q, _ = apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs)
    deinterleaved = torch.cat([v2_q[..., 0::2], v2_q[..., 1::2]], dim=-1)[0].transpose(0, 1)
    torch.testing.assert_close(got_q, deinterleaved, rtol=0, atol=1e-5)
    assert yarn_softmax_scale(scaling) == pytest.approx(yarn_apply_mscale(rope_parameters, 1.0))

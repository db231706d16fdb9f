"""Tiny DeepSeek-family checkpoints made by transformers, for the MLA / DeepSeekMoE model tests.

Four configurations: DeepSeek-V2 with greedy routing and without a query LoRA (V2-Lite's layout),
DeepSeek-V2 with group-limited greedy routing and YaRN, DeepSeek-V3 (noaux_tc over 4 groups, a
non-zero correction bias, the first layer dense), and GLM-4.7-Flash's Glm4MoeLite (noaux_tc in one
group). Weights are random but larger than the init's, so that routing and every layer matter.
"""

from __future__ import annotations

from pathlib import Path

import torch
from moe_harness import make_hf_model

_MLA = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
NAMES = ("v2_greedy", "v2_grouped", "v3", "glm")


def tiny_deepseek_configs() -> dict[str, object]:
    from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeLiteConfig

    return {
        "v2_greedy": DeepseekV2Config(
            **_MLA,
            q_lora_rank=None,
            n_routed_experts=8,
            n_shared_experts=2,
            num_experts_per_tok=2,
            topk_method="greedy",
            first_k_dense_replace=1,
            routed_scaling_factor=1.0,
        ),
        "v2_grouped": DeepseekV2Config(
            **_MLA,
            q_lora_rank=48,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            rope_parameters=YARN,
        ),
        "v3": DeepseekV3Config(
            **_MLA,
            q_lora_rank=48,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
        "glm": Glm4MoeLiteConfig(
            **_MLA,
            q_lora_rank=48,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.8,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    }


def make_hf_deepseek(cfg: object, seed: int = 0) -> torch.nn.Module:
    """moe_harness's random weights, routers spread wider (so tokens disagree on experts), and
    under noaux_tc a correction bias large enough to change which experts and groups win
    (transformers' init leaves it zero)."""
    model = make_hf_model(cfg, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model


def build_deepseek_folder(folder: Path, name: str = "v3", seed: int = 0) -> Path:
    """Save tiny config `name` with random weights as safetensors in `folder`."""
    make_hf_deepseek(tiny_deepseek_configs()[name], seed).save_pretrained(
        folder, safe_serialization=True
    )
    return folder


def v3_moe_block(hidden: int, experts: int, top_k: int, inter: int = 24, seed: int = 2):
    """(our DeepseekMoE block, transformers' DeepseekV3MoE) of one DeepSeek-V3 MoE layer (noaux_tc
    over 4 groups, one shared expert, a non-zero correction bias) holding the same random weights."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from atomrt.distributed.communication_op import DPInfo, TPInfo
    from atomrt.workers.models.deepseek import DeepseekMoE
    from atomrt.workers.models.registry import arch_from_hf_config

    cfg = DeepseekV3Config(
        hidden_size=hidden,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=inter,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    torch.manual_seed(seed)
    hf = DeepseekV3MoE(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
        hf.gate.e_score_correction_bias.uniform_(-0.2, 0.2)
    arch = arch_from_hf_config({**cfg.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}, "t")
    block = DeepseekMoE(arch, TPInfo(), DPInfo())
    ours, shared = block.experts, block.shared_experts
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        ours.w13_weight.copy_(hf.experts.gate_up_proj)
        ours.w2_weight.copy_(hf.experts.down_proj)
        gate_up = (hf.shared_experts.gate_proj.weight, hf.shared_experts.up_proj.weight)
        shared.gate_up_proj.weight.copy_(torch.cat(gate_up))
        shared.down_proj.weight.copy_(hf.shared_experts.down_proj.weight)
    return block, hf

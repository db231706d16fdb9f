"""Model shapes without files: HF-config-style dicts of public models for `load_format="dummy"`.

Numbers are the published config.json values. A preset gives the architecture only; weights are
random (benchmarks, memory sizing), and tokenizers must come from elsewhere.
"""

from __future__ import annotations

from typing import Any, Optional

_SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "bfloat16",
}

_LLAMA3_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "num_attention_heads": 32,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

_QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

# OLMoE-1B-7B's shapes (64 experts, top-8, no top-k renormalization) in the Qwen3-MoE layout (OLMoE
# itself normalizes q and k over all heads at once; the dummy weights do not care).
_OLMOE_1B_7B_LIKE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 50304,
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": False,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "eos_token_id": 50279,
    "torch_dtype": "bfloat16",
}

# The tiny presets' scale: small enough for CPU tests and `atomrt bench dp` on CPU.
_TINY_SCALE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
}

# Small enough for CPU tests and `atomrt bench dp` on CPU: the Qwen3-MoE layout, 8 experts, top-2.
_TINY_QWEN3_MOE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    **_TINY_SCALE,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 2048,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "eos_token_id": 1,
    "torch_dtype": "float32",
}

# DeepSeek-V2-Lite (16B, 2.4B active): multi-head latent attention without a query LoRA, YaRN,
# 64 routed experts (greedy softmax routing) and 2 shared ones, the first layer dense.
_DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}

# DeepSeek-V3 (671B, 37B active; its shapes, for sizing arithmetic): a query LoRA, 256 routed
# experts in 8 groups (noaux_tc: sigmoid scores, a correction bias), the first 3 layers dense, one
# multi-token-prediction layer stored after the 61 decoder layers.
_DEEPSEEK_V3: dict[str, Any] = {
    **_DEEPSEEK_V2_LITE,
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1,
    "rope_scaling": {**_DEEPSEEK_V2_LITE["rope_scaling"], "mscale": 1.0, "mscale_all_dim": 1.0},
    "bos_token_id": 0,
    "eos_token_id": 1,
}

# DeepSeek-V3.2(-Exp): DeepSeek-V3's shape with the lightning indexer of its sparse attention
# (64 heads of 128, each query attending its top 2048 tokens).
_DEEPSEEK_V32: dict[str, Any] = {
    **_DEEPSEEK_V3,
    "architectures": ["DeepseekV32ForCausalLM"],
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}

# GLM-5: DeepSeek-V3.2's sparse attention (a 32-head indexer, its rotary interleaved) over MLA
# with 64 heads of 192 + 64, 256 routed experts in one group, top 8: transformers' GlmMoeDsaConfig
# defaults (its docstring's zai-org/GLM-5), every layer's indexer its own.
_GLM_5: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "max_position_embeddings": 202752,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}

# GLM-4.7-Flash (about 30B, 3B active): DeepSeek-V3's attention and routing at a smaller shape,
# 64 routed experts in one group, no rope scaling, one MTP layer after the 47 decoder layers.
_GLM_4_7_FLASH: dict[str, Any] = {
    "architectures": ["Glm4MoeLiteForCausalLM"],
    "vocab_size": 154880,
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 1.0,
    "max_position_embeddings": 202752,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "pad_token_id": 154820,
    "eos_token_id": [154820, 154827, 154829],
    "torch_dtype": "bfloat16",
}

# Small enough for CPU tests and `atomrt bench dp` on CPU: DeepSeek-V3's layout, 8 experts in 2
# groups (the best group chosen per token), top-2, one MTP layer (dummy weights include it when
# speculation is MTP).
_TINY_DEEPSEEK_V3: dict[str, Any] = {
    **_DEEPSEEK_V3,
    **_TINY_SCALE,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "max_position_embeddings": 2048,
    "rope_scaling": None,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "float32",
}

# DeepSeek-V4-Flash(-Base)'s shape as transformers' DeepseekV4Config defaults describe it: 43 layers
# (two HCA, then CSA / HCA in turn), the first three hash-routed, 256 experts top-6, hc_mult 4;
# YaRN (factor 16) on the compressed layers' rotary. `--hf-overrides '{"num_hidden_layers": N}'`
# keeps the first N layers.
_V4_FLASH_LAYERS = 43
_DEEPSEEK_V4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": _V4_FLASH_LAYERS,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "partial_rotary_factor": 64 / 512,
    "num_experts_per_tok": 6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0},
        "compress": {
            "rope_type": "yarn",
            "rope_theta": 160000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
            "attention_factor": 1.0,
        },
    },
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "layer_types": ["heavily_compressed_attention"] * 2
    + [
        "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
        for i in range(_V4_FLASH_LAYERS - 2)
    ],
    "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * (_V4_FLASH_LAYERS - 3),
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}

_TINY_DEEPSEEK_V4: dict[str, Any] = {
    **_DEEPSEEK_V4_FLASH,
    "vocab_size": 512,
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 64,
    "q_lora_rank": 64,
    "partial_rotary_factor": 16 / 64,
    "num_experts_per_tok": 2,
    "n_routed_experts": 8,
    "max_position_embeddings": 4096,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0},
        "compress": {"rope_type": "default", "rope_theta": 160000.0},
    },
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "hc_mult": 2,
    "sliding_window": 16,
    "o_groups": 2,
    "o_lora_rank": 32,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 4,
    "num_nextn_predict_layers": 0,
    "torch_dtype": "float32",
}

PRESETS: dict[str, dict[str, Any]] = {
    "SmolLM2-135M": _SMOLLM2_135M,
    "SmolLM2-135M-Instruct": {**_SMOLLM2_135M, "bos_token_id": 1, "eos_token_id": 2},
    "Llama-3.2-1B": {
        **_LLAMA3_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "Llama-3.1-8B": {
        **_LLAMA3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "Qwen3-30B-A3B": _QWEN3_30B_A3B,
    "OLMoE-1B-7B-like": _OLMOE_1B_7B_LIKE,
    "tiny-qwen3-moe": _TINY_QWEN3_MOE,
    "DeepSeek-V2-Lite": _DEEPSEEK_V2_LITE,
    "DeepSeek-V3": _DEEPSEEK_V3,
    "GLM-4.7-Flash": _GLM_4_7_FLASH,
    "tiny-deepseek-v3": _TINY_DEEPSEEK_V3,
    "DeepSeek-V4-Flash": _DEEPSEEK_V4_FLASH,
    "tiny-deepseek-v4": _TINY_DEEPSEEK_V4,
    "DeepSeek-V3.2": _DEEPSEEK_V32,
    "GLM-5": _GLM_5,
}


def find_preset(name: str) -> Optional[str]:
    """The preset key for `name` ("Llama-3.2-1B", "meta-llama/Llama-3.2-1B", any case), or None."""
    short = name.rstrip("/").rsplit("/", 1)[-1].lower()
    return next((key for key in PRESETS if key.lower() == short), None)


def preset_config(name: str) -> dict[str, Any]:
    key = find_preset(name)
    if key is None:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return dict(PRESETS[key])

"""Tiny mixture-of-experts checkpoints made by transformers, for the MoE model and DP tests."""

from __future__ import annotations

import random
from pathlib import Path

import torch

# The GPU data-parallel tests' model: a real MoE shape with dummy weights, in float32 so that
# layouts and graph modes can be compared token for token.
GPU_DP_MODEL = dict(
    model="OLMoE-1B-7B-like",
    load_format="dummy",
    dtype="float32",
    device="cuda",
    max_model_len=1024,
)


def staggered_requests(num_requests: int, seed: int) -> tuple[list[list[int]], list]:
    """Random prompts of 1-199 tokens, greedy, with 1-30 output tokens in a fixed pattern: the
    decode batch walks down the bucket ladder and one DP rank runs out of work first (it replays
    dummy batches)."""
    from atomrt.runtime.sampling_params import SamplingParams

    rng = random.Random(seed)
    prompts = [
        [rng.randrange(1, 50000) for _ in range(rng.randrange(1, 200))] for _ in range(num_requests)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1 + (i * 7) % 30, ignore_eos=True)
        for i in range(num_requests)
    ]
    return prompts, params


_BASE = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=1,
)


def tiny_moe_configs() -> dict[str, object]:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    return {
        "qwen3_moe": Qwen3MoeConfig(
            **_BASE,
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        "qwen2_moe": Qwen2MoeConfig(
            **_BASE,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=4,
            decoder_sparse_step=2,
        ),
        "mixtral": MixtralConfig(
            **_BASE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2
        ),
    }


def make_hf_model(cfg: object, seed: int = 0) -> torch.nn.Module:
    """Random weights larger than the init's, so that routing and every layer matter."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def build_moe_folder(folder: Path, name: str = "qwen3_moe", seed: int = 0) -> Path:
    """Save tiny config `name` with random weights as safetensors in `folder`."""
    make_hf_model(tiny_moe_configs()[name], seed).save_pretrained(folder, safe_serialization=True)
    return folder

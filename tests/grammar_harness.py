"""Tiny random models with a real byte-level BPE vocabulary (the embedded SmolLM2 tokenizer's, 49152
tokens) for the structured-output tests: their unconstrained output is noise, so a grammar does all
the work of making it valid."""

from __future__ import annotations

from pathlib import Path

import torch

EOS = 2  # SmolLM2's <|im_end|>


def bpe_tokenizer():
    from atomrt.runtime.config import DEFAULT_MODEL
    from atomrt.workers.loading.loader import resolve_model
    from atomrt.workers.loading.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(DEFAULT_MODEL))


def build_tiny_bpe(folder: Path, moe: bool = False, seed: int = 0) -> Path:
    """A 2-layer Llama (or, `moe`, a 3-layer Qwen3-MoE) of hidden size 64 over the embedded
    tokenizer's vocabulary, random weights, with that tokenizer and its chat template saved."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    shape = dict(
        vocab_size=49152,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=EOS,
    )
    if moe:
        cfg = Qwen3MoeConfig(
            **shape,
            num_hidden_layers=3,
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    else:
        cfg = LlamaConfig(**shape, num_hidden_layers=2, intermediate_size=96)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    bpe_tokenizer().hf.save_pretrained(folder)
    return folder

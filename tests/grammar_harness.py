"""Tiny random models with a real byte-level BPE vocabulary (the embedded SmolLM2 tokenizer's, 49152
tokens) for the structured-output tests: their unconstrained output is noise, so a grammar does all
the work of making it valid."""

from __future__ import annotations

from pathlib import Path

from moe_harness import make_hf_model, tiny_moe_configs

EOS = 2  # SmolLM2's <|im_end|>
VOCAB = dict(vocab_size=49152, bos_token_id=1, eos_token_id=EOS, max_position_embeddings=1024)


def bpe_tokenizer():
    from atomrt.runtime.config import DEFAULT_MODEL
    from atomrt.workers.loading.loader import resolve_model
    from atomrt.workers.loading.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(DEFAULT_MODEL))


def build_tiny_bpe(folder: Path, moe: bool = False, seed: int = 0) -> Path:
    """A 2-layer Llama of hidden size 64 (or, `moe`, the tiny Qwen3-MoE of the MoE tests) over the
    embedded tokenizer's vocabulary, random weights, with that tokenizer and its chat template
    saved."""
    from transformers import LlamaConfig

    if moe:
        cfg = tiny_moe_configs()["qwen3_moe"]
        for key, value in VOCAB.items():
            setattr(cfg, key, value)
    else:
        cfg = LlamaConfig(
            **VOCAB,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            intermediate_size=96,
            rms_norm_eps=1e-5,
        )
    make_hf_model(cfg, seed).save_pretrained(folder, safe_serialization=True)
    bpe_tokenizer().hf.save_pretrained(folder)
    return folder

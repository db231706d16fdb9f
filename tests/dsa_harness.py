"""Tiny DeepSeek sparse attention checkpoints made by transformers: DeepseekV32ForCausalLM and
GLM-5's GlmMoeDsaForCausalLM (interleaved indexer rotary, layers sharing the top-k), for
tests/test_deepseek_v32.py.

Random weights larger than the init's (deepseek_harness's), the indexer with 16 heads so that no
two tokens tie on its score (with few heads every ReLU can be zero, and the top-k choice among
tied tokens is an accident of the sort), and an index_topk below the prompts' lengths so the
selection matters.
"""

from __future__ import annotations

from pathlib import Path

from deepseek_harness import _MLA, YARN, make_hf_deepseek

NAMES = ("v32", "v32_yarn", "glm5")


def tiny_dsa_configs() -> dict[str, object]:
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    common = dict(
        _MLA,
        q_lora_rank=48,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        index_n_heads=16,
        index_head_dim=16,
    )
    return {
        "v32": DeepseekV32Config(**common, index_topk=6, routed_scaling_factor=2.5),
        "v32_yarn": DeepseekV32Config(
            **common, index_topk=4, routed_scaling_factor=1.5, rope_parameters=YARN
        ),
        # the second and fourth layers reuse the picks of the indexer layer before them
        "glm5": GlmMoeDsaConfig(
            **{**common, "num_hidden_layers": 4},
            index_topk=5,
            indexer_types=["full", "shared", "full", "shared"],
            routed_scaling_factor=1.8,
        ),
    }


def build_dsa_folder(folder: Path, name: str = "v32", seed: int = 0) -> Path:
    make_hf_deepseek(tiny_dsa_configs()[name], seed).save_pretrained(
        folder, safe_serialization=True
    )
    return folder

"""Mixtral: Llama attention and a sparse MoE block in every layer, top-k weights always
renormalized (`ModelArch.norm_topk_prob` is set for it). The layers are qwen3_moe.py's; only the
checkpoint's names differ (`block_sparse_moe`, experts' `w1` / `w3` / `w2`)."""

from __future__ import annotations

import re

from atomrt.workers.models.qwen3_moe import MoEForCausalLM

_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.weight$")
_PROJ = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}


class MixtralForCausalLM(MoEForCausalLM):
    def checkpoint_name(self, name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return _MIXTRAL_EXPERT.sub(
            lambda m: f".experts.{m.group(1)}.{_PROJ[m.group(2)]}.weight", name
        )

"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from atomrt.workers.models.arch import check_architecture
from atomrt.workers.models.llama import LlamaForCausalLM

# Qwen2 (qkv bias) and Qwen3 (q/k norm) differ from Llama only by switches in ModelArch.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str, where: str = "model") -> type[nn.Module]:
    check_architecture(architecture, where)
    return MODEL_REGISTRY[architecture]

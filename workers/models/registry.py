"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from atomrt.workers.models.arch import check_architecture
from atomrt.workers.models.deepseek import DeepseekForCausalLM
from atomrt.workers.models.deepseek_v4 import DeepseekV4ForCausalLM
from atomrt.workers.models.deepseek_v32 import DeepseekV32ForCausalLM
from atomrt.workers.models.llama import LlamaForCausalLM
from atomrt.workers.models.mixtral import MixtralForCausalLM
from atomrt.workers.models.qwen3_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

# Qwen2 (qkv bias) and Qwen3 (q/k norm) differ from Llama only by switches in ModelArch.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    # multi-head latent attention and DeepSeekMoE; GLM-4.7-Flash differs only by its config
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "Glm4MoeLiteForCausalLM": DeepseekForCausalLM,
    # hyper-connected streams, sliding + compressed sparse attention, hash-routed experts
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    # DeepSeek-V3 with the lightning indexer's sparse attention
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    # GLM-5: V3.2's sparse attention, interleaved indexer rotary, layers sharing the top-k
    "GlmMoeDsaForCausalLM": DeepseekV32ForCausalLM,
}


def get_model_class(architecture: str, where: str = "model") -> type[nn.Module]:
    check_architecture(architecture, where)
    return MODEL_REGISTRY[architecture]

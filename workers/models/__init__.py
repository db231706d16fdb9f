"""Model definitions (Llama family: Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3; mixture of experts:
Qwen3-MoE, Qwen2-MoE, Mixtral; the DeepSeek family: DeepSeek-V2, DeepSeek-V3, GLM-4.7-Flash) and
their registry."""

from atomrt.workers.models.arch import ModelArch
from atomrt.workers.models.registry import MODEL_REGISTRY, get_model_class

__all__ = ["MODEL_REGISTRY", "ModelArch", "get_model_class"]

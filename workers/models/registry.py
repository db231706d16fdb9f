"""The supported architectures (config.json `architectures[0]`), one entry each: the model class,
how its config.json's family fields are read, and its flags. Adding an architecture is one entry
here (docs/architecture.md, "How to add a model"). `arch_from_hf_config` builds a `ModelArch` from a
config.json dict through its entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from atomrt.workers.layers.quantization.fp8 import Fp8Config
from atomrt.workers.models.arch import ModelArch, moe_fields
from atomrt.workers.models.deepseek import DeepseekForCausalLM
from atomrt.workers.models.deepseek_arch import deepseek_fields
from atomrt.workers.models.deepseek_v4 import DeepseekV4ForCausalLM
from atomrt.workers.models.deepseek_v4_arch import CSA, HCA, SLIDING, v4_fields
from atomrt.workers.models.deepseek_v32 import DeepseekV32ForCausalLM
from atomrt.workers.models.llama import LlamaForCausalLM
from atomrt.workers.models.mixtral import MixtralForCausalLM
from atomrt.workers.models.qwen3_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

FieldsReader = Callable[[dict[str, Any], str, str], dict[str, Any]]  # (cfg, architecture, where)


def _dense(cfg: dict[str, Any], architecture: str, where: str) -> dict[str, Any]:
    return {}


def _v4_fields(cfg: dict[str, Any], architecture: str, where: str) -> dict[str, Any]:
    return v4_fields(cfg, where)


@dataclass(frozen=True)
class Architecture:
    """One supported architecture. `fields` reads its family's ModelArch fields from config.json;
    the flags say what its models are made of (tests/test_models_registry.py checks them against
    the ModelArch each preset builds)."""

    model: type[nn.Module]
    fields: FieldsReader = _dense
    qkv_bias: bool = False  # bias on q/k/v whatever config.json's attention_bias says (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3)
    moe: bool = False  # routed experts
    mla: bool = False  # multi-head latent attention
    mtp: bool = False  # speculative method "mtp" drafts with its multi-token-prediction layers
    kv_kinds: tuple[str, ...] = ("attention",)  # its layers' KV cache kinds (kv_cache_spec().kind)


_DEEPSEEK = dict(fields=deepseek_fields, moe=True, mla=True, mtp=True, kv_kinds=("mla",))
_DSA = dict(_DEEPSEEK, model=DeepseekV32ForCausalLM, kv_kinds=("dsa_mla",))
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM),
    # Qwen2 (qkv bias) and Qwen3 (q/k norm) differ from Llama only by switches in ModelArch
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, qkv_bias=True),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, qk_norm=True),
    "Qwen2MoeForCausalLM": Architecture(Qwen2MoeForCausalLM, moe_fields, qkv_bias=True, moe=True),
    "Qwen3MoeForCausalLM": Architecture(Qwen3MoeForCausalLM, moe_fields, qk_norm=True, moe=True),
    "MixtralForCausalLM": Architecture(MixtralForCausalLM, moe_fields, moe=True),
    # multi-head latent attention and DeepSeekMoE; GLM-4.7-Flash differs only by its config
    "DeepseekV2ForCausalLM": Architecture(DeepseekForCausalLM, **_DEEPSEEK),
    "DeepseekV3ForCausalLM": Architecture(DeepseekForCausalLM, **_DEEPSEEK),
    "Glm4MoeLiteForCausalLM": Architecture(DeepseekForCausalLM, **_DEEPSEEK),
    # hyper-connected streams, sliding + compressed sparse attention, hash-routed experts
    "DeepseekV4ForCausalLM": Architecture(
        DeepseekV4ForCausalLM, _v4_fields, moe=True, mtp=True, kv_kinds=(SLIDING, CSA, HCA)
    ),
    # DeepSeek-V3 with the lightning indexer's sparse attention
    "DeepseekV32ForCausalLM": Architecture(**_DSA),
    # GLM-5: V3.2's sparse attention, interleaved indexer rotary, layers sharing the top-k
    "GlmMoeDsaForCausalLM": Architecture(**_DSA),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
MODEL_REGISTRY: dict[str, type[nn.Module]] = {n: a.model for n, a in ARCHITECTURES.items()}


def architecture_entry(architecture: str, where: str = "model") -> Architecture:
    entry = ARCHITECTURES.get(architecture)
    if entry is None:
        raise ValueError(
            f"{where}: unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return entry


def get_model_class(architecture: str, where: str = "model") -> type[nn.Module]:
    return architecture_entry(architecture, where).model


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _rope(cfg: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """(theta, scaling) from either the transformers-5 `rope_parameters` or the older keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def arch_from_hf_config(cfg: dict[str, Any], where: str) -> ModelArch:
    """ModelArch from a config.json dict; `where` (the path) goes into error messages."""
    architectures = cfg.get("architectures") or []
    if not architectures:
        raise ValueError(f"{where}: config.json has no 'architectures' entry")
    architecture = architectures[0]
    entry = architecture_entry(architecture, where)
    if entry.fields is _v4_fields:  # its experts' width is its only MLP width
        cfg = {"intermediate_size": cfg.get("moe_intermediate_size", 2048), **cfg}
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias", False):
        raise ValueError(f"{where}: only silu MLPs without bias are supported")
    quantization = cfg.get("quantization_config")
    if quantization:  # FP8 loads (workers/layers/quantization/fp8.py); anything else is refused
        Fp8Config.from_hf(quantization, where)
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden_size = int(cfg["hidden_size"])
        theta, scaling = _rope(cfg)
        qkv_bias = entry.qkv_bias or bool(cfg.get("attention_bias", False))
        fields: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden_size // num_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            qkv_bias=qkv_bias,
            qk_norm=entry.qk_norm,
        )
        fields.update(entry.fields(cfg, architecture, where))
        return ModelArch(**fields)
    except KeyError as e:
        raise ValueError(f"{where}: config.json lacks the field {e.args[0]!r}") from None

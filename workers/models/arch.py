"""`ModelArch`: the shape and settings of a model, whatever file it came from.

Built from a Hugging Face config.json dict (`arch_from_hf_config`), from GGUF metadata
(workers/loading/gguf.py) or from a preset (workers/loading/presets.py). Models are constructed
from it alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# Architectures whose layout LlamaForCausalLM implements, with the per-family switches.
_FAMILY_FLAGS: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILY_FLAGS)


@dataclass(frozen=True)
class ModelArch:
    architecture: str  # Hugging Face class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None  # {"rope_type": "llama3", "factor": ...} or None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before rotary
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: Optional[int] = None
    checkpoint_dtype: Optional[str] = None  # "bfloat16", ... as stored; None if unknown


def check_architecture(architecture: str, where: str) -> None:
    if architecture not in _FAMILY_FLAGS:
        raise ValueError(
            f"{where}: unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


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
    check_architecture(architecture, where)
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias", False):
        raise ValueError(f"{where}: only silu MLPs without bias are supported")
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden_size = int(cfg["hidden_size"])
        theta, scaling = _rope(cfg)
        flags = dict(_FAMILY_FLAGS[architecture])
        if architecture != "Qwen2ForCausalLM":
            flags["qkv_bias"] = bool(cfg.get("attention_bias", False))
        return ModelArch(
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
            **flags,
        )
    except KeyError as e:
        raise ValueError(f"{where}: config.json lacks the field {e.args[0]!r}") from None

"""`ModelArch`: the shape and settings of a model, whatever file it came from.

Built from a Hugging Face config.json dict (`arch_from_hf_config`), from GGUF metadata
(workers/loading/gguf.py) or from a preset (workers/loading/presets.py). Models are constructed
from it alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from atomrt.workers.layers.quantization.fp8 import Fp8Config
from atomrt.workers.models.deepseek_arch import deepseek_fields
from atomrt.workers.models.deepseek_v4_arch import V4Arch, v4_fields

# Supported architectures with the per-family switches of their attention (Llama's, for all).
_FAMILY_FLAGS: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "MixtralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "DeepseekV2ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "DeepseekV3ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Glm4MoeLiteForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "DeepseekV4ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "DeepseekV32ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "GlmMoeDsaForCausalLM": {"qkv_bias": False, "qk_norm": False},
}
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
# Multi-head latent attention and DeepSeekMoE (workers/models/deepseek_arch.py reads their fields)
MLA_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM",
)
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
    # Mixture of experts (0 experts: a dense model). A layer is sparse when it is not in
    # mlp_only_layers and (index + 1) % decoder_sparse_step == 0 (Qwen-MoE's rule).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's
    norm_topk_prob: bool = False  # renormalize the top-k routing weights (Mixtral: always)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a sigmoid-gated dense expert beside
    # Multi-head latent attention (DeepSeek family; kv_lora_rank 0: not MLA). head_dim is then the
    # query/key head size, qk_nope_head_dim + qk_rope_head_dim.
    q_lora_rank: Optional[int] = None  # None: a plain q projection
    kv_lora_rank: int = 0  # the latent's width (the cache row holds it and the rotary key part)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary over the pairs (x0, x1), (x2, x3), ...
    # DeepSeekMoE: ungated shared experts (n_shared_experts * moe_intermediate_size wide) beside
    # the routed ones, and its routing (workers/layers/deepseek_moe.py)
    n_shared_experts: int = 0
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    scoring_func: str = "softmax"  # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers stored after the decoder's
    # DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2; 0 heads: none)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_shared_layers: tuple[int, ...] = ()  # GLM-5: layers that attend the previous one's picks
    # DeepSeek-V4's own fields (workers/models/deepseek_v4_arch.py); None for every other model
    v4: Optional[V4Arch] = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


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
    if architecture == "DeepseekV4ForCausalLM":  # its experts' width is its only MLP width
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
        flags = dict(_FAMILY_FLAGS[architecture])
        if architecture not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
            flags["qkv_bias"] = bool(cfg.get("attention_bias", False))
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
            **flags,
        )
        if architecture in MLA_ARCHITECTURES:
            fields.update(deepseek_fields(cfg, architecture, where))
        elif architecture == "DeepseekV4ForCausalLM":
            fields.update(v4_fields(cfg, where))
        else:
            fields.update(_moe_fields(cfg, architecture, where))
        return ModelArch(**fields)
    except KeyError as e:
        raise ValueError(f"{where}: config.json lacks the field {e.args[0]!r}") from None


def _moe_fields(cfg: dict[str, Any], architecture: str, where: str) -> dict[str, Any]:
    """ModelArch's mixture-of-experts fields from a config.json dict ({} for a dense model)."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window", architecture == "MixtralForCausalLM") and window:
        if int(window) < int(cfg.get("max_position_embeddings", 4096)):
            raise ValueError(
                f"{where}: sliding-window attention ({window} tokens) is not supported"
            )
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not num_experts:
        raise ValueError(f"{where}: config.json lacks the field 'num_experts'")
    mixtral = architecture == "MixtralForCausalLM"
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        # Mixtral's experts are its intermediate_size wide; Qwen's have their own width
        moe_intermediate_size=int(cfg["intermediate_size" if mixtral else "moe_intermediate_size"]),
        norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )

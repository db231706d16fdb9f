"""`ModelArch`: the shape and settings of a model, whatever file it came from.

Built from a Hugging Face config.json dict (`arch_from_hf_config`, workers/models/registry.py),
from GGUF metadata (workers/loading/gguf.py) or from a preset (workers/loading/presets.py).
Models are constructed from it alone. `moe_fields` reads the Qwen-MoE / Mixtral experts' fields
of a config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from atomrt.workers.models.deepseek_v4_arch import V4Arch


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


def moe_fields(cfg: dict[str, Any], architecture: str, where: str) -> dict[str, Any]:
    """ModelArch's mixture-of-experts fields from a Qwen-MoE or Mixtral config.json dict."""
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

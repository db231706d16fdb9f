"""DeepSeek-V4's config.json fields (DeepseekV4ForCausalLM), under the names transformers gives
them, as a `V4Arch` that `ModelArch.v4` carries.

What a layer is: `layer_types[i]` picks its attention -- `sliding_attention` (a window of
`sliding_window` tokens), `compressed_sparse_attention` (CSA: the window plus the compressed entries
the lightning indexer picks, one entry per `compress_rates[type]` tokens) or
`heavily_compressed_attention` (HCA: the window plus every compressed entry) -- and
`mlp_layer_types[i]` its experts' routing (`hash_moe`: the frozen `tid2eid[input_ids]` table;
`moe`: top-k of the scores plus the correction bias). Configs that carry the older names
(`compress_ratios`, `compress_rate_csa` / `compress_rate_hca`, `num_hash_layers`,
`qk_rope_head_dim`) are read as transformers reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class V4Arch:
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]  # (layer type, tokens per compressed entry)
    sliding_window: int
    qk_rope_head_dim: int  # the trailing rotated part of every head (partial rotary)
    main_rope_theta: float
    main_rope_scaling: Optional[dict[str, Any]]
    compress_rope_theta: float
    compress_rope_scaling: Optional[dict[str, Any]]
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    scoring_func: str

    def compress_rate(self, layer_type: str) -> int:
        return dict(self.compress_rates).get(layer_type, 0)

    @property
    def anchor_stride(self) -> int:
        """k: a sequence's blocks go in groups of k, the first of each holding the compressed
        entries its group's tokens end (workers/layers/v4_attention.py): the smallest compress
        rate of the model's layers (1 without compressed layers)."""
        rates = [self.compress_rate(t) for t in set(self.layer_types)]
        return min((r for r in rates if r), default=1)

    @property
    def token_reach(self) -> int:
        """How many tokens back a step reads a token's own row: its window, or the tokens a
        compressed entry pools (a CSA entry two windows, an HCA entry one)."""
        reach = self.sliding_window
        for t in set(self.layer_types):
            r = self.compress_rate(t)
            reach = max(reach, 2 * r if t == "compressed_sparse_attention" else r)
        return reach


def _rope_params(cfg: dict[str, Any], label: str, theta_key: str) -> tuple[float, Optional[dict]]:
    """(theta, scaling or None) of one of V4's two rotary sets ("main", "compress")."""
    params = cfg.get("rope_parameters") or {}
    sub = params.get(label) if isinstance(params.get(label), dict) else None
    if sub is None:  # a flat rope dict applies to the compressed layers' (as transformers reads it)
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        sub = {"rope_type": "default"} if label == "main" else dict(flat)
        sub["rope_theta"] = cfg.get(theta_key, 10000.0 if label == "main" else 160000.0)
        sub.setdefault("rope_type", "default")
        if sub["rope_type"] == "yarn":
            sub.setdefault("attention_factor", 1.0)
    theta = float(sub.get("rope_theta", cfg.get(theta_key, 10000.0)))
    scaling = {k: v for k, v in sub.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, None
    scaling.setdefault("rope_type", scaling.pop("type", "yarn"))
    return theta, scaling


def v4_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelArch's fields of a DeepseekV4ForCausalLM config.json dict (`v4` among them)."""
    n = int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or 512)
    rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
    if cfg.get("compress_rate_csa") is not None:
        rates[CSA] = int(cfg["compress_rate_csa"])
    if cfg.get("compress_rate_hca") is not None:
        rates[HCA] = int(cfg["compress_rate_hca"])
    layer_types = cfg.get("layer_types")
    if layer_types is None and cfg.get("compress_ratios") is not None:
        layer_types = [_RATIO_TO_TYPE[int(r)] for r in cfg["compress_ratios"]]
    if layer_types is None:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = int(cfg.get("num_hash_layers", 3))
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    layer_types, mlp_types = tuple(layer_types[:n]), tuple(mlp_types[:n])
    for name, types, allowed in (
        ("layer_types", layer_types, LAYER_TYPES),
        ("mlp_layer_types", mlp_types, MLP_LAYER_TYPES),
    ):
        bad = [t for t in types if t not in allowed]
        if len(types) != n or bad:
            raise ValueError(
                f"{where}: {name} must list num_hidden_layers ({n}) entries of {allowed}; "
                f"got {list(types)}"
            )
    for t in set(layer_types) - {SLIDING}:
        if int(rates.get(t, 0)) <= 0:
            raise ValueError(f"{where}: compress_rates[{t!r}] must be a positive integer")
    partial = cfg.get("partial_rotary_factor")
    if partial is None:
        rope_dim = int(cfg.get("qk_rope_head_dim") or 64)
    else:
        rope_dim = int(head_dim * float(partial))
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise ValueError(
            f"{where}: partial_rotary_factor gives {rope_dim} rotated channels of head_dim "
            f"{head_dim}; they must be positive, even and at most head_dim"
        )
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"{where}: scoring_func {scoring!r} is not one of {SCORING_FUNCS}")
    num_heads, o_groups = int(cfg.get("num_attention_heads", 64)), int(cfg.get("o_groups", 8))
    if num_heads % o_groups:
        raise ValueError(
            f"{where}: num_attention_heads ({num_heads}) must split into o_groups ({o_groups})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act must be silu")
    main_theta, main_scaling = _rope_params(cfg, "main", "rope_theta")
    compress_theta, compress_scaling = _rope_params(cfg, "compress", "compress_rope_theta")
    v4 = V4Arch(
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        compress_rates=tuple(sorted((k, int(v)) for k, v in rates.items())),
        sliding_window=int(cfg.get("sliding_window", 128)),
        qk_rope_head_dim=rope_dim,
        main_rope_theta=main_theta,
        main_rope_scaling=main_scaling,
        compress_rope_theta=compress_theta,
        compress_rope_scaling=compress_scaling,
        o_groups=o_groups,
        o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
        index_n_heads=int(cfg.get("index_n_heads", 64)),
        index_head_dim=int(cfg.get("index_head_dim", 128)),
        index_topk=int(cfg.get("index_topk", 512)),
        hc_mult=int(cfg.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(cfg.get("hc_eps", 1e-6)),
        swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
        scoring_func=scoring,
    )
    moe = int(cfg.get("moe_intermediate_size", 2048))
    return dict(
        num_heads=num_heads,
        num_kv_heads=1,
        head_dim=head_dim,
        intermediate_size=moe,
        rope_theta=main_theta,
        rope_scaling=main_scaling,
        q_lora_rank=int(cfg.get("q_lora_rank", 1024)),
        qk_rope_head_dim=rope_dim,
        num_experts=int(cfg.get("n_routed_experts", 256)),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 6)),
        moe_intermediate_size=moe,
        norm_topk_prob=True,
        n_shared_experts=int(cfg.get("n_shared_experts", 1)),
        scoring_func=scoring,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        v4=v4,
    )

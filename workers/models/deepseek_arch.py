"""The DeepSeek family's config.json fields (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM,
Glm4MoeLiteForCausalLM): multi-head latent attention and DeepSeekMoE, as `ModelArch` fields.

Fields are read under the names Hugging Face gives them. Which MLPs are dense: the first
`first_k_dense_replace` layers and those off `moe_layer_freq` (a layer is sparse when
`layer >= first_k_dense_replace and layer % moe_layer_freq == 0`), or, where a config carries it,
transformers' `mlp_layer_types` list ("dense" / "sparse" per layer); they become
`ModelArch.mlp_only_layers`. A config that names no routing gets its class's: greedy softmax for
DeepSeek-V2, `noaux_tc` with sigmoid scores for DeepSeek-V3 and GLM-4.7-Flash.
"""

from __future__ import annotations

from typing import Any

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")
_DEFAULT_ROUTING = {
    "DeepseekV2ForCausalLM": ("greedy", "softmax"),
    "DeepseekV3ForCausalLM": ("noaux_tc", "sigmoid"),
    "Glm4MoeLiteForCausalLM": ("noaux_tc", "sigmoid"),
    "DeepseekV32ForCausalLM": ("noaux_tc", "sigmoid"),
    "GlmMoeDsaForCausalLM": ("noaux_tc", "sigmoid"),
}


def deepseek_fields(cfg: dict[str, Any], architecture: str, where: str) -> dict[str, Any]:
    """ModelArch's attention and MoE fields of a DeepSeek-family config.json dict."""
    nope, rope, v = (int(cfg[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q_lora = cfg.get("q_lora_rank")
    kv_lora = int(cfg["kv_lora_rank"])
    if min(nope, v, kv_lora) <= 0 or rope <= 0 or rope % 2:
        raise ValueError(
            f"{where}: kv_lora_rank, qk_nope_head_dim and v_head_dim must be positive and "
            f"qk_rope_head_dim positive and even; got {kv_lora}, {nope}, {v}, {rope}"
        )
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor other than 1.0 is not supported")
    fields: dict[str, Any] = dict(
        head_dim=nope + rope,
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        # DeepSeek-V2 rotates interleaved pairs always; V3 and GLM by `rope_interleave`
        rope_interleave=architecture == "DeepseekV2ForCausalLM"
        or bool(cfg.get("rope_interleave", True)),
        num_nextn_predict_layers=int(
            cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers")) or 0
        ),
    )
    if architecture in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"):  # the indexer's
        glm = architecture == "GlmMoeDsaForCausalLM"
        types = list(cfg.get("indexer_types") or [])
        if any(t not in ("full", "shared") for t in types) or (types and types[0] != "full"):
            raise ValueError(
                f"{where}: indexer_types must list 'full' / 'shared' per layer, the first "
                f"'full'; got {types}"
            )
        fields.update(
            index_n_heads=int(cfg.get("index_n_heads", 32 if glm else 64)),
            index_head_dim=int(cfg.get("index_head_dim", 128)),
            index_topk=int(cfg.get("index_topk", 2048)),
            index_shared_layers=tuple(i for i, t in enumerate(types) if t == "shared"),
        )
    num_experts = int(cfg.get("n_routed_experts") or 0)
    if num_experts:
        fields.update(_routing(cfg, architecture, num_experts, where))
        fields["mlp_only_layers"] = _dense_layers(cfg, where)
    return fields


def _routing(cfg: dict[str, Any], architecture: str, num_experts: int, where: str) -> dict:
    method, scoring = _DEFAULT_ROUTING[architecture]
    method = cfg.get("topk_method") or method
    scoring = cfg.get("scoring_func") or scoring
    if method not in TOPK_METHODS:
        raise ValueError(f"{where}: topk_method {method!r} is not one of {', '.join(TOPK_METHODS)}")
    if scoring not in SCORING_FUNCS:
        raise ValueError(
            f"{where}: scoring_func {scoring!r} is not one of {', '.join(SCORING_FUNCS)}"
        )
    top_k = int(cfg["num_experts_per_tok"])
    n_group = int(cfg.get("n_group") or 1)
    topk_group = int(cfg.get("topk_group") or 1)
    if method == "greedy":
        n_group = topk_group = 1  # greedy routing does not group (V2-Lite's config says 1 anyway)
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(
            f"{where}: n_group={n_group} must divide n_routed_experts={num_experts}, and "
            f"topk_group={topk_group} be in 1..n_group"
        )
    per_group = num_experts // n_group
    if method == "noaux_tc" and n_group > 1 and per_group < 2:
        raise ValueError(
            f"{where}: noaux_tc scores a group by its two best experts; n_group={n_group} leaves "
            f"{per_group} per group"
        )
    if not 0 < top_k <= topk_group * per_group:
        raise ValueError(
            f"{where}: num_experts_per_tok={top_k} must be in 1..{topk_group * per_group} "
            f"(topk_group x the experts of a group)"
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        topk_method=method,
        scoring_func=scoring,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
    )


def _dense_layers(cfg: dict[str, Any], where: str) -> tuple[int, ...]:
    num_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("mlp_layer_types")
    if types is not None:
        if len(types) != num_layers or not set(types) <= {"dense", "sparse"}:
            raise ValueError(
                f"{where}: mlp_layer_types must give 'dense' or 'sparse' for each of the "
                f"{num_layers} layers"
            )
        return tuple(i for i, t in enumerate(types) if t == "dense")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    return tuple(i for i in range(num_layers) if i < first_dense or i % freq)

"""A tiny DeepSeek-V3 checkpoint made by transformers with a multi-token-prediction layer added to
its folder, and the MTP formula written out in float64 for reference.

transformers' DeepSeek-V3 classes do not run (nor load) the MTP layer, so the layer is made here:
its decoder block is transformers' `DeepseekV3DecoderLayer` at index `num_hidden_layers` (sparse:
MLA and DeepSeekMoE), built and saved as layer 3 of a four-layer transformers model whose first
three layers are the target's; its `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` are made
here; its `embed_tokens` and `shared_head.head` copy the target's, as published checkpoints do.

`reference_mtp_logits` is the formula of the DeepSeek-V3 report (section 2.2) in float64:
    h'_t = eh_proj([RMSNorm_e(embed(x_{t+1})) ; RMSNorm_h(h_t)]),  o = block(h'),
    logits_t = lm_head(RMSNorm_s(o_t)),
its norms written from the definition, its block transformers' decoder layer under a causal mask.

`predicting_mtp` constructs an MTP layer whose drafts the target accepts for a reason: it predicts
the target's next token after x_{t+1} (see there).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from deepseek_harness import make_hf_deepseek, tiny_deepseek_configs

LAYER_KEYS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
QUIET = 0.05  # a predicting layer's target: its layers' output projections scaled by this
HIDDEN_SHARE = 0.05  # the hidden state's weight in a predicting layer's input
ATTENTION_GAIN = 4.0  # a random layer's attention output, scaled up from the target's scale


@dataclass
class MTPReference:
    """The target (transformers) and the MTP layer's weights, for the float64 reference."""

    target: torch.nn.Module  # DeepseekV3ForCausalLM (3 layers)
    block: torch.nn.Module  # DeepseekV3DecoderLayer at index num_hidden_layers
    own: dict[str, torch.Tensor]  # LAYER_KEYS -> tensor
    eps: float

    def double(self) -> MTPReference:
        """A float64 copy (its experts run as transformers' eager loop, which takes float64)."""
        return MTPReference(
            _eager_experts(copy.deepcopy(self.target).double()),
            _eager_experts(copy.deepcopy(self.block).double()),
            {k: v.double() for k, v in self.own.items()},
            self.eps,
        )


def _eager_experts(module: torch.nn.Module) -> torch.nn.Module:
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None:
            cfg._experts_implementation = "eager"
    return module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def make_mtp(target_cfg: object, target: torch.nn.Module, seed: int) -> MTPReference:
    """An MTP layer with random weights (as large as the target's), for `target`."""
    cfg = copy.deepcopy(target_cfg)
    n = cfg.num_hidden_layers
    cfg.num_hidden_layers = n + 1
    # configs that list a kind per layer (DeepSeek-V3.2's, GLM-5's): the MTP layer's is sparse,
    # with an indexer of its own
    if getattr(cfg, "mlp_layer_types", None):
        cfg.mlp_layer_types = [*cfg.mlp_layer_types, "sparse"]
    if getattr(cfg, "indexer_types", None):
        cfg.indexer_types = [*cfg.indexer_types, "full"]
    four = make_hf_deepseek(cfg, seed)  # its layer n is the MTP layer's block
    g = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size

    def around_one() -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(h, generator=g)

    own = {
        "enorm.weight": around_one(),
        "hnorm.weight": around_one(),
        "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5,
        "shared_head.norm.weight": around_one(),
    }
    block = four.model.layers[n].eval()
    with torch.no_grad():  # attention weighs as much as the layer's input: its KV cache matters
        block.self_attn.o_proj.weight.mul_(ATTENTION_GAIN)
    return MTPReference(target, block, own, cfg.rms_norm_eps)


def reference_mtp_hidden(
    ref: MTPReference,
    hidden: torch.Tensor,
    next_ids: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """o_t for rows t of one sequence (causal over the rows): hidden [T, H] (h_t), next_ids [T]
    (x_{t+1}), positions [T]. Computes in the reference's dtype."""
    t = ref.target.model
    embeds = t.embed_tokens(next_ids)
    x = (
        torch.cat(
            [
                rms_norm(embeds, ref.own["enorm.weight"], ref.eps),
                rms_norm(hidden, ref.own["hnorm.weight"], ref.eps),
            ],
            dim=-1,
        )
        @ ref.own["eh_proj.weight"].T
    )
    x = x[None]
    pos = positions[None]
    cos_sin = t.rotary_emb(x, pos)
    rows = x.shape[1]
    mask = torch.full((rows, rows), float("-inf"), dtype=x.dtype).triu(1)[None, None]
    return ref.block(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)[0]


def reference_mtp_logits(ref: MTPReference, o: torch.Tensor) -> torch.Tensor:
    """lm_head(RMSNorm_s(o)) [T, vocab]."""
    return rms_norm(o, ref.own["shared_head.norm.weight"], ref.eps) @ ref.target.lm_head.weight.T


@torch.no_grad()
def target_hidden(ref: MTPReference, ids: list[int]) -> torch.Tensor:
    """The target's final hidden states (after its model.norm) [T, H] over one sequence."""
    out = ref.target.model(input_ids=torch.tensor([ids]))
    return out.last_hidden_state[0]


def save_mtp_layer(
    folder: Path, ref: MTPReference, hnorm_scale: Optional[torch.Tensor] = None
) -> None:
    """Write the MTP layer into `folder` (a transformers-saved target) as
    `model.layers.<num_hidden_layers>.*` in a safetensors file of its own, and say
    num_nextn_predict_layers = 1 in its config.json. `hnorm_scale` multiplies hnorm's weight (a
    deliberately corrupted normalisation)."""
    from safetensors.torch import save_file

    cfg = json.loads((folder / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    prefix = f"model.layers.{n}."
    tensors = {prefix + k: v.float().contiguous().clone() for k, v in ref.own.items()}
    if hnorm_scale is not None:
        tensors[prefix + "hnorm.weight"] = tensors[prefix + "hnorm.weight"] * hnorm_scale
    tensors.update(_block_tensors(ref, prefix))
    tensors[prefix + "embed_tokens.weight"] = ref.target.model.embed_tokens.weight.float().clone()
    tensors[prefix + "shared_head.head.weight"] = ref.target.lm_head.weight.float().clone()
    save_file(tensors, str(folder / "mtp.safetensors"))
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))


def _block_tensors(ref: MTPReference, prefix: str) -> dict[str, torch.Tensor]:
    """The decoder block's tensors under checkpoint names (one tensor per expert projection, as
    transformers saves a DeepSeek-V3 checkpoint)."""
    out = {}
    for name, t in ref.block.state_dict().items():
        t = t.float().contiguous().clone()
        if name == "mlp.experts.gate_up_proj":  # [E, 2 * I, H]: gate rows, then up rows
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name == "mlp.experts.down_proj":  # [E, H, I]
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[prefix + name] = t
    return out


def build_mtp_folder(
    folder: Path,
    seed: int = 0,
    predicting: bool = False,
    hnorm_scale: Optional[float] = None,
    overrides: Optional[dict] = None,
    target_config: Optional[object] = None,
) -> MTPReference:
    """The tiny DeepSeek-V3 target (deepseek_harness "v3", seed 0; or `target_config`'s) saved in
    `folder` with an MTP layer: random from `seed`, or, `predicting`, a quiet target and a layer
    that predicts it (`predicting_mtp`). `hnorm_scale`: the saved hnorm weight multiplied by it (a
    corrupted normalisation; the returned reference keeps the right one). `overrides`: config
    fields set before the weights are made (a real tokenizer's vocabulary and special ids)."""
    cfg = copy.deepcopy(target_config) if target_config else tiny_deepseek_configs()["v3"]
    for key, value in (overrides or {}).items():
        setattr(cfg, key, value)
    target = make_hf_deepseek(cfg, 0)
    ref = make_mtp(cfg, target, seed)
    if predicting:
        quiet_layers(target, QUIET)
        predicting_mtp(ref, QUIET, HIDDEN_SHARE)
    target.save_pretrained(folder, safe_serialization=True)
    scale = None if hnorm_scale is None else torch.full((cfg.hidden_size,), hnorm_scale)
    save_mtp_layer(folder, ref, scale)
    return ref


# ------------------------------------------------------------------------ a layer that predicts


def quiet_layers(module: torch.nn.Module, scale: float) -> None:
    """Scale every layer's output projections (attention's o_proj, the MLPs' and experts'
    down_proj) by `scale`: each layer then nudges the residual stream rather than rewriting it."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(scale)


def predicting_mtp(ref: MTPReference, scale: float, hidden_share: float) -> None:
    """Make the MTP layer predict the target's next token after x_{t+1}, by construction, for a
    target whose layers are quiet (`quiet_layers`): such a target's next token after x is nearly
    argmax lm_head(norm(embed(x))), a function of x alone. The layer passes embed(x_{t+1})
    through (`enorm` of ones, `eh_proj` the identity on it), adds `hidden_share` x a random
    projection of hnorm(h_t), its own block quiet too, and its head norm is the target's final
    norm: its logits are then nearly the target's at t + 1. The hidden state's share is small,
    so a hidden state normalised `1 / hidden_share` times too large swamps the prediction."""
    h = ref.target.config.hidden_size
    g = torch.Generator().manual_seed(11)
    quiet_layers(ref.block, scale)
    ref.own["enorm.weight"] = torch.ones(h)
    ref.own["eh_proj.weight"] = torch.cat(
        [torch.eye(h), hidden_share * torch.randn(h, h, generator=g) * h**-0.5], dim=1
    )
    ref.own["shared_head.norm.weight"] = ref.target.model.norm.weight.detach().clone()

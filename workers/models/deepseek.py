"""The DeepSeek family: DeepSeek-V2 / V2-Lite, DeepSeek-V3 and GLM-4.7-Flash (Glm4MoeLite), one
model class under three architecture names.

A decoder layer is multi-head latent attention (workers/layers/mla.py: the latent KV cache, the
`mla_attention` op) and an MLP: dense in the first `first_k_dense_replace` layers (and those
`moe_layer_freq` skips), else DeepSeekMoE, the routed experts (workers/layers/deepseek_moe.py:
grouped top-k routing over `FusedMoE`) plus ungated shared experts. The backbone, the DP exchange
of the MoE layers and two-batch overlap are the MoE family's (workers/models/qwen3_moe.py).

Multi-token-prediction layers (`num_nextn_predict_layers`, stored as layers
`num_hidden_layers + i`) are not part of this model: its loading leaves their tensors out. The MTP
drafter builds and loads them itself (`mtp_layers`, workers/models/deepseek_mtp.py:
`DeepseekDecoderLayer`s that share this model's embedding and LM head).

Hot path: traced by Dynamo with a dynamic token dimension and recorded into CUDA graphs (see
llama.py); the attention and the experts are opaque ops.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from atomrt.distributed.communication_op import DPInfo, TPInfo, tp_all_reduce
from atomrt.workers.layers.deepseek_moe import GroupedRouting, GroupedTopkMoE
from atomrt.workers.layers.mla import MLAAttention
from atomrt.workers.layers.rotary import RotaryEmbedding, yarn_softmax_scale
from atomrt.workers.models.arch import ModelArch
from atomrt.workers.models.deepseek_mtp import DeepseekMTPLayers
from atomrt.workers.models.qwen3_moe import (
    MoEBlock,
    MoEDecoderLayer,
    MoEForCausalLM,
    SharedExpert,
)


def make_mla(
    arch: ModelArch,
    layer_idx: int,
    tp: TPInfo,
    max_position: int,
    layer_class: type = MLAAttention,
    **extra: object,
) -> MLAAttention:
    """A layer's MLA block (or a subclass's, `extra` its own arguments): softmax scale
    (qk_nope + qk_rope)^-0.5, times YaRN's mscale^2 under a scaled rope."""
    rotary = RotaryEmbedding(
        arch.qk_rope_head_dim,
        max_position,
        arch.rope_theta,
        arch.rope_scaling,
        interleaved=arch.rope_interleave,
    )
    scale = arch.head_dim**-0.5 * yarn_softmax_scale(arch.rope_scaling)
    return layer_class(
        layer_idx,
        arch.hidden_size,
        arch.num_heads,
        arch.q_lora_rank,
        arch.kv_lora_rank,
        arch.qk_nope_head_dim,
        arch.qk_rope_head_dim,
        arch.v_head_dim,
        scale,
        rotary,
        tp,
        bias=arch.qkv_bias,
        **extra,
    )


# After loading, a DeepSeekMoE layer's shared experts become routed experts E, E + 1, ... that
# every row picks at weight 1 (`DeepseekMoE.fuse_shared_experts`): one fused-MoE launch pair reads
# their weights with the routed ones', rather than the shared MLP's two GEMMs and its add.
# Unquantized weights on one rank (DP = TP = 1) only. Off: DeepSeek-V2-Lite, level 3, FULL+async on
# one H100 (330cecb; the fused shape given the routed shape's M=1 launches) took bs 1 2.999 ms
# against 3.159, but bs 32 13.568 against 12.021. At 32 tokens the 66 experts' 256 pairs are past
# align.ONE_PROGRAM_MAX_CELLS (128 x 256 cells), so each layer lays them out with torch's dozen
# kernels, where the 64 experts' 192 pairs fit one program: the likely cost (not profiled)
FUSE_SHARED_EXPERTS = False


class DeepseekMoE(MoEBlock):
    """The routed experts and the shared ones (n_shared_experts * moe_intermediate_size wide, not
    gated), added before the one TP all-reduce; or, with `FUSE_SHARED_EXPERTS`, folded into the
    routed ones."""

    def __init__(self, arch: ModelArch, tp: TPInfo, dp: DPInfo) -> None:
        super().__init__()
        self.tp = tp
        routing = GroupedRouting(
            arch.num_experts,
            arch.num_experts_per_tok,
            arch.topk_method,
            arch.scoring_func,
            arch.n_group,
            arch.topk_group,
            arch.norm_topk_prob,
            arch.routed_scaling_factor,
        )
        shared = arch.n_shared_experts * arch.moe_intermediate_size
        self.experts = GroupedTopkMoE(
            routing, arch.hidden_size, arch.moe_intermediate_size, tp, dp, reduce_output=not shared
        )
        self.shared_experts = SharedExpert(arch.hidden_size, shared, tp) if shared else None

    def _add_shared(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is None:  # none, or folded into the experts (not reduced yet)
            return y if self.experts.reduce_output else tp_all_reduce(y, self.tp)
        return tp_all_reduce(y + self.shared_experts(x), self.tp)

    def process_weights_after_loading(self) -> None:
        if FUSE_SHARED_EXPERTS and self.shared_experts is not None:
            self.fuse_shared_experts()

    def fuse_shared_experts(self) -> None:
        """Fold the shared MLP into the routed experts. Its intermediate units split into chunks
        of an expert's shard, each becoming an expert of its own: chunk c's gate and up rows and
        down columns. silu(gate) * up is taken unit by unit and the down projection sums over
        units, so the chunks' outputs sum to the shared MLP's; the routing appends the chunks to
        every row at weight 1. Left as it is under FP8 (the scales' layouts differ), under DP > 1
        (the experts run on every DP rank's rows, the shared MLP on this rank's), under TP > 1
        (untested there) and when the shared MLP is not a whole number of expert shards."""
        experts, shared = self.experts, self.shared_experts
        inter = experts.shard_size
        gate_up, down = shared.gate_up_proj, shared.down_proj
        width = down.weight.shape[1]  # this rank's shard of the shared intermediate
        if (
            experts.quant_method is not None
            or gate_up.quant_method is not None
            or down.quant_method is not None
            or experts.dp.dp_size > 1
            or experts.tp.tp_size > 1
            or width % inter
        ):
            return
        chunks, hidden = width // inter, down.weight.shape[0]
        w = gate_up.weight.data  # [gate rows; up rows], each `width`
        gate, up = (part.reshape(chunks, inter, hidden) for part in (w[:width], w[width:]))
        w13 = torch.cat([gate, up], dim=1)  # [chunks, 2 * inter, hidden]
        # [chunks, hidden, inter]
        w2 = down.weight.data.reshape(hidden, chunks, inter).transpose(0, 1)
        experts.w13_weight = nn.Parameter(
            torch.cat([experts.w13_weight.data, w13.to(experts.w13_weight.dtype)]),
            requires_grad=False,
        )
        experts.w2_weight = nn.Parameter(
            torch.cat([experts.w2_weight.data, w2.to(experts.w2_weight.dtype)]),
            requires_grad=False,
        )
        router = experts.gate
        router.routing = dataclasses.replace(router.routing, n_shared=chunks)
        self.shared_experts = None


class DeepseekDecoderLayer(MoEDecoderLayer):
    """MLA, then a dense MLP or DeepSeekMoE."""

    make_attention = staticmethod(make_mla)
    make_experts = staticmethod(DeepseekMoE)


class DeepseekForCausalLM(MoEForCausalLM):
    """DeepseekV2ForCausalLM, DeepseekV3ForCausalLM and Glm4MoeLiteForCausalLM (checkpoint names
    as the published checkpoints and transformers write them)."""

    layer_class = DeepseekDecoderLayer
    mtp_layers = DeepseekMTPLayers  # what the MTP drafter builds and loads (the module docstring)
    num_shards = {"fused_qkv_a_proj": 2, "q_kv_a_proj": 2, "gate_up_proj": 2}
    extra_stacked_params: tuple = ()  # a subclass's further fused parts

    def build_model(
        self, arch: ModelArch, tp: TPInfo, max_position: int, config: Any, dp: DPInfo
    ) -> nn.Module:
        # the projections that read the normed input are one GEMM: the query LoRA's down
        # projection and the latent one, or without a query LoRA the query and the latent one
        fused = "fused_qkv_a_proj" if arch.q_lora_rank is not None else "q_kv_a_proj"
        query = "q_a_proj" if arch.q_lora_rank is not None else "q_proj"
        attention = ((fused, query, 0), (fused, "kv_a_proj_with_mqa", 1))
        mlp = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
        self.stacked_params = attention + mlp + self.extra_stacked_params
        return super().build_model(arch, tp, max_position, config, dp)

    def _needed(self, param: str) -> int:
        """q_proj has no bias: kv_a_proj_with_mqa's alone fills q_kv_a_proj's."""
        if param.endswith(".q_kv_a_proj.bias"):
            return 1
        return super()._needed(param)

    def checkpoint_name(self, name: str) -> str:
        return name.replace(
            ".mlp.gate.e_score_correction_bias", ".mlp.experts.gate.e_score_correction_bias"
        )

"""Mixture-of-experts decoders: Qwen3-MoE (q/k norm), Qwen2-MoE (qkv bias, a shared expert) and,
through workers/models/mixtral.py, Mixtral.

Attention is Llama's (workers/models/llama.py), split over the TP ranks of this rank's DP rank. A
layer's MLP is sparse (`FusedMoE`, workers/layers/moe.py) or dense (`LlamaMLP`) by
`ModelArch.is_moe_layer`. With DP > 1 the sparse layers are where DP ranks meet: each gathers every
DP rank's rows, which is why every rank runs the step's `running_tokens` rows.

Hot path: traced by Dynamo with a dynamic token dimension and recorded into CUDA graphs (see
llama.py); the experts are one opaque op.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import Any, Optional

import torch
from torch import nn

from atomrt.compile.decorators import support_torch_compile
from atomrt.distributed.communication_op import DPInfo, TPInfo, tp_all_reduce
from atomrt.graphs.markers import token_graph
from atomrt.workers.layers.linear import MergedColumnParallelLinear, RowParallelLinear, linear
from atomrt.workers.layers.moe import FusedMoE
from atomrt.workers.layers.norm import RMSNorm
from atomrt.workers.models.arch import ModelArch
from atomrt.workers.models.llama import (
    CausalLM,
    DecoderStack,
    LlamaAttention,
    LlamaMLP,
)


class MoEBlock(nn.Module):
    """A sparse MLP: `self.experts` (a FusedMoE) and whatever `_add_shared` adds beside them; the
    same block runs whole (`forward`) or as a microbatch of two-batch overlap (`forward_ubatch`)."""

    experts: FusedMoE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] (normed) -> [num_tokens, hidden]."""
        return self._add_shared(x, self.experts(x))

    def forward_ubatch(self, x: torch.Tensor) -> Generator[None, None, torch.Tensor]:
        """`forward` as a microbatch of two-batch overlap: pauses where the experts exchange rows."""
        y = yield from self.experts.forward_ubatch(x)
        return self._add_shared(x, y)

    def _add_shared(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y


class SparseMoeBlock(MoEBlock):
    """The experts, plus (Qwen2-MoE) a dense shared expert scaled by sigmoid(shared_expert_gate(x)).
    The shared expert's TP partial sum joins the experts' before the one all-reduce."""

    def __init__(self, arch: ModelArch, tp: TPInfo, dp: DPInfo) -> None:
        super().__init__()
        self.tp = tp
        shared = arch.shared_expert_intermediate_size
        self.experts = FusedMoE(
            arch.num_experts,
            arch.num_experts_per_tok,
            arch.hidden_size,
            arch.moe_intermediate_size,
            arch.norm_topk_prob,
            tp,
            dp,
            reduce_output=not shared,
        )
        self.shared_expert: Optional[nn.Module] = None
        if shared:
            self.shared_expert = SharedExpert(arch.hidden_size, shared, tp)
            self.shared_expert_gate = nn.Parameter(
                torch.empty(1, arch.hidden_size), requires_grad=False
            )

    def _add_shared(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return y
        gate = torch.sigmoid(linear(x, self.shared_expert_gate))  # [num_tokens, 1]
        return tp_all_reduce(y + gate * self.shared_expert(x), self.tp)


class SharedExpert(nn.Module):
    """A gated MLP whose down projection is not reduced (the caller reduces once)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPInfo) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, tp=tp
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, tp=tp, reduce_output=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), gated_input=True)


class MoEDecoderLayer(nn.Module):
    """Attention, then a sparse or a dense MLP. Subclasses change the attention and the sparse
    block (`make_attention`, `make_experts`): an attention module has `in_proj` (the projection
    that reads the normed input, or None) and `forward(positions, projected)`; an experts block
    has `forward` and `forward_ubatch` on the normed rows."""

    # make_attention(arch, layer_idx, tp, max_position) and make_experts(arch, tp, dp)
    make_attention = staticmethod(LlamaAttention)
    make_experts = staticmethod(SparseMoeBlock)

    def __init__(
        self, arch: ModelArch, layer_idx: int, tp: TPInfo, dp: DPInfo, max_position: int
    ) -> None:
        super().__init__()
        self.self_attn = self.make_attention(arch, layer_idx, tp, max_position)
        self.is_sparse = arch.is_moe_layer(layer_idx)
        self.mlp = self.make_experts(arch, tp, dp) if self.is_sparse else LlamaMLP(arch, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, residual: torch.Tensor, update: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: the residual stream comes in and goes out as residual +
        update. A dense MLP takes its add and norm fused into its projection; the experts take the
        normed rows."""
        residual, update = self._attention(positions, residual, update)
        proj = None if self.is_sparse else self.mlp.gate_up_proj
        residual, h = self.post_attention_layernorm.add_project(residual, update, proj)
        return residual, self.mlp(h)

    def forward_ubatch(
        self, positions: torch.Tensor, residual: torch.Tensor, update: Optional[torch.Tensor]
    ) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor]]:
        """`forward` as a microbatch of two-batch overlap: a sparse layer pauses where its experts
        exchange rows with the other DP ranks; a dense layer runs through."""
        if not self.is_sparse:
            return self.forward(positions, residual, update)
        residual, update = self._attention(positions, residual, update)
        residual, h = self.post_attention_layernorm.add_project(residual, update)
        update = yield from self.mlp.forward_ubatch(h)
        return residual, update

    def _attention(
        self, positions: torch.Tensor, residual: torch.Tensor, update: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm, projections and attention: (the residual stream so far, the attention's update)."""
        residual, a = self.input_layernorm.add_project(residual, update, self.self_attn.in_proj)
        return residual, self.self_attn(positions, a)


@token_graph
@support_torch_compile
class MoEModel(DecoderStack):
    """Embeddings + decoder layers + final norm: the unit that is compiled and graph-captured."""

    def __init__(
        self,
        arch: ModelArch,
        tp: TPInfo = TPInfo(),
        dp: DPInfo = DPInfo(),
        max_position: int = 0,
        layer_class: type[MoEDecoderLayer] = MoEDecoderLayer,
    ) -> None:
        max_position = max_position or arch.max_position
        super().__init__(arch, tp, lambda i: layer_class(arch, i, tp, dp, max_position))

    def forward_ubatch(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> Generator[None, None, torch.Tensor]:
        """`forward` as one microbatch of two-batch overlap (workers/runner/ubatch.py): a generator
        that pauses before and after every exchange of rows with the other DP ranks. Eager: the
        compiled `forward` is not used, nor are token graphs."""
        residual, update = self.embed_tokens(input_ids), None
        for layer in self.layers:
            residual, update = yield from layer.forward_ubatch(positions, residual, update)
        return self.norm.add_project(residual, update)[1]


# one expert's projection: mlp.experts.<e>.<proj>.weight, or (FP8 checkpoints) its scales
_EXPERT = re.compile(
    r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale_inv|weight_scale|input_scale)$"
)
# every expert's at once (transformers' fused layout): mlp.experts.gate_up_proj / down_proj
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")
_EXPERT_SHARD = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class MoEForCausalLM(CausalLM):
    """Qwen3-MoE and Qwen2-MoE (checkpoint names as in transformers); Mixtral and the DeepSeek
    family subclass it."""

    layer_class: type[MoEDecoderLayer] = MoEDecoderLayer

    def build_model(
        self, arch: ModelArch, tp: TPInfo, max_position: int, config: Any, dp: DPInfo
    ) -> nn.Module:
        return MoEModel(arch, tp, dp, max_position, config=config, layer_class=self.layer_class)

    def forward_ubatch(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> Generator[None, None, torch.Tensor]:
        """The backbone as one microbatch of two-batch overlap (`MoEModel.forward_ubatch`)."""
        return self.model.forward_ubatch(input_ids, positions)

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name in this module's (Qwen) naming."""
        return name.replace(".mlp.shared_expert_gate.weight", ".mlp.shared_expert_gate")

    def _place(self, name: str) -> tuple[str, object]:
        """(our parameter, shard id) of a checkpoint tensor."""
        m = _EXPERT.match(name)
        if m:
            kind = _EXPERT_SHARD[m.group(3)]
            param = ("w2_" if kind == "down" else "w13_") + m.group(4)
            return f"{m.group(1)}.experts.{param}", (kind, int(m.group(2)))
        m = _FUSED_EXPERTS.match(name)
        if m:
            down = m.group(2) == "down_proj"
            param = "w2_weight" if down else "w13_weight"
            return f"{m.group(1)}.experts.{param}", ("down_all" if down else "gate_up_all", None)
        if ".mlp.gate.weight" in name:  # the router
            return name.replace(".mlp.gate.weight", ".mlp.experts.gate.weight"), None
        return super()._place(name)

    def _covered(self, shard_id: object) -> set:
        """The shards a load filled: one expert's projection, or all experts' at once."""
        if isinstance(shard_id, tuple) and shard_id[0] in ("gate_up_all", "down_all"):
            kinds = ("gate", "up") if shard_id[0] == "gate_up_all" else ("down",)
            return {(k, e) for k in kinds for e in range(self.arch.num_experts)}
        return {shard_id}

    def _needed(self, param: str) -> int:
        """How many distinct shards fill a parameter."""
        if param.endswith("w13_weight"):
            return 2 * self.arch.num_experts
        if param.endswith("w2_weight"):
            return self.arch.num_experts
        return super()._needed(param)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    pass


class Qwen2MoeForCausalLM(MoEForCausalLM):
    pass

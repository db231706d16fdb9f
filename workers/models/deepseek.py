"""The DeepSeek family: DeepSeek-V2 / V2-Lite, DeepSeek-V3 and GLM-4.7-Flash (Glm4MoeLite), one
model class under three architecture names.

A decoder layer is multi-head latent attention (workers/layers/mla.py: the latent KV cache, the
`mla_attention` op) and an MLP: dense in the first `first_k_dense_replace` layers (and those
`moe_layer_freq` skips), else DeepSeekMoE, the routed experts (workers/layers/deepseek_moe.py:
grouped top-k routing over `FusedMoE`) plus ungated shared experts. The backbone, the DP exchange
of the MoE layers and two-batch overlap are the MoE family's (workers/models/qwen3_moe.py).

Multi-token-prediction layers (`num_nextn_predict_layers`, stored as layers
`num_hidden_layers + i`) are not part of this forward. With `speculative_config.method == "mtp"`
the model also holds them, as `mtp` (workers/models/deepseek_mtp.py: `DeepseekDecoderLayer`s that
share this model's embedding and LM head), and loads their tensors; otherwise the loader leaves
them out (`is_mtp_weight`) and says so.

Hot path: traced by Dynamo with a dynamic token dimension and recorded into CUDA graphs (see
llama.py); the attention and the experts are opaque ops.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import nn

from atomrt.distributed.communication_op import DPInfo, TPInfo, tp_all_reduce
from atomrt.workers.layers.deepseek_moe import GroupedRouting, GroupedTopkMoE
from atomrt.workers.layers.mla import MLAAttention
from atomrt.workers.layers.rotary import RotaryEmbedding, yarn_softmax_scale
from atomrt.workers.layers.weight_utils import Sliceable, read_narrow
from atomrt.workers.models.arch import ModelArch
from atomrt.workers.models.deepseek_mtp import MTP_SHARED_COPIES, DeepseekMTP, mtp_checkpoint_name
from atomrt.workers.models.qwen3_moe import (
    MoEBlock,
    MoEDecoderLayer,
    MoEForCausalLM,
    SharedExpert,
)

logger = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def is_mtp_weight(name: str, arch: ModelArch) -> bool:
    """Whether a checkpoint tensor belongs to a multi-token-prediction layer (`model.layers.<i>.*`
    with i >= num_hidden_layers)."""
    m = _LAYER_INDEX.match(name)
    return m is not None and int(m.group(1)) >= arch.num_layers


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


class DeepseekMoE(MoEBlock):
    """The routed experts and the shared ones (n_shared_experts * moe_intermediate_size wide, not
    gated), added before the one TP all-reduce."""

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
        if self.shared_experts is None:
            return y
        return tp_all_reduce(y + self.shared_experts(x), self.tp)


class DeepseekDecoderLayer(MoEDecoderLayer):
    """MLA, then a dense MLP or DeepSeekMoE."""

    @staticmethod
    def make_attention(arch: ModelArch, layer_idx: int, tp: TPInfo, max_position: int) -> nn.Module:
        return make_mla(arch, layer_idx, tp, max_position)

    @staticmethod
    def make_experts(arch: ModelArch, tp: TPInfo, dp: DPInfo) -> nn.Module:
        return DeepseekMoE(arch, tp, dp)


class DeepseekForCausalLM(MoEForCausalLM):
    """DeepseekV2ForCausalLM, DeepseekV3ForCausalLM and Glm4MoeLiteForCausalLM (checkpoint names
    as the published checkpoints and transformers write them)."""

    layer_class = DeepseekDecoderLayer
    num_shards = {"fused_qkv_a_proj": 2, "gate_up_proj": 2}
    extra_stacked_params: tuple = ()  # a subclass's further fused parts

    def __init__(
        self,
        arch: ModelArch,
        tp: TPInfo = TPInfo(),
        max_position: int = 0,
        config: Any = None,
        dp: DPInfo = DPInfo(),
    ) -> None:
        # the query LoRA's down projection and the latent one are one GEMM; without a query LoRA
        # the latent projection stands alone
        fused = (
            (("fused_qkv_a_proj", "q_a_proj", 0), ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1))
            if arch.q_lora_rank is not None
            else ()
        )
        mlp = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
        self.stacked_params = fused + mlp + self.extra_stacked_params
        super().__init__(arch, tp, max_position, config, dp)
        self.mtp: Optional[DeepseekMTP] = None  # the drafter's layers, when speculation is MTP
        spec = getattr(config, "speculative_config", None)
        if spec is not None and spec.method == "mtp":
            self.mtp = DeepseekMTP(
                arch,
                tp,
                dp,
                max_position or arch.max_position,
                self.layer_class,
                self.model.embed_tokens,
                self.lm_head,
            )
        self._skipped_mtp = 0
        self._shared_copies: list[tuple[str, str, torch.Tensor]] = []

    def checkpoint_name(self, name: str) -> str:
        if self.mtp is not None and is_mtp_weight(name, self.arch):
            name = mtp_checkpoint_name(name, self.arch.num_layers)[1]
        return name.replace(
            ".mlp.gate.e_score_correction_bias", ".mlp.experts.gate.e_score_correction_bias"
        )

    def skip_weight(self, name: str) -> bool:
        if not is_mtp_weight(name, self.arch):
            return False
        if self.mtp is None:
            self._skipped_mtp += 1
            return True
        return False

    def load_weights(
        self, weights: Iterable[tuple[str, Sliceable]], where: str = "checkpoint"
    ) -> None:
        """As MoEForCausalLM's. The multi-token-prediction layers' tensors load into `mtp` when it
        is built, their copies of the embedding and LM head checked equal to the target's; without
        it they are left out (the target's forward does not run them), and said so."""
        self._skipped_mtp = 0
        self._shared_copies = []
        super().load_weights(self._set_aside_shared_copies(weights, where), where)
        self._check_shared_copies(where)
        if self._skipped_mtp:
            logger.info(
                "%s: left out %d tensors of the multi-token-prediction layer(s) "
                "model.layers.%d and after (num_nextn_predict_layers=%d): the target model does "
                "not run them",
                where,
                self._skipped_mtp,
                self.arch.num_layers,
                self.arch.num_nextn_predict_layers,
            )

    def _set_aside_shared_copies(
        self, weights: Iterable[tuple[str, Sliceable]], where: str
    ) -> Iterable[tuple[str, Sliceable]]:
        """The weights less an MTP layer's copies of the embedding and LM head, whose shard for this
        rank is read aside (compared once everything is loaded). With `mtp` built, a checkpoint
        without its tensors is an error that says so."""
        num_mtp = 0
        for name, weight in weights:
            if self.mtp is not None and is_mtp_weight(name, self.arch):
                num_mtp += 1
                rest = mtp_checkpoint_name(name, self.arch.num_layers)[1]
                if rest in MTP_SHARED_COPIES:
                    target = MTP_SHARED_COPIES[rest]
                    module = (
                        self.model.embed_tokens if rest == "embed_tokens.weight" else self.lm_head
                    )
                    rows = module.vocab_end - module.vocab_start
                    copy = read_narrow(weight, 0, module.vocab_start, rows)
                    self._shared_copies.append((name, target, copy))
                    continue
            yield name, weight
        if self.mtp is not None and not num_mtp:
            raise ValueError(
                f"{where}: no tensors of the multi-token-prediction layer(s) model.layers."
                f"{self.arch.num_layers} and after (num_nextn_predict_layers="
                f"{self.arch.num_nextn_predict_layers}), which speculative_config.method 'mtp' "
                "drafts with"
            )

    def _check_shared_copies(self, where: str) -> None:
        """The MTP drafter shares the target's embedding and LM head: the checkpoint's copies of
        them must be equal."""
        for name, target, copy in self._shared_copies:
            module = self.model.embed_tokens if target.startswith("model.") else self.lm_head
            mine = module.weight[: copy.shape[0]]
            if tuple(copy.shape) != tuple(mine.shape) or not torch.equal(
                copy.to(mine.device, mine.dtype), mine
            ):
                raise ValueError(
                    f"{where}: {name} differs from {target}; the multi-token-prediction drafter "
                    f"shares the target's {target}"
                )
        self._shared_copies = []

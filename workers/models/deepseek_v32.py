"""DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3
(workers/models/deepseek.py) whose attention is sparse: each query attends the `index_topk`
earlier tokens a lightning indexer picks (workers/layers/dsa_mla.py). GLM-5 rotates the
indexer's query and key in interleaved pairs (V3.2: in halves), and its `indexer_types` "shared"
layers have no indexer: they attend the previous layer's picks. Checkpoint names as transformers
writes them (`self_attn.indexer.wq_b`, `.wk`, `.k_norm`, `.weights_proj`); `wk` and
`weights_proj` join the fused latent projection."""

from __future__ import annotations

import re

from torch import nn

from atomrt.distributed.communication_op import TPInfo
from atomrt.workers.layers.dsa_mla import DSAMLAAttention
from atomrt.workers.models.arch import ModelArch
from atomrt.workers.models.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM, make_mla


def make_dsa_mla(arch: ModelArch, layer_idx: int, tp: TPInfo, max_position: int) -> nn.Module:
    if arch.q_lora_rank is None:
        raise ValueError(
            "DeepseekV32ForCausalLM needs a q_lora_rank (its indexer reads the query LoRA)"
        )
    return make_mla(
        arch,
        layer_idx,
        tp,
        max_position,
        DSAMLAAttention,
        index_n_heads=arch.index_n_heads,
        index_head_dim=arch.index_head_dim,
        index_topk=arch.index_topk,
        shares_topk=layer_idx in arch.index_shared_layers,
        index_rope_interleave=arch.architecture == "GlmMoeDsaForCausalLM",
    )


class DeepseekV32DecoderLayer(DeepseekDecoderLayer):
    make_attention = staticmethod(make_dsa_mla)


class DeepseekV32ForCausalLM(DeepseekForCausalLM):
    layer_class = DeepseekV32DecoderLayer
    num_shards = {"fused_qkv_a_proj": 4, "gate_up_proj": 2}

    # the indexer's key and head weights join the fused latent projection
    extra_stacked_params = (
        ("fused_qkv_a_proj", "indexer.wk", 2),
        ("fused_qkv_a_proj", "indexer.weights_proj", 3),
    )

    def _needed(self, param: str) -> int:
        """The fused projection of a layer that shares the top-k has no indexer parts."""
        m = re.search(r"layers\.(\d+)\.self_attn\.fused_qkv_a_proj\.", param)
        if m is not None and int(m.group(1)) in self.arch.index_shared_layers:
            return 2
        return super()._needed(param)

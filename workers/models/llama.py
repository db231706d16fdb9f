"""Llama-family decoder: Llama 2/3, SmolLM2 (tied embeddings), Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

Hot path: the forward methods are traced by Dynamo with a dynamic token dimension and recorded
into CUDA graphs, so they hold no Python control flow on tensor values (.item(), data-dependent
shapes). All per-step state (KV cache, attention metadata) reaches attention through the
forward context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import nn

from atomrt.compile.decorators import support_torch_compile
from atomrt.distributed.communication_op import DPInfo, TPInfo
from atomrt.graphs.markers import token_graph
from atomrt.workers.layers.attention import Attention
from atomrt.workers.layers.cpu_gemm import reset_packed_weights
from atomrt.workers.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from atomrt.workers.layers.norm import RMSNorm
from atomrt.workers.layers.rotary import RotaryEmbedding
from atomrt.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from atomrt.workers.layers.weight_utils import Sliceable, default_weight_loader
from atomrt.workers.models.arch import ModelArch


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, tp: TPInfo, max_position: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_heads,
            arch.num_kv_heads,
            bias=arch.qkv_bias,
            tp=tp,
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            arch.num_heads * arch.head_dim, arch.hidden_size, bias=False, tp=tp
        )
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        rotary = RotaryEmbedding(arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling)
        self.attn = Attention(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            arch.head_dim,
            arch.head_dim**-0.5,
            rotary=rotary,
        )

    @property
    def in_proj(self) -> QKVParallelLinear:
        """The projection that reads the layer's normed input (`RMSNorm.add_project`)."""
        return self.qkv_proj

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv: `in_proj`'s output [num_tokens, q_size + 2 * kv_size]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(
            q, k, v, positions
        )  # rotary embedding inside; [num_tokens, num_heads * head_dim]
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch, tp: TPInfo) -> None:
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, [size, size], bias=False, tp=tp
        )
        self.down_proj = RowParallelLinear(size, arch.hidden_size, bias=False, tp=tp)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: `gate_up_proj`'s output, projected by the decoder layer (which fuses the norm
        before it into the projection). silu(gate) * up is the down projection's input, fused into
        its matmul for decode batches."""
        return self.down_proj(gate_up, gated_input=True)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, tp: TPInfo, max_position: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, layer_idx, tp, max_position)
        self.mlp = LlamaMLP(arch, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, residual: torch.Tensor, update: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream comes in, and goes out, as residual + update (update None: the
        embeddings alone); each add, its norm and the projection after it are one call
        (`RMSNorm.add_project`)."""
        residual, qkv = self.input_layernorm.add_project(residual, update, self.self_attn.in_proj)
        update = self.self_attn(positions, qkv)
        residual, gate_up = self.post_attention_layernorm.add_project(
            residual, update, self.mlp.gate_up_proj
        )
        return residual, self.mlp(gate_up)


class DecoderStack(nn.Module):
    """Embeddings + decoder layers + final norm, the layers made by `make_layer(i)` (after the
    embeddings, in order). A layer takes (positions, residual, update) and returns the residual
    stream so far and its own update."""

    def __init__(self, arch: ModelArch, tp: TPInfo, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.layers = nn.ModuleList(make_layer(i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64 -> hidden_states [num_tokens, hidden]."""
        residual, update = self.embed_tokens(input_ids), None
        for layer in self.layers:
            residual, update = layer(positions, residual, update)
        return self.norm.add_project(residual, update)[1]


@token_graph
@support_torch_compile
class LlamaModel(DecoderStack):
    """Embeddings + decoder layers + final norm: the unit that is compiled and graph-captured.

    `@support_torch_compile` compiles it at levels 2-3 (the config arrives as `config=`);
    `@token_graph` makes it the TR_HYBRID recording unit.
    """

    def __init__(self, arch: ModelArch, tp: TPInfo = TPInfo(), max_position: int = 0) -> None:
        max_position = max_position or arch.max_position
        super().__init__(arch, tp, lambda i: LlamaDecoderLayer(arch, i, tp, max_position))


# (our fused parameter, checkpoint projection, shard id) of the attention and dense MLPs
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
NUM_SHARDS = {"qkv_proj": 3, "gate_up_proj": 2}  # how many shards fill each


class CausalLM(nn.Module):
    """A decoder (`model`, which a family builds in `build_model`: embeddings, layers, final
    norm) and its LM head, which shares the embedding table when the arch ties them; and the
    loading of its checkpoint, which a family adapts by naming (`checkpoint_name`, `skip_weight`,
    `_place`) and by how many shards fill a parameter (`_covered`, `_needed`)."""

    # (our fused parameter, checkpoint projection, shard id), and how many shards fill each
    stacked_params: tuple[tuple[str, str, object], ...] = STACKED_PARAMS
    num_shards: dict[str, int] = NUM_SHARDS

    def __init__(
        self,
        arch: ModelArch,
        tp: TPInfo = TPInfo(),
        max_position: int = 0,
        config: Any = None,
        dp: DPInfo = DPInfo(),
    ) -> None:
        """Every model's constructor arguments (the loader builds each model with them)."""
        super().__init__()
        self.arch = arch
        self.model = self.build_model(arch, tp, max_position, config, dp)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_model(
        self, arch: ModelArch, tp: TPInfo, max_position: int, config: Any, dp: DPInfo
    ) -> nn.Module:
        """The decoder: embeddings, layers, final norm."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab_size] in the weight's dtype (vocab shards gathered)."""
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(
        self, weights: Iterable[tuple[str, Sliceable]], where: str = "checkpoint"
    ) -> None:
        """Load (Hugging Face name, sliceable tensor) pairs; every parameter must be filled once
        (each of its shards)."""
        params = dict(self.named_parameters())  # a tied lm_head.weight: once, as the embedding
        loaded: dict[str, set] = {}
        for name, weight in weights:
            if "rotary_emb.inv_freq" in name or (
                self.arch.tie_word_embeddings and name == "lm_head.weight"
            ):
                continue
            if self.skip_weight(name):
                continue
            name, shard_id = self._place(self.checkpoint_name(name))
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"{where}: tensor {name!r} has no place in {self.arch.architecture}"
                )
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                default_weight_loader(param, weight)
            else:
                loader(param, weight, shard_id)
            loaded.setdefault(name, set()).update(self._covered(shard_id))
        missing = [n for n in params if len(loaded.get(n, ())) < self._needed(n)]
        if missing:
            raise ValueError(
                f"{where}: missing tensors for {len(missing)} parameters, e.g. {missing[:4]}"
            )
        reset_packed_weights(self)  # loading writes in place, which a packed copy cannot see

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name in this module's naming."""
        return name

    def skip_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor is one this model does not run."""
        return False

    def _place(self, name: str) -> tuple[str, object]:
        """(our parameter, shard id) of a checkpoint tensor."""
        for ours, theirs, sid in self.stacked_params:
            if f".{theirs}." in name:
                return name.replace(f".{theirs}.", f".{ours}."), sid
        return name, None

    def _covered(self, shard_id: object) -> set:
        """The shards a load of `shard_id` filled."""
        return {shard_id}

    def _needed(self, param: str) -> int:
        """How many distinct shards fill a parameter."""
        return next((c for k, c in self.num_shards.items() if f".{k}." in param), 1)


class LlamaForCausalLM(CausalLM):
    def build_model(
        self, arch: ModelArch, tp: TPInfo, max_position: int, config: Any, dp: DPInfo
    ) -> nn.Module:
        """A dense model never communicates across DP ranks, so Llama ignores `dp`."""
        return LlamaModel(arch, tp, max_position, config=config)

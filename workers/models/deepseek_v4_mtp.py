"""DeepSeek-V4's multi-token prediction (MTP): its drafter layers, run by the MTP drafter
(workers/spec_decode/mtp.py) as DeepSeek-V2/V3's are (workers/models/deepseek_mtp.py).

V4's layer keeps the hyper-connected residual streams [n, hc_mult, hidden] from the target to its
head. At position t, with X_t the target's streams after its last decoder layer (before
`hc_head`) for a draft's first pass, and the previous pass's output streams for later ones:

    e    = e_proj(enorm(embed(x_{t+1})))                  [n, hidden]   (broadcast over streams)
    Z    = h_proj(hnorm(X_t)) + e                         [n, hc, hidden]  (hnorm per stream)
    Y    = block(Z)                                       a V4 decoder layer (mHC, attention, MoE)
    p_t  = softmax(head(norm(hc_head(Y))))                predicts x_{t+2}

`block` is a whole V4 decoder layer, layer `num_hidden_layers + i` of the KV cache: sliding-window
attention (the published checkpoints carry no compressor or indexer for it) and top-k routed
experts (its layer id is past the hash-routed ones). `hc_head` (`hc_head_fn`, `hc_head_base`,
`hc_head_scale`) and `norm` are the layer's own; `embed` and `head` are the target's (the
checkpoint has no copies of them).

Checkpoint names, as DeepSeek publishes them: `mtp.<i>.e_proj.weight`, `mtp.<i>.h_proj.weight`,
`mtp.<i>.enorm.weight`, `mtp.<i>.hnorm.weight`, `mtp.<i>.norm.weight`, `mtp.<i>.hc_head_fn` /
`_base` / `_scale`, and the block's own under the layer's names (`mtp.<i>.attn.wq_a.weight`,
`mtp.<i>.hc_attn_fn`, `mtp.<i>.ffn.experts.<e>.w1.weight`, ...). Ours: `mtp.layers.<i>.<rest>`.

The target hands its streams over itself: `bind` points the target's `mtp_streams` at the
drafter's pass-0 buffer, into which the target's forward (eager, compiled or recorded) copies them
every step (`target_writes_hidden`: the drafter copies nothing).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from atomrt.distributed.communication_op import DPInfo, TPInfo
from atomrt.workers.layers.rotary import RotaryEmbedding
from atomrt.workers.layers.v4_hyper import HyperHead
from atomrt.workers.layers.v4_modules import Norm
from atomrt.workers.layers.v4_rows import clear_step_memo
from atomrt.workers.layers.v4_streams import V4SideStreams
from atomrt.workers.models.arch import ModelArch
from atomrt.workers.models.deepseek_v4_arch import SLIDING

# an MTP layer's tensors that are its own (the rest are its decoder block's)
_OWN_PREFIXES = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.")
_HC_HEAD = {
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
}


def mtp_arch(arch: ModelArch) -> ModelArch:
    """`arch` with its MTP layers' types after the target's: sliding attention, top-k routing."""
    v4, n = arch.v4, arch.num_nextn_predict_layers
    return replace(
        arch,
        v4=replace(
            v4,
            layer_types=v4.layer_types + (SLIDING,) * n,
            mlp_layer_types=v4.mlp_layer_types + ("moe",) * n,
        ),
    )


def v4_mtp_checkpoint_name(name: str) -> str:
    """Our name of an MTP tensor `mtp.<i>.<rest>` (or `model.mtp.<i>.<rest>`): the layer's own
    under `mtp.layers.<i>.` (its hyper head's under `hc_head.`), its decoder block's under
    `mtp.layers.<i>.block.` as a target layer's are named (the caller maps `hc_attn_fn` ...)."""
    _, i, rest = name.removeprefix("model.").split(".", 2)
    if rest in _HC_HEAD:
        rest = _HC_HEAD[rest]
    elif not rest.startswith(_OWN_PREFIXES):
        rest = "block." + rest
    return f"mtp.layers.{int(i)}.{rest}"


def is_v4_mtp_weight(name: str) -> bool:
    return name.startswith(("mtp.", "model.mtp."))


class V4MTPLayer(nn.Module):
    """One MTP layer: its input projections and norms, its V4 decoder layer (`block`) and its
    hyper head and norm."""

    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        rotary: dict[str, RotaryEmbedding],
        tp: TPInfo,
        dp: DPInfo,
        side_streams: V4SideStreams,
        block_class: type[nn.Module],
    ) -> None:
        super().__init__()
        h, eps, v4 = arch.hidden_size, arch.rms_norm_eps, arch.v4
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.enorm = Norm(h, eps)
        self.hnorm = Norm(h, eps)
        self.norm = Norm(h, eps)
        self.hc_head = HyperHead(h, v4.hc_mult, v4.hc_eps, eps)
        self.block = block_class(arch, layer_idx, rotary, tp, dp, side_streams)

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
    ) -> torch.Tensor:
        """embeds [n, hidden], streams [n, hc, hidden] -> the block's streams [n, hc, hidden]."""
        e = self.e_proj(self.enorm(embeds).to(embeds.dtype))
        z = self.h_proj(self.hnorm(streams).to(streams.dtype)) + e.unsqueeze(1)
        return self.block(z, positions, input_ids)


class DeepseekV4MTP(nn.Module):
    """The checkpoint's MTP layers, sharing the target's embedding and head (held, not owned).
    The interface `MTPDrafter` runs: `hidden_shape`, `bind`, `layer_for`, `forward`,
    `compute_logits`."""

    # the target fills the drafter's pass-0 buffer itself (`bind`); the drafter copies nothing
    target_writes_hidden = True

    def __init__(
        self,
        arch: ModelArch,
        tp: TPInfo,
        dp: DPInfo,
        max_position: int,
        block_class: type[nn.Module],
        target: Any,
    ) -> None:
        """`target`: the DeepseekV4ForCausalLM whose embedding, head and streams the layers use."""
        super().__init__()
        if arch.num_nextn_predict_layers < 1:
            raise ValueError(
                f"speculative_config.method 'mtp': the {arch.architecture} checkpoint has no "
                "multi-token-prediction layers (num_nextn_predict_layers is 0)"
            )
        full = mtp_arch(arch)
        v4 = full.v4
        rotary = {
            "main": RotaryEmbedding(
                v4.qk_rope_head_dim,
                max_position or arch.max_position,
                v4.main_rope_theta,
                v4.main_rope_scaling,
                True,
            )
        }
        self.layers = nn.ModuleList(
            V4MTPLayer(
                full,
                arch.num_layers + i,
                rotary,
                tp,
                dp,
                target.model.side_streams,
                block_class,
            )
            for i in range(arch.num_nextn_predict_layers)
        )
        self.hidden_shape = (v4.hc_mult, arch.hidden_size)
        self._target = (target,)  # a tuple: not registered as a submodule

    def bind(self, hidden: torch.Tensor) -> None:
        """The target writes its streams [rows, hc, hidden] into `hidden` every forward."""
        self._target[0].model.mtp_streams = hidden

    def layer_for(self, pass_idx: int) -> int:
        """Layer i for pass i, the last one again for passes beyond the layers present."""
        return min(pass_idx, len(self.layers) - 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        layer: int = 0,
    ) -> torch.Tensor:
        """input_ids, positions [n] (each row's next token, the row's position); hidden_states
        [n, hc, hidden] (streams) -> layer `layer`'s output streams [n, hc, hidden]."""
        clear_step_memo()  # a pass's positions and metadata are not the target's
        embeds = self._target[0].model.embed_tokens(input_ids)
        return self.layers[layer](embeds, positions, hidden_states, input_ids)

    def compute_logits(self, hidden_states: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """[n, hc, hidden] (a `forward` output) -> [n, vocab_size] through the layer's hyper head
        and norm and the target's head."""
        mtp = self.layers[layer]
        return self._target[0].compute_logits(mtp.norm(mtp.hc_head(hidden_states)))

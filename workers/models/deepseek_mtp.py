"""Multi-token prediction (MTP): the DeepSeek family's own drafter layers.

A checkpoint with `num_nextn_predict_layers = L` stores L MTP layers after its decoder layers, as
`model.layers.<num_hidden_layers + i>.*`: `enorm` and `hnorm` (RMSNorms), `eh_proj` (hidden x
2 * hidden), one decoder layer (MLA and an MLP: DeepSeekMoE where the target's layers are sparse)
and `shared_head.norm`. Its `embed_tokens` and `shared_head.head` are copies of the target's
embedding and LM head; the drafter shares the target's (the loader checks that they are equal).

The formula (DeepSeek-V3 technical report, section 2.2), at position t:

    h'_t = eh_proj([enorm(embed(x_{t+1})) ; hnorm(h_t)])
    o_t  = block(h'_t)                    (causal attention over the layer's own KV cache)
    p_t  = softmax(lm_head(shared_head.norm(o_t)))   predicts x_{t+2}

where h_t is the target's final hidden state at t (after the target's `model.norm`) for a draft's
first pass, and the previous pass's `o` (before `shared_head.norm`) for later ones.

Loading (`DeepseekMTPLayers`): the target model holds no MTP layer, and its loading leaves their
tensors out (and says so). The MTP drafter builds them as a module of their own, named as the
target would (`mtp.layers.<i>.`), and loads the checkpoint's MTP tensors into it through the
loader's steps (workers/loading/loader.py, `load_weights_into`) and the target family's naming;
their copies of the shared tensors are checked once loaded.

Hot path: a drafter's pass runs `forward` (eagerly, or recorded as a `DraftGraph`); the attention
and the experts are the target's opaque ops.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from atomrt.distributed.communication_op import DPInfo, TPInfo
from atomrt.workers.layers.linear import ColumnParallelLinear
from atomrt.workers.layers.norm import RMSNorm, residual_add
from atomrt.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from atomrt.workers.layers.weight_utils import Sliceable, read_narrow
from atomrt.workers.models.arch import ModelArch
from atomrt.workers.models.llama import CausalLM

logger = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")

# Checkpoint tensors of an MTP layer that are its own (the rest is its decoder layer's)
MTP_OWN_PREFIXES = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
# Checkpoint tensors of an MTP layer that copy the target's: checked, not loaded
MTP_SHARED_COPIES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
}


class SharedHead(nn.Module):
    """The norm before the (shared) LM head."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class MTPLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        tp: TPInfo,
        dp: DPInfo,
        max_position: int,
        block_class: type[nn.Module],
    ) -> None:
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = ColumnParallelLinear(2 * h, h)  # whole on every TP rank
        self.shared_head = SharedHead(h, eps)
        self.mtp_block = block_class(arch, layer_idx, tp, dp, max_position)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """embeds, hidden_states [n, hidden] -> the layer's output [n, hidden] (before
        `shared_head.norm`)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden_states)], dim=-1))
        residual, update = self.mtp_block(positions, x, None)
        return residual_add(residual, update)


class DeepseekMTP(nn.Module):
    """The checkpoint's MTP layers, sharing the target's embedding and LM head (held, not owned:
    the target loads them). Layer i's attention is layer `num_hidden_layers + i` of the KV cache."""

    # the drafter copies the target step's hidden states into its pass-0 buffer (`bind`)
    target_writes_hidden = False

    def __init__(
        self,
        arch: ModelArch,
        tp: TPInfo,
        dp: DPInfo,
        max_position: int,
        block_class: type[nn.Module],
        embed_tokens: VocabParallelEmbedding,
        lm_head: ParallelLMHead,
    ) -> None:
        super().__init__()
        if arch.num_nextn_predict_layers < 1:
            raise ValueError(
                f"{arch.architecture}: the checkpoint has no multi-token-prediction layers "
                "(num_nextn_predict_layers is 0)"
            )
        self.layers = nn.ModuleList(
            MTPLayer(arch, arch.num_layers + i, tp, dp, max_position, block_class)
            for i in range(arch.num_nextn_predict_layers)
        )
        self._shared = (embed_tokens, lm_head)  # a tuple: not registered as submodules
        self.hidden_shape = (arch.hidden_size,)  # a row's hidden state

    def bind(self, hidden: torch.Tensor) -> None:
        """The drafter's pass-0 buffer: it copies the target's hidden states there itself."""

    def layer_for(self, pass_idx: int) -> int:
        """The layer a drafter's pass `pass_idx` (0-based) runs: layer i for pass i, the last one
        again for passes beyond the layers present."""
        return min(pass_idx, len(self.layers) - 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        layer: int = 0,
    ) -> torch.Tensor:
        """input_ids, positions [n] int64 (each row's next token, and the row's position);
        hidden_states [n, hidden] -> [n, hidden], layer `layer`'s output before its head norm."""
        embeds = self._shared[0](input_ids)
        return self.layers[layer](embeds, positions, hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """[n, hidden] (a `forward` output) -> [n, vocab_size], through the shared LM head."""
        return self._shared[1].compute_logits(self.layers[layer].shared_head.norm(hidden_states))


def mtp_checkpoint_name(name: str, num_layers: int) -> tuple[int, str]:
    """(MTP layer index, our name) of checkpoint tensor `model.layers.<num_layers + i>.<rest>`:
    the layer's own tensors under `mtp.layers.<i>.`, its decoder layer's under
    `mtp.layers.<i>.mtp_block.`; a shared copy keeps `<rest>` alone."""
    rest = name.split(".", 3)[3]
    i = int(name.split(".", 3)[2]) - num_layers
    if rest in MTP_SHARED_COPIES:
        return i, rest
    if rest.startswith(MTP_OWN_PREFIXES):
        return i, f"mtp.layers.{i}.{rest}"
    return i, f"mtp.layers.{i}.mtp_block.{rest}"


def is_mtp_weight(name: str, arch: ModelArch) -> bool:
    """Whether a checkpoint tensor belongs to a multi-token-prediction layer (`model.layers.<i>.*`
    with i >= num_hidden_layers)."""
    m = _LAYER_INDEX.match(name)
    return m is not None and int(m.group(1)) >= arch.num_layers


class DeepseekMTPLayers(CausalLM):
    """The MTP drafter's layers as a model of their own (`mtp`: DeepseekMTP), loaded as the
    target's family loads its checkpoint (`CausalLM.load_weights` with the target's
    `checkpoint_name`, `_place`, `_covered` and `_needed`): only the MTP layers' tensors, their
    copies of the target's embedding and LM head read aside and checked equal to the target's.
    Built by `load_mtp_layers` (workers/loading/loader.py) from the target's `mtp_layers`."""

    def __init__(self, target: Any, tp: TPInfo, dp: DPInfo, max_position: int) -> None:
        """`target`: the DeepseekForCausalLM (or subclass) whose embedding and LM head the layers
        share, and whose naming their tensors load by."""
        nn.Module.__init__(self)
        self.arch = target.arch
        self._target = (target,)  # a tuple: not registered as a submodule
        embed_tokens, lm_head = target.model.embed_tokens, target.lm_head
        self.mtp = DeepseekMTP(
            self.arch, tp, dp, max_position, target.layer_class, embed_tokens, lm_head
        )
        self._shared = {"embed_tokens.weight": embed_tokens, "shared_head.head.weight": lm_head}
        self._copies: list[tuple[str, str, torch.Tensor, nn.Module]] = []

    @staticmethod
    def holds(name: str, arch: ModelArch) -> bool:
        """Whether a checkpoint tensor is an MTP layer's."""
        return is_mtp_weight(name, arch)

    @staticmethod
    def left_out(count: int, arch: ModelArch, where: str) -> None:
        """Say that the target's loading left the MTP layers' `count` tensors out."""
        logger.info(
            "%s: left out %d tensors of the multi-token-prediction layer(s) model.layers.%d and "
            "after (num_nextn_predict_layers=%d): the target model does not run them",
            where,
            count,
            arch.num_layers,
            arch.num_nextn_predict_layers,
        )

    def checkpoint_name(self, name: str) -> str:
        return self._target[0].checkpoint_name(mtp_checkpoint_name(name, self.arch.num_layers)[1])

    def _place(self, name: str) -> tuple[str, object]:
        return self._target[0]._place(name)

    def _covered(self, shard_id: object) -> set:
        return self._target[0]._covered(shard_id)

    def _needed(self, param: str) -> int:
        return self._target[0]._needed(param)

    def load_weights(
        self, weights: Iterable[tuple[str, Sliceable]], where: str = "checkpoint"
    ) -> None:
        """The checkpoint's MTP tensors (`model.layers.<num_hidden_layers + i>.*`); a checkpoint
        without any is an error that says so."""
        super().load_weights(self._set_aside(weights, where), where)
        self._check(where)

    def _set_aside(
        self, weights: Iterable[tuple[str, Sliceable]], where: str
    ) -> Iterable[tuple[str, Sliceable]]:
        """The weights less the MTP layers' copies of the embedding and LM head, whose shard for
        this rank is read aside (compared in `_check`)."""
        self._copies = []
        num_mtp = 0
        for name, weight in weights:
            if not is_mtp_weight(name, self.arch):
                raise ValueError(f"{where}: {name} is not a multi-token-prediction layer's")
            num_mtp += 1
            rest = mtp_checkpoint_name(name, self.arch.num_layers)[1]
            if rest in MTP_SHARED_COPIES:
                module = self._shared[rest]
                rows = module.vocab_end - module.vocab_start
                copy = read_narrow(weight, 0, module.vocab_start, rows)
                self._copies.append((name, MTP_SHARED_COPIES[rest], copy, module))
                continue
            yield name, weight
        if not num_mtp:
            raise ValueError(
                f"{where}: no tensors of the multi-token-prediction layer(s) model.layers."
                f"{self.arch.num_layers} and after (num_nextn_predict_layers="
                f"{self.arch.num_nextn_predict_layers}), which speculative_config.method 'mtp' "
                "drafts with"
            )

    def _check(self, where: str) -> None:
        """The MTP drafter shares the target's embedding and LM head, so the checkpoint's copies
        of them must be equal."""
        for name, target, copy, module in self._copies:
            mine = module.weight[: copy.shape[0]]
            if tuple(copy.shape) != tuple(mine.shape) or not torch.equal(
                copy.to(mine.device, mine.dtype), mine
            ):
                raise ValueError(
                    f"{where}: {name} differs from {target}; the multi-token-prediction drafter "
                    f"shares the target's {target}"
                )
        self._copies = []

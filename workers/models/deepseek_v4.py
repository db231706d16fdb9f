"""DeepSeek-V4 (DeepseekV4ForCausalLM): hyper-connected residual streams around attention over a
sliding window plus compressed entries, and hash-routed or top-k-routed experts.

    h       = embed(input_ids), copied into hc_mult streams               [n, hc, hidden]
    layer i:  post, comb, x = hc_attn(h)                                   (workers/layers/v4_hyper.py)
              h = post * attn(attn_norm(x)) + comb^T h                     (workers/layers/v4_attention.py)
              post, comb, x = hc_ffn(h)
              h = post * ffn(ffn_norm(x), input_ids) + comb^T h            (workers/layers/v4_moe.py)
    hidden  = norm(hc_head(h))
    logits  = head(hidden)

`layer_types[i]` is layer i's attention (sliding window; CSA: window + indexer-selected compressed
entries; HCA: window + every compressed entry), `mlp_layer_types[i]` its routing (`hash_moe`:
`tid2eid[input_ids]`; `moe`: top-k). The hash routing reads the step's token ids, so the token
graph's recording unit (`@token_graph`) is `DeepseekV4ForCausalLM` itself, the unit that holds
every per-token piece of the step; the backbone `DeepseekV4Model` is what torch.compile traces.
Under TR_HYBRID it records decode buckets only (`token_graph_phases`): a prefill step runs
eagerly, and no dummy prefill is recorded.

Recorded structure of a layer (docs/compilation-and-graphs.md): the compressor launch
(`v4_attn_compress_launch`, a splitting op sized by the row count) inline, ahead of the query and
key projections, on the model's side stream (`side_streams`) on CUDA, joined back by the attention
op before its eager region, in the same segment; a compressed layer's one eager region, planned
from the step's sequences (CSA the indexer's scores and top-k, HCA its attention); everything else
inline (the attention of sliding and CSA layers too).

Checkpoints: the names DeepSeek publishes and transformers writes back (`layers.<i>.attn.wq_a`,
`...compressor.wkv`, `...indexer.wq_b`, `ffn.experts.<e>.w1`, `hc_attn_fn`, `hc_head_fn`, `head`,
...), with or without transformers' `model.` prefix. The multi-token-prediction layers (`mtp.*`)
are not part of this model: its loading leaves them out. The MTP drafter builds and loads them
itself (`mtp_layers`: `DeepseekV4MTPLayers`, workers/models/deepseek_v4_mtp.py's layers).
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Generator, Iterable
from typing import Any, Optional

import torch
from torch import nn

from atomrt.compile.decorators import support_torch_compile
from atomrt.distributed.communication_op import DPInfo, TPInfo, dp_all_gather
from atomrt.graphs.markers import token_graph
from atomrt.workers.layers.rotary import RotaryEmbedding
from atomrt.workers.layers.v4_attention import V4Attention
from atomrt.workers.layers.v4_hyper import HyperConnection, HyperHead, hyper_residual
from atomrt.workers.layers.v4_modules import Norm
from atomrt.workers.layers.v4_moe import V4MoE
from atomrt.workers.layers.v4_rows import clear_step_memo
from atomrt.workers.layers.v4_streams import V4SideStreams
from atomrt.workers.layers.weight_utils import Sliceable, read_all, read_narrow, shape_of
from atomrt.workers.models.arch import ModelArch
from atomrt.workers.models.deepseek_v4_mtp import (
    DeepseekV4MTP,
    is_v4_mtp_weight,
    v4_mtp_checkpoint_name,
)

logger = logging.getLogger(__name__)

_RENAMES = (  # the published names of the top-level tensors -> ours
    ("embed.weight", "model.embed_tokens.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
)
_EXPERT = re.compile(r"^(.*\.ffn)\.experts\.(\d+)\.(w[123])\.weight$")
_LAYER_RENAMES = tuple(  # a layer's mHC tensors -> its HyperConnection modules'
    (f".hc_{block}_{part}", f".{block}_hc.{part}")
    for block in ("attn", "ffn")
    for part in ("fn", "base", "scale")
)


class V4DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        i: int,
        rotary: dict[str, RotaryEmbedding],
        tp: TPInfo,
        dp: DPInfo,
        side_streams: V4SideStreams,
    ) -> None:
        super().__init__()
        v4 = arch.v4
        layer_type = v4.layer_types[i]
        hc = (arch.hidden_size, v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps, arch.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)
        self.attn_norm = Norm(arch.hidden_size, arch.rms_norm_eps)
        self.ffn_norm = Norm(arch.hidden_size, arch.rms_norm_eps)
        self.attn = V4Attention(
            i,
            layer_type,
            arch.hidden_size,
            arch.num_heads,
            arch.head_dim,
            arch.q_lora_rank,
            v4.qk_rope_head_dim,
            v4.sliding_window,
            v4.compress_rate(layer_type),
            v4.o_groups,
            v4.o_lora_rank,
            v4.index_n_heads,
            v4.index_head_dim,
            v4.index_topk,
            arch.rms_norm_eps,
            rotary["main" if layer_type == "sliding_attention" else "compress"],
            tp,
            side_streams,
            anchor_stride=v4.anchor_stride,
        )
        self.ffn = V4MoE(
            arch.hidden_size,
            arch.moe_intermediate_size,
            arch.num_experts,
            arch.num_experts_per_tok,
            arch.n_shared_experts,
            v4.scoring_func,
            arch.routed_scaling_factor,
            v4.swiglu_limit,
            v4.mlp_layer_types[i] == "hash_moe",
            arch.vocab_size,
            tp,
            dp,
        )

    def forward(
        self, streams: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = hyper_residual(streams, post, comb, self.attn(self.attn_norm(x), positions))
        post, comb, x = self.ffn_hc(streams)
        return hyper_residual(streams, post, comb, self.ffn(self.ffn_norm(x), input_ids))

    def forward_ubatch(
        self, streams: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor
    ) -> Generator[None, None, torch.Tensor]:
        post, comb, x = self.attn_hc(streams)
        streams = hyper_residual(streams, post, comb, self.attn(self.attn_norm(x), positions))
        post, comb, x = self.ffn_hc(streams)
        out = yield from self.ffn.forward_ubatch(self.ffn_norm(x), input_ids)
        return hyper_residual(streams, post, comb, out)


@support_torch_compile
class DeepseekV4Model(nn.Module):
    """Embedding, decoder layers, hyper head and final norm: what torch.compile traces."""

    def __init__(
        self,
        arch: ModelArch,
        max_position: int = 0,
        tp: TPInfo = TPInfo(),
        dp: DPInfo = DPInfo(),
    ) -> None:
        super().__init__()
        v4 = arch.v4
        max_position = max_position or arch.max_position
        # one table per rotary set, shared by every layer of that set
        rotary = {
            "main": RotaryEmbedding(
                v4.qk_rope_head_dim, max_position, v4.main_rope_theta, v4.main_rope_scaling, True
            ),
            "compress": RotaryEmbedding(
                v4.qk_rope_head_dim,
                max_position,
                v4.compress_rope_theta,
                v4.compress_rope_scaling,
                True,
            ),
        }
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        # the compressors' side stream, one for the model (made on first CUDA use)
        self.side_streams = V4SideStreams()
        self.layers = nn.ModuleList(
            V4DecoderLayer(arch, i, rotary, tp, dp, self.side_streams)
            for i in range(arch.num_layers)
        )
        self.hc_head = HyperHead(arch.hidden_size, v4.hc_mult, v4.hc_eps, arch.rms_norm_eps)
        self.norm = Norm(arch.hidden_size, arch.rms_norm_eps)
        self.hc_mult = v4.hc_mult
        self.dp = dp
        # the MTP drafter's buffer [rows, hc, hidden] for the last layer's streams (its `bind`)
        self.mtp_streams: Optional[torch.Tensor] = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [n] int64 -> hidden_states [n, hidden]."""
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        # the hash routing reads every DP rank's token ids (its experts run on every rank's rows)
        all_ids = dp_all_gather(input_ids, self.dp)
        for layer in self.layers:
            streams = layer(streams, positions, all_ids)
        if self.mtp_streams is not None:  # the MTP drafter's first pass reads them
            self.mtp_streams[: streams.shape[0]].copy_(streams)
        return self.norm(self.hc_head(streams))

    def forward_ubatch(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> Generator[None, None, torch.Tensor]:
        """`forward` as one microbatch of two-batch overlap (workers/runner/ubatch.py): pauses
        before and after every exchange with the other DP ranks. Eager."""
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        all_ids = input_ids
        if self.dp.dp_size > 1:
            yield
            all_ids = dp_all_gather(input_ids, self.dp)
            yield
        for layer in self.layers:
            streams = yield from layer.forward_ubatch(streams, positions, all_ids)
        return self.norm(self.hc_head(streams))


def v4_checkpoint_name(name: str) -> str:
    """Our name of a checkpoint tensor, published (`layers.0.hc_attn_fn`) or as transformers
    writes it back (`model.layers.0.hc_attn_fn`)."""
    if is_v4_mtp_weight(name):  # an MTP layer's: `mtp.layers.<i>.` and the layer's names
        name = v4_mtp_checkpoint_name(name)
    for theirs, ours in _RENAMES:
        if name.removeprefix("model.").startswith(theirs):
            return ours + name.removeprefix("model.")[len(theirs) :]
    if not name.startswith(("model.", "head.", "mtp.")):
        name = "model." + name
    for theirs, ours in _LAYER_RENAMES:
        if name.endswith(theirs):
            return name[: -len(theirs)] + ours
    return name


def load_v4_weights(root: nn.Module, weights: Iterable[tuple[str, Sliceable]], where: str) -> None:
    """(name, tensor) pairs under the published names into `root` (the model, or the MTP layers
    of `DeepseekV4MTPLayers`), each to its parameter (this rank's part of a TP-split one) or to
    its routed expert; every parameter and hash table of `root` must be filled once."""
    tp: TPInfo = root.tp
    targets = dict(root.named_parameters())
    targets.update((n, b) for n, b in root.named_buffers() if n.endswith("tid2eid"))
    loaded: dict[str, int] = {}
    for name, weight in weights:
        if "rotary_emb" in name:
            continue
        ours = v4_checkpoint_name(name)
        expert = _EXPERT.match(ours)
        if expert is not None:
            moe = root.get_submodule(expert.group(1))
            e, proj = int(expert.group(2)), expert.group(3)
            whole = moe.intermediate_size * tp.tp_size * moe.dp.dp_size
            hidden = moe.w13.shape[2]
            if e >= moe.num_experts or shape_of(weight) != (
                (hidden, whole) if proj == "w2" else (whole, hidden)
            ):
                raise ValueError(f"{where}: {name} does not fit {expert.group(1)}'s experts")
            moe.load_expert(e, proj, weight)
            key = f"{expert.group(1)}.{'w2' if proj == 'w2' else 'w13'}"
            loaded[key] = loaded.get(key, 0) + 1
            continue
        target = targets.get(ours)
        if target is None:
            raise ValueError(f"{where}: tensor {name!r} has no place in {type(root).__name__}")
        dim = getattr(target, "tp_shard_dim", None)
        if dim is None:
            tensor = read_all(weight)
        else:  # this rank's part of a tensor split over TP ranks
            size = target.shape[dim]
            if shape_of(weight)[dim] != size * tp.tp_size:
                raise ValueError(
                    f"{where}: {name} is {shape_of(weight)}, which does not split into "
                    f"tensor_parallel_size={tp.tp_size} parts of the model's "
                    f"{tuple(target.shape)}"
                )
            tensor = read_narrow(weight, dim, tp.tp_rank * size, size)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{where}: {name} is {tuple(tensor.shape)}, the model's {ours} is "
                f"{tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor.to(target.device, target.dtype))
        loaded[ours] = loaded.get(ours, 0) + 1

    def fills(n: str) -> int:  # w13 takes two tensors per expert, w2 one
        if n.endswith(".w13") or n.endswith(".w2"):
            e = root.get_submodule(n.rsplit(".", 1)[0]).num_experts
            return 2 * e if n.endswith(".w13") else e
        return 1

    missing = [n for n in targets if loaded.get(n, 0) < fills(n)]
    if missing:
        raise ValueError(
            f"{where}: missing tensors for {len(missing)} parameters, e.g. {missing[:4]}"
        )


class DeepseekV4MTPLayers(nn.Module):
    """The MTP drafter's layers as a model of their own (`mtp`: DeepseekV4MTP), named as the
    target would hold them (`mtp.layers.<i>.`) and loaded as the target loads its checkpoint
    (`load_v4_weights`): only the MTP layers' tensors (`mtp.*`). Built by `load_mtp_layers`
    (workers/loading/loader.py) from the target's `mtp_layers`."""

    checkpoint_name = staticmethod(v4_checkpoint_name)  # the FP8 layers' names (v4_fp8.py)

    def __init__(self, target: Any, tp: TPInfo, dp: DPInfo, max_position: int) -> None:
        """`target`: the DeepseekV4ForCausalLM whose embedding, head and streams the layers use."""
        super().__init__()
        self.tp, self.arch = tp, target.arch
        self.mtp = DeepseekV4MTP(target.arch, tp, dp, max_position, V4DecoderLayer, target)

    @staticmethod
    def holds(name: str, arch: ModelArch) -> bool:
        """Whether a checkpoint tensor is an MTP layer's."""
        return is_v4_mtp_weight(name)

    @staticmethod
    def left_out(count: int, arch: ModelArch, where: str) -> None:
        """Say that the target's loading left the MTP layers' `count` tensors out."""
        logger.info(
            "%s: left out %d tensors of the multi-token-prediction layer(s) (mtp.*): the "
            "target model does not run them",
            where,
            count,
        )

    def load_weights(
        self, weights: Iterable[tuple[str, Sliceable]], where: str = "checkpoint"
    ) -> None:
        """The checkpoint's MTP tensors; a checkpoint without any is an error that says so."""
        weights = iter(weights)
        first = next(weights, None)
        if first is None:
            raise ValueError(
                f"{where}: no tensors of the multi-token-prediction layer(s) mtp.* "
                f"(num_nextn_predict_layers={self.arch.num_nextn_predict_layers}), which "
                "speculative_config.method 'mtp' drafts with"
            )
        load_v4_weights(self, itertools.chain([first], weights), where)


@token_graph
class DeepseekV4ForCausalLM(nn.Module):
    # TR_HYBRID records decode buckets only: a prefill step runs eagerly
    token_graph_phases = ("decode",)
    mtp_layers = DeepseekV4MTPLayers  # what the MTP drafter builds and loads (the module docstring)
    checkpoint_name = staticmethod(v4_checkpoint_name)

    def __init__(
        self,
        arch: ModelArch,
        tp: TPInfo = TPInfo(),
        max_position: int = 0,
        config: Any = None,
        dp: DPInfo = DPInfo(),
    ) -> None:
        super().__init__()
        self.tp = tp
        self.arch = arch
        self.model = DeepseekV4Model(arch, max_position, tp, dp, config=config)
        self.head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [n] int64 -> hidden_states [n, hidden]. The layers' shared index
        arithmetic is made anew for each forward (workers/layers/v4_rows.py, `step_memo`)."""
        clear_step_memo()
        return self.model(input_ids, positions)

    def forward_ubatch(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> Generator[None, None, torch.Tensor]:
        clear_step_memo()  # the microbatch's own forward context's
        return (yield from self.model.forward_ubatch(input_ids, positions))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.head(hidden_states)

    def load_weights(
        self, weights: Iterable[tuple[str, Sliceable]], where: str = "checkpoint"
    ) -> None:
        """(name, tensor) pairs under the published names; every parameter and hash table must be
        filled once."""
        load_v4_weights(self, weights, where)

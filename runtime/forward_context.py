"""The forward context: the one ambient per-step state that layers read during a forward pass.

Captured CUDA graphs cannot take new arguments, so everything that changes per step (attention
metadata, the step's shape, DP token counts) reaches the layers through this side channel.
This module is a leaf: it imports no other atomrt module.

Lifecycle (the guide's set-use-reset): `set_forward_context(...)` sets the context at once and
returns a scope; used as `with set_forward_context(...):` the scope resets in `finally`.
`reset_forward_context()` replaces the context with an empty `ForwardContext()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch

TrGraphPhase = Optional[Literal["record", "replay"]]


@dataclass
class Context:
    """The most frequently read per-step state."""

    positions: Optional[torch.Tensor] = None  # [num_tokens] token position ids
    is_prefill: bool = False  # whether this step runs any prompt (prefill) rows
    batch_size: int = 0  # sequences in the batch (real, unpadded)
    running_bs: int = 0  # padded SEQUENCE count: graph lookup, draft width
    running_tokens: int = 0  # padded ROW count: what MoE all_gather pads to
    is_draft: bool = False  # whether this is a draft model forward


@dataclass
class AttentionMetaData:
    """Metadata of one step's attention, laid out for the paged KV cache.

    Device tensors are views of the runner's static buffers when a graph may replay them.
    The `*_cpu` lists are host copies that a host-planned (eager-region) launch may read.
    Rows past `cu_seqlens_q[-1]` are padding: their slots are -1 and their output is unused.
    """

    cu_seqlens_q: Optional[torch.Tensor] = None  # [bs + 1] int32, query rows per sequence
    context_lens: Optional[torch.Tensor] = None  # [bs] int32, KV length after this step's write
    block_tables: Optional[torch.Tensor] = None  # [bs, max_blocks] int32, -1 past the end
    slot_mapping: Optional[torch.Tensor] = None  # [num_tokens] int64, -1 for padded rows
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    num_seqs: int = 0  # real sequences (rows of block_tables past this are padding)
    num_tokens: int = 0  # real query rows (cu_seqlens_q[num_seqs])
    cu_seqlens_q_cpu: Optional[list[int]] = None
    context_lens_cpu: Optional[list[int]] = None
    # True when the step replays (or records) a FULL request graph: the attention launch must then
    # depend only on the bucket and read every length from the device buffers above.
    graph_safe: bool = False
    # Two-batch overlap: the microbatch (0 or 1) this metadata belongs to. The two microbatches'
    # attention launches may run at once, on two streams, so each has its own split counters.
    ubatch: int = 0


@dataclass
class DPMetadata:
    """Row counts across data-parallel ranks for one step: each rank's real rows and the rows it
    runs. Every rank runs the same padded count (`max_tokens_across_dp`, the step's
    `running_tokens`): a MoE layer's gather across DP ranks is that many rows from each. At capture
    every rank records the same bucket, `running_tokens_per_dp_rank = [running_tokens] * dp_size`."""

    num_tokens_across_dp: list[int] = field(default_factory=list)  # real rows per DP rank
    max_tokens_across_dp: int = 0  # the padded row count every rank runs
    running_tokens_per_dp_rank: list[int] = field(default_factory=list)  # rows each rank runs

    @classmethod
    def make(cls, num_tokens_across_dp: list[int], padded_tokens: int) -> DPMetadata:
        real = list(num_tokens_across_dp)
        return cls(real, padded_tokens, [padded_tokens] * len(real))

    @classmethod
    def for_capture(cls, dp_size: int, running_tokens: int) -> DPMetadata:
        """A recording's: every rank runs (and records) `running_tokens` rows."""
        return cls.make([running_tokens] * dp_size, running_tokens)

    @property
    def num_padded_tokens(self) -> int:
        """Rows run beyond the real ones, over all DP ranks."""
        return sum(self.running_tokens_per_dp_rank) - sum(self.num_tokens_across_dp)


@dataclass
class SpecDecodeMetadata:
    """Speculative-decoding metadata of a step whose rows verify drafts: the draft tokens and where
    their logits are. Set by the worker's Speculator for the target's forward; its rejection
    sampler reads it after."""

    draft_token_ids: Optional[torch.Tensor] = None  # int64 [sum(num_draft_tokens)], in order
    num_draft_tokens: list[int] = field(default_factory=list)  # per sampled sequence
    # the rows whose logits are sampled: each sampled sequence's drafts' rows and the row before
    logits_indices: Any = None  # int64 tensor, or a slice when every row is sampled
    draft_probs: Optional[torch.Tensor] = None  # [sum(num_draft_tokens), vocab]: the draft
    # model's distributions the drafts were drawn from (None: greedy drafts, or one-hot n-gram)
    # A plain greedy step's verify layout, staged before the forward so that verifying needs no
    # host data after it: per sampled sequence, the logits row of each of its k + 1 positions
    # (the last one repeated past its drafts), and its drafts, -1 past them ([n, k + 1], [n, k]).
    greedy_rows: Optional[torch.Tensor] = None
    greedy_drafts: Optional[torch.Tensor] = None


@dataclass
class ForwardContext:
    no_compile_layers: dict[int, Any] = field(default_factory=dict)  # layer index -> layer
    attn_metadata: Any = None  # AttentionMetaData, or a dict of them by layer group
    kv_cache_data: dict[str, Any] = field(default_factory=dict)  # layer name -> KV cache tensors
    context: Context = field(default_factory=Context)
    dp_metadata: Optional[DPMetadata] = None
    spec_decode_metadata: Optional[SpecDecodeMetadata] = None
    config: Any = None  # the engine's Config
    tr_graph: TrGraphPhase = None  # "record" at capture, "replay" on a recorded token bucket
    # TR_HYBRID decode at a request bucket: "record" (decode pass) also records what `tr_request`
    # (a RegionRequest, graphs/region_graph.py) asks for, the eager regions' launches for its
    # bucket among them; "replay" with `tr_req_key` (running_bs, draft_num) runs the recording
    # with them, as one launch
    tr_req_key: Optional[tuple[int, int]] = None
    tr_request: Any = None
    # device tensors a model's layers share within one forward (their index arithmetic, made
    # once: workers/layers/v4_rows.py `step_memo`); the model empties it as each forward starts
    step_memo: dict[Any, Any] = field(default_factory=dict)


_forward_context: ForwardContext = ForwardContext()


class _ForwardContextScope:
    """Returned by `set_forward_context`; resets the context when used as a context manager."""

    __slots__ = ("previous",)

    def __init__(self, previous: ForwardContext) -> None:
        self.previous = previous

    def __enter__(self) -> ForwardContext:
        return _forward_context

    def __exit__(self, *exc: object) -> None:
        reset_forward_context()


def set_forward_context(
    attn_metadata: Any,
    config: Any,
    context: Context,
    *,
    no_compile_layers: Optional[dict[int, Any]] = None,
    kv_cache_data: Optional[dict[str, Any]] = None,
    dp_metadata: Optional[DPMetadata] = None,
    spec_decode_metadata: Optional[SpecDecodeMetadata] = None,
    tr_graph: TrGraphPhase = None,
    tr_req_key: Optional[tuple[int, int]] = None,
    tr_request: Any = None,
) -> _ForwardContextScope:
    """Set the forward context for one forward pass; `with` it to reset in `finally`."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(
        no_compile_layers=no_compile_layers if no_compile_layers is not None else {},
        attn_metadata=attn_metadata,
        kv_cache_data=kv_cache_data if kv_cache_data is not None else {},
        context=context,
        dp_metadata=dp_metadata,
        spec_decode_metadata=spec_decode_metadata,
        config=config,
        tr_graph=tr_graph,
        tr_req_key=tr_req_key,
        tr_request=tr_request,
    )
    return _ForwardContextScope(previous)


def get_forward_context() -> ForwardContext:
    return _forward_context


def use_forward_context(context: ForwardContext) -> ForwardContext:
    """Make `context` the current one and return the one it replaces. Two-batch overlap switches
    between its microbatches' contexts with it, inside the step's `set_forward_context` scope."""
    global _forward_context
    previous, _forward_context = _forward_context, context
    return previous


def reset_forward_context() -> None:
    global _forward_context
    _forward_context = ForwardContext()

"""The attention layer and its one custom op, `torch.ops.atomrt.unified_attention_with_output`.

The op is opaque to Dynamo (a splitting op at compile level 3, an eager region in token graphs):
it reads the step's metadata and this layer's KV cache from the forward context, applies the
layer's rotary embedding to q and k when given `positions`, writes k/v at slot_mapping, and
computes causal attention over each sequence's context into `output`.
CPU: the torch reference (attention_ref). CUDA: `decode_attention.attention_step` (workers/kernels):
a decode batch, one row per sequence, is a single launch; other batches take paged_attention's
rotary + KV write and its unified attention.
"""

# No `from __future__ import annotations` here: the op's schema is inferred from real annotations.

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from atomrt.compile.custom_register import direct_register_custom_op
from atomrt.graphs.markers import eager_region
from atomrt.runtime.forward_context import get_forward_context
from atomrt.workers.kernels import launch as launch_module
from atomrt.workers.layers.attention_ref import (
    causal_attention_no_cache,
    paged_attention_ref,
    write_kv_cache_ref,
)
from atomrt.workers.layers.kv_spec import KVLayerSpec
from atomrt.workers.layers.paged_rows import returns_nothing
from atomrt.workers.layers.rotary import RotaryEmbedding


def _host_list(cpu: "list[int] | None", device_tensor: "torch.Tensor | None") -> "list[int]":
    return list(cpu) if cpu is not None else device_tensor.tolist()


def paged_layer_state(layer_idx: int) -> "tuple[PagedAttentionLayer, object, object]":
    """(layer, its attention metadata, its KV cache or None) from the forward context."""
    ctx = get_forward_context()
    layer = ctx.no_compile_layers.get(layer_idx)
    if layer is None:
        raise RuntimeError(
            f"attention layer {layer_idx} is not in forward_context.no_compile_layers"
        )
    md = ctx.attn_metadata
    if isinstance(md, dict):
        md = md[f"layers.{layer_idx}"]
    return layer, md, ctx.kv_cache_data.get(f"layers.{layer_idx}")


def unified_attention_with_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    output: torch.Tensor,
    positions: Optional[torch.Tensor],
    layer_idx: int,
) -> None:
    """q/output [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
    positions [num_tokens] int64, or None when the layer has no rotary embedding.

    On CUDA all of it -- rotary, KV write, attention -- is one `@eager_region`, `_attend_cuda`:
    under TR_HYBRID it breaks the token-graph recording and runs eagerly at replay with the live
    step's metadata (host-planned launches; a decode step is one fused launch); under FULL it is
    recorded inline with the graph-safe launch (`attn_metadata.graph_safe`), which TR_HYBRID also
    records per decode bucket as the region's request graph. On CPU the rotary and
    the KV write run in the recording and `_attend`, the eager region, runs the torch reference."""
    layer, md, kv = paged_layer_state(layer_idx)
    rotary = layer.rotary if positions is not None else None  # Attention.forward pairs them
    if kv is None or md is None:
        # Profiling / dummy run: no cache, each sequence attends to its own rows.
        if md is None or (md.cu_seqlens_q_cpu is None and md.cu_seqlens_q is None):
            cu_cpu = [0, q.shape[0]]  # all rows are one sequence
        else:
            cu_cpu = _host_list(md.cu_seqlens_q_cpu, md.cu_seqlens_q)
        if rotary is not None:
            q, k = rotary(positions, q, k)
        if layer.kv_amax is not None:  # calibrating the FP8 cache's scales (runner/kv_scales.py)
            layer.kv_amax.observe(k, v)
        causal_attention_no_cache(q, k, v, output, cu_cpu, layer.scale)
        return
    if q.is_cuda:
        _attend_cuda(q, k, v, output, positions, layer_idx)
        return
    if rotary is not None:
        q, k = rotary(positions, q, k)
    write_kv_cache_ref(k, v, kv.k_cache, kv.v_cache, md.slot_mapping, layer.k_scale, layer.v_scale)
    _attend(q, output, layer_idx)


def _attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    output: torch.Tensor,
    positions: Optional[torch.Tensor],
    layer: "Attention",
    md: Any,
    kv: Any,
) -> Optional[Callable[[int], None]]:
    """decode_attention.attention_step with the layer's, the metadata's and the cache's arguments."""
    from atomrt.workers.kernels.attention.decode_attention import attention_step

    rotary = layer.rotary if positions is not None else None
    return attention_step(
        q,
        k,
        v,
        output,
        positions,
        rotary.cos_cache if rotary is not None else None,
        rotary.sin_cache if rotary is not None else None,
        kv.k_cache,
        kv.v_cache,
        md.slot_mapping,
        md.cu_seqlens_q,
        md.context_lens,
        md.block_tables,
        layer.scale,
        num_seqs=md.num_seqs,
        max_seqlen_q=md.max_seqlen_q,
        max_seqlen_k=md.max_seqlen_k,
        graph_safe=md.graph_safe,
        cu_seqlens_q_cpu=md.cu_seqlens_q_cpu,
        context_lens_cpu=md.context_lens_cpu,
        ubatch=md.ubatch,
        kv_scales=layer.kv_scales,
    )


class _DecodePlans:
    """The step plan every attention layer of one host-planned decode step shares, worked out by
    the first layer that asks: an id per (decode plan, microbatch, metadata tensors), or None for
    a step that is not one row per sequence (a new id never repeats an old one's meaning)."""

    def __init__(self) -> None:
        self.md: Any = None  # the step whose plans `per_dims` holds (kept: its id is not reused)
        self.per_dims: dict[tuple, Optional[int]] = {}
        self.ids: dict[tuple, int] = {}
        self.next_id = 0

    def plan_id(self, md: Any, q: torch.Tensor, kv: Any) -> Optional[int]:
        if md is not self.md:
            self.md, self.per_dims = md, {}
        fp8_cache = kv.k_cache.dtype == torch.float8_e4m3fn
        dims = (kv.k_cache.shape[2], q.shape[1], q.shape[2], kv.k_cache.shape[1], fp8_cache)
        found = self.per_dims.get(dims, -1)
        if found == -1:
            found = self.per_dims[dims] = self._plan_id(md, q, dims)
        return found

    def _plan_id(self, md: Any, q: torch.Tensor, dims: tuple) -> Optional[int]:
        from atomrt.workers.kernels.attention.decode_attention import plan_decode
        from atomrt.workers.kernels.attention.paged_attention import plan_lengths
        from atomrt.workers.kernels.device_info import sm_count

        if md.graph_safe:
            return None
        num_kv_heads, num_heads, head_dim, block_size, fp8_cache = dims
        plan_q, plan_k, _ = plan_lengths(
            q,
            md.block_tables,
            block_size,
            md.num_seqs,
            md.max_seqlen_q,
            md.max_seqlen_k,
            False,
            md.cu_seqlens_q_cpu,
            md.context_lens_cpu,
        )
        if plan_q != 1:
            return None
        group = num_heads // num_kv_heads
        num_sms = sm_count(q.device)
        plan = plan_decode(md.num_seqs, plan_k, num_kv_heads, group, head_dim, num_sms, fp8_cache)
        tensors = (md.slot_mapping, md.cu_seqlens_q, md.context_lens, md.block_tables)
        key = (plan, md.ubatch, md.num_seqs, dims)
        key += tuple((t.data_ptr(), t.shape, t.stride()) for t in tensors)
        found = self.ids.get(key)
        if found is None:
            if len(self.ids) >= 4096:
                self.ids.clear()  # ids are never reused: launches kept under old ones go unused
            found = self.ids[key] = self.next_id
            self.next_id += 1
        return found


_DECODE_PLANS = _DecodePlans()


class _BoundAttend:
    """`_attend_cuda` for one eager region of a TokenGraph recording, which passes the same tensors
    at every replay: the host-planned decode launch that attention_step binds for them is kept per
    step plan, stream and KV cache, so a later step of the same plan repeats it with a lookup.
    Every other step takes attention_step's general path."""

    def __init__(self, q, k, v, output, positions, layer_idx: int) -> None:
        self.args = (q, k, v, output, positions)
        self.layer_idx = layer_idx
        self.name = f"layers.{layer_idx}"
        self.device_index = q.get_device()
        self.launches: dict[tuple, Callable[[int], None]] = {}

    def __call__(self) -> None:
        ctx = get_forward_context()
        md = ctx.attn_metadata
        if isinstance(md, dict):
            md = md[self.name]
        kv = ctx.kv_cache_data[self.name]
        q = self.args[0]
        plan = _DECODE_PLANS.plan_id(md, q, kv)
        key = None
        if plan is not None:
            stream = launch_module._raw_stream(self.device_index)
            key = (plan, stream, kv.k_cache.data_ptr(), kv.v_cache.data_ptr())
            launch = self.launches.get(key)
            if launch is not None:
                launch(stream)
                return
        launch = _attention_step(*self.args, ctx.no_compile_layers[self.layer_idx], md, kv)
        if key is not None and launch is not None:
            if len(self.launches) >= 64:
                self.launches.clear()
            self.launches[key] = launch


@eager_region(bind=_BoundAttend, request_fixed=True)
def _attend_cuda(q, k, v, output, positions, layer_idx: int) -> None:
    """The Triton path: rotary, KV write and attention (one launch for a decode batch), with
    `unified_attention_with_output`'s arguments."""
    layer, md, kv = paged_layer_state(layer_idx)
    _attention_step(q, k, v, output, positions, layer, md, kv)


@eager_region
def _attend(q: torch.Tensor, output: torch.Tensor, layer_idx: int) -> None:
    """CPU: attention of the step's query rows over the paged cache (already holding this step's k/v)."""
    layer, md, kv = paged_layer_state(layer_idx)
    cu_cpu = _host_list(md.cu_seqlens_q_cpu, md.cu_seqlens_q)
    num_seqs = md.num_seqs or len(cu_cpu) - 1
    context_lens_cpu = _host_list(md.context_lens_cpu, md.context_lens)
    paged_attention_ref(
        q,
        kv.k_cache,
        kv.v_cache,
        output,
        cu_cpu,
        context_lens_cpu,
        md.block_tables,
        layer.scale,
        num_seqs,
        layer.k_scale,
        layer.v_scale,
    )


direct_register_custom_op(
    "unified_attention_with_output",
    unified_attention_with_output,
    mutates_args=["output"],
    fake_impl=returns_nothing,
)


class PagedAttentionLayer(nn.Module):
    """A layer whose KV cache is the forward context's `kv_cache_data["layers.<layer_idx>"]` and
    whose op finds it in `no_compile_layers[layer_idx]`: `Attention`, and multi-head latent
    attention (workers/layers/mla.py). `collect_attention_layers` finds them.

    `k_scale` / `v_scale`: an FP8 (e4m3) cache's per-tensor scales, the factors that dequantize it
    (the cache holds k / k_scale); a latent cache uses `k_scale`. Set at start-up, from the
    checkpoint or calibrated (workers/runner/kv_scales.py); unused by a cache in the model's dtype.
    `kv_scales` holds them as the CUDA kernels read them ([k_scale, v_scale] float32 on the
    device, made with them at start-up; None: 1.0). `kv_scale_source` says where they came from;
    `kv_amax`, while calibrating, records the largest |k| and |v| the layer writes."""

    layer_idx: int
    k_scale: float = 1.0
    v_scale: float = 1.0
    kv_scales: Optional[torch.Tensor] = None
    kv_scale_source: str = "unit"  # unit | checkpoint | calibrated
    kv_amax: Optional[Any] = None

    def kv_cache_spec(self) -> Any:
        """What the layer keeps per token in the cache, and how its entry is allocated
        (workers/layers/kv_spec.py)."""
        raise NotImplementedError(f"{type(self).__name__} states no kv_cache_spec()")


class Attention(PagedAttentionLayer):
    """Attention over the paged KV cache, per rank: num_heads / num_kv_heads are this rank's heads.

    With `rotary`, the layer applies the rotary embedding to q and k itself (`forward` then needs
    the step's positions): on CUDA it is fused into the KV-cache write, one launch instead of three.
    """

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        rotary: Optional[RotaryEmbedding] = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.rotary = rotary

    def kv_cache_spec(self) -> KVLayerSpec:
        return KVLayerSpec(self.layer_idx, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """q [num_tokens, num_heads(*head_dim)], k/v [num_tokens, num_kv_heads(*head_dim)] -> [num_tokens, num_heads * head_dim]."""
        if (positions is None) != (self.rotary is None):
            raise ValueError(
                f"attention layer {self.layer_idx}: positions are needed exactly when it has a rotary embedding"
            )
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        output = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        torch.ops.atomrt.unified_attention_with_output(q, k, v, output, positions, self.layer_idx)
        return output.reshape(-1, self.num_heads * self.head_dim)


def collect_attention_layers(model: nn.Module) -> "dict[int, PagedAttentionLayer]":
    """layer_idx -> the layer's paged attention: what the runner puts in
    forward_context.no_compile_layers, and what the KV cache is laid out for."""
    return {m.layer_idx: m for m in model.modules() if isinstance(m, PagedAttentionLayer)}

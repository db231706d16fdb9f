"""Multi-head latent attention (MLA, the DeepSeek family's attention) and its one custom op,
`torch.ops.atomrt.mla_attention`.

The block: the query, through a low-rank `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (`q_lora_rank`)
or a plain `q_proj`, per head [q_nope (qk_nope_head_dim) | q_pe (qk_rope_head_dim)]; one shared
`kv_a_proj_with_mqa` row per token [kv_c (kv_lora_rank) | k_pe], kv_c normalised by
`kv_a_layernorm`; `kv_b_proj` expands kv_c into each head's k_nope and value; `o_proj`. The
projections that read the normed hidden state are one GEMM (`in_proj`), which takes the decoder
layer's residual add and norm in its prologue as Llama's qkv projection does: with a query LoRA
`q_a_proj` and `kv_a_proj_with_mqa` (both replicated over TP ranks) as `fused_qkv_a_proj`; without
one this rank's query heads of `q_proj` and the whole `kv_a_proj_with_mqa` as `q_kv_a_proj`.

The op (a splitting op at level 3; its attention an eager region in token graphs, recorded whole
under FULL, as the attention op is) rotates q_pe and k_pe, writes the step's latent cache rows
[kv_c | k_pe] at slot_mapping (latent KV cache: workers/runner/kv_cache.py), then attends:
decode and verify rows (a sequence of at most `Config.max_q_len` rows) with absorbed weights
(`w_uk`, `w_uv`, derived from kv_b_proj once its weights are in), prompt rows by decompressing
their context through kv_b_proj. CPU: the torch reference (mla_ref.py) for both. CUDA: the Triton
latent-cache write and paged MLA decode (workers/kernels/attention/mla_decode.py), which a request
bucket records whole; prompt chunks take the reference.
"""

# No `from __future__ import annotations` here: the op's schema is inferred from real annotations.

from typing import Optional

import torch

from atomrt.compile.custom_register import direct_register_custom_op
from atomrt.distributed.communication_op import TPInfo
from atomrt.graphs.markers import eager_region
from atomrt.runtime.forward_context import get_forward_context
from atomrt.workers.layers.attention import PagedAttentionLayer, paged_layer_state
from atomrt.workers.layers.attention_ref import copy_rows
from atomrt.workers.layers.kv_spec import MLALayerSpec
from atomrt.workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from atomrt.workers.layers.mla_ref import (
    MLAWeights,
    mla_no_cache_ref,
    mla_paged_ref,
    unabsorb_output,
)
from atomrt.workers.layers.norm import RMSNorm
from atomrt.workers.layers.paged_rows import returns_nothing
from atomrt.workers.layers.rotary import RotaryEmbedding
from atomrt.workers.layers.weight_utils import divide

# transformers' DeepSeek attention normalises the latents with its RMSNorm default, whatever the
# model's rms_norm_eps
LATENT_NORM_EPS = 1e-6
# W_UK's and W_UV's products of a decode step of at most mla_absorb.SKINNY_MAX rows by one Triton
# launch each (workers/kernels/attention/mla_absorb.py), not torch.bmm, whose cuBLAS kernels are
# latency-bound at such rows; benchmarks/bench_mla_absorb.py times the two. Off: on one H100
# (3483589) level with bmm at 16 heads (3.18 / 3.67 against 3.18 / 3.76 us for W_UK / W_UV at 1
# row), slower at 128 heads' W_UK (9.56 against 8.05 us)
MLA_ABSORB_KERNEL = False


def write_latent_ref(
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float = 1.0,
) -> None:
    """Rows [kv_c | k_pe] at slot_mapping (rows with a negative slot are skipped); an FP8 cache
    takes them over its per-tensor `scale`."""
    num_tokens = kv_c_normed.shape[0]
    valid = slot_mapping[:num_tokens] >= 0
    rows = torch.cat((kv_c_normed, k_pe), dim=-1)[valid]
    copy_rows(kv_cache.view(-1, kv_cache.shape[-1]), slot_mapping[:num_tokens][valid], rows, scale)


def mla_attention(
    q: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    output: torch.Tensor,
    positions: torch.Tensor,
    layer_idx: int,
) -> None:
    """q [num_tokens, num_heads, qk_nope + rope]; kv_c_normed [num_tokens, kv_lora_rank]; k_pe
    [num_tokens, rope] (not rotated yet); output [num_tokens, num_heads, v_head_dim]; positions
    [num_tokens] int64. The rotary embedding and the cache write run in the recording (on CUDA one
    launch for both, mla_rope_write_kv_cache); `_mla_attend` is the eager region."""
    layer, md, kv = paged_layer_state(layer_idx)
    nope = layer.qk_nope_head_dim
    if q.is_cuda and kv is not None and md is not None:
        from atomrt.workers.kernels.attention.mla_write import mla_rope_write_kv_cache

        rotary = layer.rotary
        q_pe = mla_rope_write_kv_cache(
            q[..., nope:], kv_c_normed, k_pe, positions, rotary.cos_cache, rotary.sin_cache,
            rotary.interleaved, kv.kv_cache, md.slot_mapping, layer.kv_scales,
        )  # fmt: skip
        _mla_attend(q, output, layer_idx, q_pe)
        return
    q_pe, k_pe = layer.rotary(positions, q[..., nope:], k_pe.unsqueeze(1))
    q = torch.cat((q[..., :nope], q_pe), dim=-1)
    k_pe = k_pe.squeeze(1)
    if kv is None or md is None:
        # Profiling / dummy run: no cache, each sequence attends to its own rows.
        if md is None or (md.cu_seqlens_q_cpu is None and md.cu_seqlens_q is None):
            cu = [0, q.shape[0]]
        else:
            cu = list(md.cu_seqlens_q_cpu or md.cu_seqlens_q.tolist())
        latent = torch.cat((kv_c_normed, k_pe), dim=-1)
        if layer.kv_amax is not None:  # calibrating the FP8 cache's scale (runner/kv_scales.py)
            layer.kv_amax.observe(latent, latent)
        mla_no_cache_ref(q, latent, output, cu, layer.weights(), layer.scale)
        return
    write_latent_ref(kv_c_normed, k_pe, kv.kv_cache, md.slot_mapping, layer.k_scale)
    _mla_attend(q, output, layer_idx)


def _split_sequences(md: object, decode_max_q: int) -> "tuple[list, list]":
    """(decode, prefill) sequences of a host-planned step, each (index, first row, rows, context
    length): decode ones run at most `decode_max_q` rows."""
    cu = md.cu_seqlens_q_cpu if md.cu_seqlens_q_cpu is not None else md.cu_seqlens_q.tolist()
    context_lens = md.context_lens_cpu
    if context_lens is None:
        context_lens = md.context_lens.tolist()
    num_seqs = md.num_seqs or len(cu) - 1
    decode, prefill = [], []
    for s in range(num_seqs):
        n = cu[s + 1] - cu[s]
        if n:
            (decode if n <= decode_max_q else prefill).append((s, cu[s], n, context_lens[s]))
    return decode, prefill


@eager_region(request_fixed=True)
def _mla_attend(
    q: torch.Tensor, output: torch.Tensor, layer_idx: int, q_pe: Optional[torch.Tensor] = None
) -> None:
    """Attention of the step's query rows (q_pe rotated: q's last columns, or `q_pe` [n, H, rope]
    apart, q's own then unread) over the latent cache, which already holds this step's rows. Rows
    past the step's sequences get zeros."""
    layer, md, kv = paged_layer_state(layer_idx)
    config = get_forward_context().config
    decode_max_q = config.max_q_len if config is not None else 1
    if q.is_cuda and (md.graph_safe or md.max_seqlen_q <= decode_max_q):
        absorbed_decode(q, output, layer, md, kv, q_pe)
        return
    if q_pe is not None:
        q = torch.cat((q[..., : layer.qk_nope_head_dim], q_pe), dim=-1)
    decode, prefill = _split_sequences(md, decode_max_q)
    mla_paged_ref(
        q, kv.kv_cache, output, decode, prefill, md.block_tables, layer.weights(), layer.scale,
        layer.k_scale,
    )  # fmt: skip
    cu = md.cu_seqlens_q_cpu if md.cu_seqlens_q_cpu is not None else md.cu_seqlens_q.tolist()
    output[cu[md.num_seqs or len(cu) - 1] :] = 0


def absorbed_decode(
    q: torch.Tensor,
    output: torch.Tensor,
    layer: "MLAAttention",
    md: object,
    kv: object,
    q_pe: Optional[torch.Tensor] = None,
) -> None:
    """Absorbed attention of every row through the paged MLA decode kernel (the CUDA path; on CPU
    tensors the kernels run under Triton's interpreter): planned from shapes, it reads every
    length on the device (graph-safe, what a request bucket records). `q_pe`: the rotated rotary
    part apart from q (else q's last columns)."""
    from atomrt.workers.kernels.attention.mla_absorb import absorb_fits, mla_absorb
    from atomrt.workers.kernels.attention.mla_decode import mla_decode_attention

    # The kernel reads q_nope @ W_UK where the bmm leaves it and q_pe where it is (no copy into one
    # row); W_UV's bmm writes its heads straight into `output`.
    nope = layer.qk_nope_head_dim
    q_nope = q[..., :nope].transpose(0, 1)  # [H, n, nope]
    if MLA_ABSORB_KERNEL and absorb_fits(q_nope, layer.w_uk):
        q_latent = q.new_empty(q.shape[1], q.shape[0], layer.kv_lora_rank)
        q_latent = mla_absorb(q_nope, layer.w_uk, q_latent).transpose(0, 1)  # [n, H, L]
    else:
        q_latent = torch.bmm(q_nope, layer.w_uk).transpose(0, 1)  # [n, H, L]
    latent_out = q.new_empty(q.shape[1], q.shape[0], layer.kv_lora_rank).transpose(0, 1)
    mla_decode_attention(
        q_latent,
        kv.kv_cache,
        md.block_tables,
        md.context_lens,
        md.cu_seqlens_q,
        layer.scale,
        latent_out,
        kv_scales=layer.kv_scales,
        q_pe=q[..., nope:] if q_pe is None else q_pe,
        ubatch=md.ubatch,
    )
    heads = latent_out.transpose(0, 1)  # [H, n, L], contiguous
    if output.dtype == heads.dtype == layer.w_uv.dtype:
        if MLA_ABSORB_KERNEL and absorb_fits(heads, layer.w_uv):
            mla_absorb(heads, layer.w_uv, output.transpose(0, 1))
        else:
            torch.bmm(heads, layer.w_uv, out=output.transpose(0, 1))
    else:
        output.copy_(unabsorb_output(latent_out, layer.w_uv))


direct_register_custom_op(
    "mla_attention", mla_attention, mutates_args=["output"], fake_impl=returns_nothing
)


class MLAAttention(PagedAttentionLayer):
    """The MLA block of one decoder layer, per rank: the query heads and kv_b_proj are split over
    TP ranks, the latent projection (and so the latent cache) is whole on every rank."""

    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: Optional[int],
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        rotary: RotaryEmbedding,
        tp: TPInfo = TPInfo(),
        bias: bool = False,
    ) -> None:
        super().__init__()
        # whole heads per rank (the projections' widths alone could split one)
        self.num_heads = divide(num_heads, tp.tp_size, "num_attention_heads")
        self.layer_idx = layer_idx
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale, self.rotary = scale, rotary
        qk_head_dim, latent = qk_nope_head_dim + qk_rope_head_dim, kv_lora_rank + qk_rope_head_dim
        if q_lora_rank is None:
            # FP8 block scales are expanded to rows at load, so the q rows may end mid-block
            self.q_kv_a_proj = MergedColumnParallelLinear(
                hidden_size, [num_heads * qk_head_dim, latent], bias, tp, replicated=(False, True)
            )
            if bias:  # q_proj has none: its rows of the bias stay zero (the loader's `_needed`)
                self.q_kv_a_proj.bias.data[: self.num_heads * qk_head_dim].zero_()
        else:
            self.fused_qkv_a_proj = MergedColumnParallelLinear(
                hidden_size, [q_lora_rank, latent], bias
            )
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, num_heads * qk_head_dim, tp=tp)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), tp=tp
        )
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size, bias, tp=tp)
        # absorbed weights of this rank's heads, from kv_b_proj (process_weights_after_loading)
        h = self.num_heads
        self.register_buffer("w_uk", torch.empty(h, qk_nope_head_dim, kv_lora_rank), False)
        self.register_buffer("w_uv", torch.empty(h, kv_lora_rank, v_head_dim), False)

    def kv_cache_spec(self) -> MLALayerSpec:
        return MLALayerSpec(self.layer_idx, self.kv_lora_rank, self.qk_rope_head_dim)

    def process_weights_after_loading(self) -> None:
        """W_UK [heads, qk_nope, kv_lora_rank] and W_UV [heads, kv_lora_rank, v_head_dim] from
        kv_b_proj's weight [heads * (qk_nope + v_head_dim), kv_lora_rank]."""
        w = self.kv_b_proj.weight.detach().view(self.num_heads, -1, self.kv_lora_rank)
        with torch.no_grad():
            self.w_uk.copy_(w[:, : self.qk_nope_head_dim])
            self.w_uv.copy_(w[:, self.qk_nope_head_dim :].transpose(1, 2))

    def weights(self) -> MLAWeights:
        return MLAWeights(self.kv_b_proj.weight, self.w_uk, self.w_uv)

    @property
    def in_proj(self) -> MergedColumnParallelLinear:
        """The one GEMM that reads the layer's normed input (`RMSNorm.add_project`): with a query
        LoRA fused_qkv_a_proj ([n, q_lora_rank + kv_lora_rank + rope]), without one q_kv_a_proj
        ([n, heads_per_rank * (qk_nope + rope) + kv_lora_rank + rope])."""
        return self.q_kv_a_proj if self.q_lora_rank is None else self.fused_qkv_a_proj

    def forward(self, positions: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """a: the normed input through `in_proj` -> [num_tokens, hidden] (o_proj's output,
        TP-reduced)."""
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q, kv_a = a.split(self.q_kv_a_proj.output_sizes_per_rank, dim=-1)
        else:
            q_c, kv_a = a.split([self.q_lora_rank, latent], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_c))
        kv_c, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        q = q.view(-1, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        output = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        torch.ops.atomrt.mla_attention(q, kv_c, k_pe, output, positions, self.layer_idx)
        return self.o_proj(output.view(-1, self.num_heads * self.v_head_dim))

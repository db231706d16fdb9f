"""Tensor-parallel linear layers.

Column parallel: the output features are split over ranks (no communication; q/k/v, gate/up).
Row parallel: the input features are split, each rank computes a partial sum, and the sum is
all-reduced (o_proj, down_proj). Every parameter carries `weight_loader(param, loaded_weight,
shard_id=None)` that reads only this rank's shard of `loaded_weight` (see weight_utils).

Every projection runs through `linear`: decode-sized CUDA batches take the skinny Triton GEMM
(workers/kernels/gemm/skinny_gemm.py), everything else F.linear. Which batches is the layer's
`SkinnyPolicy` (given at construction, the default otherwise) applied to its weight's size. Under
torch.compile `linear` is the custom op `torch.ops.atomrt.linear`, so the choice is made per call,
at run time, on the real row count (the traced graphs have a dynamic token dimension). Two fused variants follow the
same pattern: `silu_mul_linear` (a gated MLP's activation + down projection) and `add_norm_linear`
(a decoder layer's residual add + RMSNorm + the projection after it).

On CPU, eager float32 forwards take oneDNN's GEMM on the layer's reordered weight instead of
F.linear (`cpu_packed`, workers/layers/cpu_gemm.py).
"""

# No `from __future__ import annotations` here: the op's schema is inferred from real annotations.

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from atomrt.compile.custom_register import direct_register_custom_op
from atomrt.distributed.communication_op import TPInfo, tp_all_gather, tp_all_reduce
from atomrt.workers.kernels.gemm.skinny_gemm import (
    DEFAULT_SKINNY_POLICY,
    SkinnyPolicy,
    skinny_add_norm_linear,
    skinny_linear,
    use_skinny,
)
from atomrt.workers.kernels.rms_norm import add_rms_norm
from atomrt.workers.layers.activation import silu_and_mul
from atomrt.workers.layers.cpu_gemm import CPUPackedWeight, packed_linear
from atomrt.workers.layers.norm import RMSNorm, residual_add, rms_norm
from atomrt.workers.layers.weight_utils import Sliceable, copy_checked, divide, read_narrow

# `max_rows` below is the calling layer's `SkinnyPolicy.max_rows` of its weight: the largest batch
# that takes the skinny GEMM (0: never). An int, so that it is a constant of the traced op.


def _linear_impl(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], max_rows: int
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) -> [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    if use_skinny(rows, weight, max_rows):
        return skinny_linear(rows, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _linear_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], max_rows: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _silu_mul_linear_impl(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], max_rows: int
) -> torch.Tensor:
    """x [..., 2K] (gate | up) -> (silu(gate) * up) @ weight [N, K]^T (+ bias) -> [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    if use_skinny(rows[:, : weight.shape[1]], weight, max_rows):
        return skinny_linear(rows, weight, bias, gated=True).reshape(*x.shape[:-1], weight.shape[0])
    return _linear_impl(silu_and_mul(x), weight, bias, max_rows)


def _add_norm_linear_impl(
    residual: torch.Tensor,
    update: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    max_rows: int,
    stats_values: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual, update [..., K] -> (h = residual + update [..., K], RMSNorm(h) @ weight^T (+ bias) [..., N])."""
    rows, update_rows = (
        residual.reshape(-1, residual.shape[-1]),
        update.reshape(-1, update.shape[-1]),
    )
    fusable = norm_weight.dtype == residual.dtype and update.dtype == residual.dtype
    if fusable and use_skinny(rows, weight, max_rows):  # a decode batch: one kernel
        h, y = skinny_add_norm_linear(
            rows, update_rows, norm_weight, eps, weight, bias, stats_values=stats_values
        )
    elif fusable and rows.is_cuda:  # two: the add and norm in one, then the GEMM
        h, normed = add_rms_norm(rows, update_rows, norm_weight, eps)
        y = F.linear(normed, weight, bias)
    else:
        h = residual_add(rows, update_rows)
        y = F.linear(rms_norm(h, norm_weight, eps), weight, bias)
    return h.reshape(residual.shape), y.reshape(*residual.shape[:-1], weight.shape[0])


def _add_norm_linear_fake(
    residual: torch.Tensor,
    update: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    max_rows: int,
    stats_values: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return residual.new_empty(residual.shape), residual.new_empty(
        (*residual.shape[:-1], weight.shape[0])
    )


direct_register_custom_op("linear", _linear_impl, fake_impl=_linear_fake)
direct_register_custom_op("silu_mul_linear", _silu_mul_linear_impl, fake_impl=_linear_fake)
direct_register_custom_op("add_norm_linear", _add_norm_linear_impl, fake_impl=_add_norm_linear_fake)


def _max_rows(weight: torch.Tensor, max_rows: Optional[int]) -> int:
    return DEFAULT_SKINNY_POLICY.max_rows(weight.numel()) if max_rows is None else max_rows


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: "Optional[torch.Tensor]" = None,
    max_rows: Optional[int] = None,
) -> torch.Tensor:
    """F.linear, or the skinny GEMM for a decode-sized CUDA batch (at most `max_rows` rows; None:
    the default policy's for this weight). Traced, it is one opaque op (Inductor cannot fold it into
    addmm or pick the kernel for a symbolic row count); eager, a call."""
    max_rows = _max_rows(weight, max_rows)
    if torch.compiler.is_compiling():
        return torch.ops.atomrt.linear(x, weight, bias, max_rows)
    return _linear_impl(x, weight, bias, max_rows)


def silu_mul_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: "Optional[torch.Tensor]" = None,
    max_rows: Optional[int] = None,
) -> torch.Tensor:
    """`linear(silu_and_mul(x), weight, bias)` with the activation computed inside the skinny GEMM
    for a decode-sized CUDA batch (one kernel instead of two). Call it only for a weight whose
    policy `fuses_gate`: for others the activation belongs outside the opaque op, where Inductor
    makes it one kernel (inside the op it would be two eager ones, silu and mul)."""
    max_rows = _max_rows(weight, max_rows)
    if torch.compiler.is_compiling():
        return torch.ops.atomrt.silu_mul_linear(x, weight, bias, max_rows)
    return _silu_mul_linear_impl(x, weight, bias, max_rows)


def add_norm_linear(
    residual: torch.Tensor,
    update: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: "Optional[torch.Tensor]" = None,
    max_rows: Optional[int] = None,
    stats_values: int = DEFAULT_SKINNY_POLICY.norm_stats_values,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, linear(rms_norm(h, norm_weight, eps), weight, bias)) for h = residual + update: a decoder
    layer's residual add, its norm and the projection after it. Where the skinny GEMM can take the
    weight (`max_rows` > 0), one op: for a decode batch one kernel (the add and the norm in the
    GEMM's prologue) instead of two. Otherwise the add and the norm stay outside the opaque op,
    where Inductor fuses them into one kernel."""
    max_rows = _max_rows(weight, max_rows)
    if max_rows == 0:
        h = residual_add(residual, update)
        return h, linear(rms_norm(h, norm_weight, eps), weight, bias, max_rows)
    if torch.compiler.is_compiling():
        return torch.ops.atomrt.add_norm_linear(
            residual, update, norm_weight, eps, weight, bias, max_rows, stats_values
        )
    return _add_norm_linear_impl(
        residual, update, norm_weight, eps, weight, bias, max_rows, stats_values
    )


class _LinearBase(nn.Module):
    def __init__(
        self, in_local: int, out_local: int, bias: bool, tp: TPInfo, skinny: SkinnyPolicy
    ) -> None:
        super().__init__()
        self.tp = tp
        self.skinny_max_rows = skinny.max_rows(in_local * out_local)  # see linear()
        self.norm_stats_values = skinny.norm_stats_values
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.cpu_packed = CPUPackedWeight()  # the CPU eager path's copy of the weight
        self.quant_method: Optional[object] = None  # FP8 weights (layers/quantization/fp8.py)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Sliceable, shard_id: object = None
    ) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_LinearBase):
    """y = x W^T + b with W's rows (output features) split over ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TPInfo = TPInfo(),
        gather_output: bool = False,
        skinny: SkinnyPolicy = DEFAULT_SKINNY_POLICY,
    ) -> None:
        self.output_size_per_rank = divide(
            output_size, tp.tp_size, "ColumnParallelLinear output_size"
        )
        super().__init__(input_size, self.output_size_per_rank, bias, tp, skinny)
        self.gather_output = gather_output

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Sliceable, shard_id: object = None
    ) -> None:
        start = self.tp.tp_rank * self.output_size_per_rank
        copy_checked(
            param.data,
            read_narrow(loaded_weight, 0, start, self.output_size_per_rank),
            "column shard",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.cpu_packed.get(self.weight, x)
        if self.quant_method is not None:
            y = self.quant_method.apply(self, x)
            y = y + self.bias if self.bias is not None else y
        elif packed is not None:
            y = packed_linear(x, packed, self.bias)
        else:
            y = linear(x, self.weight, self.bias, self.skinny_max_rows)
        return tp_all_gather(y, self.tp) if self.gather_output else y

    def forward_add_norm(
        self, residual: torch.Tensor, update: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, self(norm(h))) for h = residual + update: through add_norm_linear, or a quantized
        weight's method when it fuses them (`fuses_add_norm`), unless the weight is CPU-packed or
        quantized otherwise (then the add and the norm come first, and `forward`)."""
        method = self.quant_method
        if method is not None and getattr(method, "fuses_add_norm", False):
            h, y = method.apply_add_norm(self, residual, update, norm)
            y = y + self.bias if self.bias is not None else y
            return h, tp_all_gather(y, self.tp) if self.gather_output else y
        if method is not None or self.cpu_packed.get(self.weight, residual) is not None:
            h = residual_add(residual, update)
            return h, self(rms_norm(h, norm.weight, norm.eps))
        h, y = add_norm_linear(
            residual,
            update,
            norm.weight,
            norm.eps,
            self.weight,
            self.bias,
            self.skinny_max_rows,
            self.norm_stats_values,
        )
        return h, tp_all_gather(y, self.tp) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate/up).

    The checkpoint holds them separately; `shard_id` is the index into `output_sizes`.
    Each rank's weight is [its slice of shard 0; its slice of shard 1; ...], a projection that
    `replicated` marks whole on every rank (MLA's latent projection beside its query heads).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: TPInfo = TPInfo(),
        skinny: SkinnyPolicy = DEFAULT_SKINNY_POLICY,
        replicated: tuple[bool, ...] = (),
    ) -> None:
        self.replicated = replicated or (False,) * len(output_sizes)
        assert len(self.replicated) == len(output_sizes), "one replicated flag per projection"
        self.output_sizes_per_rank = [
            s if whole else divide(s, tp.tp_size, "MergedColumnParallelLinear output")
            for s, whole in zip(output_sizes, self.replicated)
        ]
        # the base splits the total evenly over ranks
        total = sum(self.output_sizes_per_rank) * tp.tp_size
        super().__init__(input_size, total, bias, tp, skinny=skinny)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Sliceable, shard_id: object = None
    ) -> None:
        assert isinstance(shard_id, int), "merged linear needs the index of the projection"
        size = self.output_sizes_per_rank[shard_id]
        offset = sum(self.output_sizes_per_rank[:shard_id])
        start = 0 if self.replicated[shard_id] else self.tp.tp_rank * size
        src = read_narrow(loaded_weight, 0, start, size)
        copy_checked(param.data.narrow(0, offset, size), src, f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, split by heads.

    Each rank holds num_heads / tp_size query heads. KV heads are split too while there are enough;
    when tp_size > num_kv_heads each kv head is replicated on tp_size / num_kv_heads ranks, so every
    rank holds exactly one.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TPInfo = TPInfo(),
        skinny: SkinnyPolicy = DEFAULT_SKINNY_POLICY,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.tp_size, "num_attention_heads")
        if tp.tp_size >= num_kv_heads:
            divide(tp.tp_size, num_kv_heads, "tensor_parallel_size over num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp.tp_rank // (tp.tp_size // num_kv_heads)
        else:
            self.num_kv_heads = divide(num_kv_heads, tp.tp_size, "num_key_value_heads")
            self.kv_head_start = tp.tp_rank * self.num_kv_heads
        self.q_size = self.num_heads * head_dim  # per rank
        self.kv_size = self.num_kv_heads * head_dim  # per rank
        out_total = (self.q_size + 2 * self.kv_size) * tp.tp_size  # so that the base divides evenly
        super().__init__(hidden_size, out_total, bias, tp, skinny=skinny)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Sliceable, shard_id: object = None
    ) -> None:
        assert shard_id in ("q", "k", "v"), (
            f"qkv shard_id must be 'q', 'k' or 'v', got {shard_id!r}"
        )
        if shard_id == "q":
            offset, size, src_start = 0, self.q_size, self.tp.tp_rank * self.q_size
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, src_start = self.kv_size, self.kv_head_start * self.head_dim
        src = read_narrow(loaded_weight, 0, src_start, size)
        copy_checked(param.data.narrow(0, offset, size), src, f"qkv shard {shard_id}")


class RowParallelLinear(_LinearBase):
    """y = x W^T + b with W's columns (input features) split; partial sums are all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TPInfo = TPInfo(),
        reduce_output: bool = True,
        skinny: SkinnyPolicy = DEFAULT_SKINNY_POLICY,
    ) -> None:
        self.input_size_per_rank = divide(input_size, tp.tp_size, "RowParallelLinear input_size")
        super().__init__(self.input_size_per_rank, output_size, bias, tp, skinny)
        self.reduce_output = reduce_output
        self.fuses_gate = skinny.fuses_gate(self.input_size_per_rank * output_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Sliceable, shard_id: object = None
    ) -> None:
        if param.dim() == 1:  # the bias is replicated and added once, after the reduce
            copy_checked(param.data, read_narrow(loaded_weight, 0, 0, param.shape[0]), "row bias")
            return
        start = self.tp.tp_rank * self.input_size_per_rank
        copy_checked(
            param.data, read_narrow(loaded_weight, 1, start, self.input_size_per_rank), "row shard"
        )

    def forward(self, x: torch.Tensor, gated_input: bool = False) -> torch.Tensor:
        """x [..., in]; with `gated_input`, x is [..., 2 * in] (gate | up, a gated MLP's merged
        projection) and the layer's input is silu(gate) * up, fused into the matmul where it can be."""
        packed = self.cpu_packed.get(self.weight, x)
        if self.quant_method is not None:
            y = self.quant_method.apply(self, silu_and_mul(x) if gated_input else x)
        elif packed is not None:
            y = packed_linear(silu_and_mul(x) if gated_input else x, packed, None)
        elif gated_input and self.fuses_gate:
            y = silu_mul_linear(x, self.weight, None, self.skinny_max_rows)
        else:
            y = linear(
                silu_and_mul(x) if gated_input else x, self.weight, None, self.skinny_max_rows
            )
        if self.reduce_output:
            y = tp_all_reduce(y, self.tp)
        return y + self.bias if self.bias is not None else y

"""FP8 layers: converting a model's linear layers and MoE experts to FP8 before their weights load,
and finishing them after (see fp8.py for the formats and the numerics).

The layers are recognized by what they hold, not by class, so that this module sits below
workers/layers/linear.py and moe.py (which run what it installs): a linear layer holds a 2-D
`weight` and a `quant_method` slot, a MoE layer `w13_weight` / `w2_weight` and a `quant_method`
slot; a row-parallel layer has `input_size_per_rank`, a q/k/v projection `kv_size`, a merged one
`output_sizes_per_rank`.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from atomrt.runtime import envs
from atomrt.workers.layers.quantization.fp8 import (
    DEQUANTIZED_AT_LOAD,
    FP8_DTYPE,
    Fp8Config,
    dequantize_fp8,
    quantize_weight_per_row,
    scale_groups,
)
from atomrt.workers.layers.quantization.fp8_ops import fp8_add_norm_linear_op, fp8_linear_op
from atomrt.workers.layers.weight_utils import Sliceable, copy_checked, read_narrow


def _is_fp8_source(weight: Sliceable) -> bool:
    if isinstance(weight, torch.Tensor):
        return weight.dtype == FP8_DTYPE
    return weight.get_dtype() == "F8_E4M3"


def _read_whole(weight: Sliceable) -> torch.Tensor:
    """A whole (small) checkpoint tensor, a 0-dim one included."""
    return weight if isinstance(weight, torch.Tensor) else weight[...]


def _source_dtype(weight: Sliceable) -> str:
    return str(weight.dtype) if isinstance(weight, torch.Tensor) else weight.get_dtype()


def _expand_scale(
    scale: torch.Tensor, weight_shape: tuple[int, ...], block: Optional[tuple[int, int]]
) -> torch.Tensor:
    """A checkpoint scale (per tensor [] / [1], per channel [N] / [N, 1], per block [ceil(N/bn),
    ceil(K/bk)]; any of them after leading expert dims) -> [..., rows, G] per output row: N rows
    (a block or tensor scale is expanded to at most N, an upper bound of the projection's rows,
    which the loaders narrow)."""
    *lead, n, k = weight_shape
    scale = scale.float()
    if block is not None:
        return scale.repeat_interleave(block[0], dim=-2)[..., :n, :]
    if scale.numel() == math.prod(lead):  # one per tensor
        return scale.reshape(*lead, 1, 1).expand(*lead, n, 1)
    return scale.reshape(*lead, -1, 1)  # one per output row


class Fp8LinearMethod:
    """What a converted linear layer runs: `apply(layer, x)`."""

    def __init__(self, config: Fp8Config, group_k: Optional[int]) -> None:
        self.config = config
        self.group_k = group_k
        self.static = config.activation_scheme == "static" and not config.online

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        scale = layer.weight_scale
        input_scale = layer.input_scale if self.static else None
        return fp8_linear_op(x, layer.weight, scale, input_scale, self.group_k)

    @property
    def fuses_add_norm(self) -> bool:
        """Whether `apply_add_norm` takes a residual add and RMSNorm into the projection's launch
        (ATOMRT_FP8_NORM_PROLOGUE=1), rather than the layer adding and normalizing first."""
        return envs.ENV.fp8_norm_prologue

    def apply_add_norm(
        self, layer: nn.Module, residual: torch.Tensor, update: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, RMSNorm(h) @ W^T) for h = residual + update (no bias: the caller adds it)."""
        input_scale = layer.input_scale if self.static else None
        return fp8_add_norm_linear_op(
            residual, update, norm.weight, norm.eps, layer.weight, layer.weight_scale,
            input_scale, self.group_k,
        )  # fmt: skip


def _num_merged(layer: nn.Module) -> int:
    """How many checkpoint projections a linear layer fuses (q/k/v: 3, gate/up: 2)."""
    if hasattr(layer, "kv_size"):  # QKVParallelLinear
        return 3
    if hasattr(layer, "output_sizes_per_rank"):  # MergedColumnParallelLinear
        return len(layer.output_sizes_per_rank)
    return 1


def _is_experts(module: nn.Module) -> bool:
    """A FusedMoE (or a subclass): expert weights and a quantization slot."""
    return hasattr(module, "w13_weight") and hasattr(module, "quant_method")


def _is_linear(module: nn.Module) -> bool:
    """A `_LinearBase`: a 2-D weight and a quantization slot."""
    weight = getattr(module, "weight", None)
    return (
        hasattr(module, "quant_method")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and not _is_experts(module)
    )


def _shard_index(shard_id: object) -> int:
    if shard_id is None:
        return 0
    if isinstance(shard_id, int):
        return shard_id
    return ("q", "k", "v").index(shard_id)


def convert_linear(layer: nn.Module, config: Fp8Config, name: str) -> None:
    """Make a `_LinearBase` layer FP8: its weight e4m3 (a float weight under online quantization,
    quantized by `finish_linear`), its scales as parameters the checkpoint fills."""
    n, k = layer.weight.shape
    device = layer.weight.device
    row_parallel = hasattr(layer, "input_size_per_rank")  # RowParallelLinear
    block = config.weight_block_size
    if block and row_parallel and layer.tp.tp_size > 1 and k % block[1]:
        raise ValueError(
            f"{name}: the input features of each tensor-parallel shard ({k}) must be a multiple "
            f"of the FP8 block {block[1]} (tensor_parallel_size={layer.tp.tp_size})"
        )
    layer.fp8_dequantize_at_load = name.rsplit(".", 1)[-1] in DEQUANTIZED_AT_LOAD
    layer.quant_method = Fp8LinearMethod(config, config.group_k)
    if config.online:
        return
    float_loader = layer.weight_loader

    def weight_loader(param: nn.Parameter, loaded: Sliceable, shard_id: object = None) -> None:
        if param is layer.weight and not _is_fp8_source(loaded):
            raise ValueError(
                f"{name}: the checkpoint's weight is {_source_dtype(loaded)}, but "
                "quantization_config says FP8 (list the layer in modules_to_not_convert)"
            )
        float_loader(param, loaded, shard_id)

    weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE, device=device), requires_grad=False)
    weight.weight_loader = weight_loader
    layer.weight = weight
    num_groups = scale_groups(k, config.group_k)[1]
    scale = nn.Parameter(
        torch.empty(n, num_groups, dtype=torch.float32, device=device), requires_grad=False
    )

    def scale_loader(param: nn.Parameter, loaded: Sliceable, shard_id: object = None) -> None:
        full = _read_whole(loaded)
        if row_parallel:
            # every output row; the shard's input feature groups
            rows = _expand_scale(full, (n, k * layer.tp.tp_size), block)
            if rows.shape[-1] > 1:
                rows = read_narrow(rows, 1, layer.tp.tp_rank * num_groups, num_groups)
            copy_checked(param.data, rows, f"{name}.{config.scale_name}")
            return
        rows = _expand_scale(full, (_rows_bound(layer), k), block)
        float_loader(param, rows, shard_id)

    scale.weight_loader = scale_loader
    layer.register_parameter(config.scale_name, scale)
    if config.activation_scheme == "static":
        input_scale = nn.Parameter(
            torch.zeros(_num_merged(layer), dtype=torch.float32, device=device),
            requires_grad=False,
        )

        def input_scale_loader(
            param: nn.Parameter, loaded: Sliceable, shard_id: object = None
        ) -> None:
            value = _read_whole(loaded).float()
            if value.numel() != 1:
                raise ValueError(f"{name}.input_scale: expected one value, got {value.shape}")
            with torch.no_grad():
                param.data[_shard_index(shard_id)] = value.reshape(())

        input_scale.weight_loader = input_scale_loader
        layer.input_scale = input_scale


def _rows_bound(layer: nn.Module) -> int:
    """At least as many rows as any checkpoint projection of `layer` has (a per-tensor scale is
    expanded to them as a view)."""
    return layer.weight.shape[0] * layer.tp.tp_size


def finish_linear(layer: nn.Module) -> None:
    """After loading: one static input scale (the largest of a fused layer's projections), the
    weight quantized under online quantization, and kv_b_proj dequantized (MLA absorbs it)."""
    method: Fp8LinearMethod = layer.quant_method
    config = method.config
    if config.online:
        q, s = quantize_weight_per_row(layer.weight.detach())
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(s, requires_grad=False)
        method.group_k = None
    elif config.scale_name != "weight_scale":
        layer.weight_scale = getattr(layer, config.scale_name)  # the name apply() reads
    if getattr(layer, "input_scale", None) is not None and layer.input_scale.dim() == 1:
        layer.input_scale = nn.Parameter(layer.input_scale.detach().amax(), requires_grad=False)
    if layer.fp8_dequantize_at_load:
        w = dequantize_fp8(layer.weight.detach(), layer.weight_scale.detach(), method.group_k)
        layer.weight = nn.Parameter(w.to(layer.fp8_float_dtype), requires_grad=False)
        layer.quant_method = None


# --- the experts ---


def convert_experts(moe: nn.Module, config: Fp8Config, name: str) -> None:
    """Make a `FusedMoE`'s expert weights FP8 (see `convert_linear`)."""
    if config.expert_dtype == "fp4":
        raise ValueError(
            f"{name}: quantization_config.expert_dtype 'fp4' (MXFP4 experts) loads for "
            "DeepSeek-V4 only"
        )
    if config.activation_scheme == "static" and not config.online:
        raise ValueError(
            f"{name}: quantization_config.activation_scheme 'static' for MoE experts is not "
            "supported (dynamic only)"
        )
    block = config.weight_block_size
    if block and moe.shard_size % block[1] and moe.shard_size != moe.intermediate_size:
        raise ValueError(
            f"{name}: each expert's intermediate shard ({moe.shard_size}) must be a multiple of the "
            f"FP8 block {block[1]} (data_parallel_size x tensor_parallel_size splits it)"
        )
    moe.quant_method = config
    moe.fp8_group_k = config.group_k
    if config.online:
        return
    for which in ("w13", "w2"):
        old = getattr(moe, f"{which}_weight")
        float_loader = old.weight_loader
        e, n, k = old.shape

        def weight_loader(
            param: nn.Parameter,
            loaded: Sliceable,
            shard_id: object = None,
            _float_loader: Any = float_loader,
        ) -> None:
            if not _is_fp8_source(loaded):
                raise ValueError(
                    f"{name}: an expert weight is {_source_dtype(loaded)}, but "
                    "quantization_config says FP8"
                )
            _float_loader(param, loaded, shard_id)

        weight = nn.Parameter(
            torch.empty(e, n, k, dtype=FP8_DTYPE, device=old.device), requires_grad=False
        )
        weight.weight_loader = weight_loader
        setattr(moe, f"{which}_weight", weight)
        num_groups = scale_groups(k, config.group_k)[1]
        scale = nn.Parameter(
            torch.empty(e, n, num_groups, dtype=torch.float32, device=old.device),
            requires_grad=False,
        )
        scale.weight_loader = _expert_scale_loader(moe, name, block, num_groups)
        setattr(moe, f"{which}_{config.scale_name}", scale)


def _expert_scale_loader(
    moe: nn.Module, name: str, block: Optional[tuple[int, int]], num_groups: int
) -> Any:
    def loader(param: nn.Parameter, loaded: Sliceable, shard_id: object = None) -> None:
        kind, expert = shard_id
        full = _read_whole(loaded)
        size, start = moe.shard_size, moe.shard * moe.shard_size
        hidden = param.shape[1] if kind == "down" else moe.w13_weight.shape[2]
        if kind in ("gate", "up"):
            rows = _expand_scale(full, (moe.intermediate_size, hidden), block)
            dst = param.data[expert, :size] if kind == "gate" else param.data[expert, size:]
            copy_checked(dst, read_narrow(rows, 0, start, size), f"{name} expert {expert} {kind}")
        elif kind == "down":
            rows = _expand_scale(full, (hidden, moe.intermediate_size), block)
            if rows.shape[-1] > 1:
                rows = read_narrow(rows, 1, start // block[1] if block else 0, num_groups)
            copy_checked(param.data[expert], rows, f"{name} expert {expert} down")
        else:
            raise ValueError(
                f"{name}: FP8 scales of every expert at once ({kind}) are not supported; "
                "FP8 checkpoints hold each expert's projections"
            )

    return loader


def finish_experts(moe: nn.Module) -> None:
    config: Fp8Config = moe.quant_method
    for which in ("w13", "w2"):
        if config.online:
            q, s = quantize_weight_per_row(getattr(moe, f"{which}_weight").detach())
            setattr(moe, f"{which}_weight", nn.Parameter(q, requires_grad=False))
            setattr(moe, f"{which}_weight_scale", nn.Parameter(s, requires_grad=False))
        elif config.scale_name != "weight_scale":
            setattr(moe, f"{which}_weight_scale", getattr(moe, f"{which}_{config.scale_name}"))
    if config.online:
        moe.fp8_group_k = None


# --- the model ---


def quantize_model(model: nn.Module, config: Fp8Config) -> None:
    """Convert every linear layer (but the ignored ones) and every MoE layer's experts to FP8,
    before the weights load."""
    for name, module in list(model.named_modules()):
        if _is_linear(module):
            absorbed = name.rsplit(".", 1)[-1] in DEQUANTIZED_AT_LOAD
            if not config.is_ignored(name) and not (config.online and absorbed):
                module.fp8_float_dtype = module.weight.dtype
                convert_linear(module, config, name)
        elif _is_experts(module) and not config.is_ignored(name):
            convert_experts(module, config, name)


def finish_quantized_weights(model: nn.Module) -> None:
    """After loading, before the layers derive what they keep (`process_weights_after_loading`)."""
    for module in model.modules():
        if getattr(module, "quant_method", None) is None:
            continue
        if isinstance(module.quant_method, Fp8Config):  # a FusedMoE's experts
            finish_experts(module)
        else:
            finish_linear(module)

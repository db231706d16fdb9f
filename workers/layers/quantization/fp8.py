"""FP8 (e4m3) weights: the checkpoints that ship them and online quantization of float ones.

What loads (`Fp8Config.from_hf`, a config.json's `quantization_config`):

- `quant_method: "fp8"` with `weight_block_size: [128, 128]` (DeepSeek-V2/V3, GLM): e4m3 weights
  with one float32 `weight_scale_inv` per 128x128 block (the factor that dequantizes it); the
  activations are quantized per token and per group of 128 input features, dynamically
  (`activation_scheme: "dynamic"`, the only scheme such checkpoints use).
- `quant_method: "fp8"` without a block size (Llama-class FP8 checkpoints): one `weight_scale` per
  projection (per tensor) or per output row (per channel); activations per token, dynamically, or
  with the checkpoint's `input_scale` (`activation_scheme: "static"`).
- `modules_to_not_convert` / `ignored_layers` name the layers that stay in the checkpoint's float
  dtype. Any other method, scheme, format or block size is refused by name.

Online (`model_config.quantization="fp8"` on a float checkpoint): every linear layer's and every
expert's weight is quantized to e4m3 once loaded, one scale per output row; activations per token,
dynamically.

One layout in the layer, whatever the checkpoint's: `weight` e4m3 [N, K] and a float32 scale
[N, G] per output row and per group of `group_k` input features (G = ceil(K / group_k); group_k =
128 for block-scaled checkpoints, K otherwise). Block scales are expanded to rows at load, so a
fused projection (q/k/v, gate/up) or a tensor-parallel shard may start anywhere: only the input
features of a row-parallel shard must split at group boundaries.

The product: `y = dequant(quant(x)) @ dequant(W)^T`, quant(x) being e4m3 with a float32 scale per
token and activation group (amax / 448) or the static input scale; `fp8_linear` computes it (the
Triton w8a8 GEMM on CUDA, the dequantizing torch reference elsewhere: fp8_ops.py).

MLA's `kv_b_proj` is dequantized to the model's dtype at load: its weight is absorbed into the
query and output (W_UK, W_UV) and used to decompress the latent cache, never as a plain GEMM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from atomrt.workers.layers.weight_utils import Sliceable, copy_checked, read_narrow

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
MIN_SCALE = 1e-12  # a zero group quantizes to zeros under this scale, not NaN
SUPPORTED_BLOCK = (128, 128)
QUANTIZATION_METHODS = ("fp8",)  # model_config.quantization's values
# layers whose weight is absorbed into other products (MLA): dequantized to the model dtype at load
DEQUANTIZED_AT_LOAD = ("kv_b_proj",)
# our fused projections and the checkpoint projections they hold (for ignored-layer lists)
_FUSED_NAMES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}


@dataclass(frozen=True)
class Fp8Config:
    """How a model's weights are FP8 (see the module docstring)."""

    activation_scheme: str = "dynamic"  # dynamic | static
    weight_block_size: Optional[tuple[int, int]] = None  # None: per tensor / per channel
    ignored_layers: tuple[str, ...] = ()
    online: bool = False  # a float checkpoint quantized at load

    @property
    def group_k(self) -> Optional[int]:
        """Input features per weight / activation scale group; None: the whole row."""
        return self.weight_block_size[1] if self.weight_block_size else None

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.weight_block_size else "weight_scale"

    def is_ignored(self, module_name: str) -> bool:
        """Whether `module_name` (ours) stays unquantized: listed itself, under a listed prefix,
        or a fused projection whose checkpoint projections are all listed (some but not all is an
        error: they share one weight)."""
        if _listed(module_name, self.ignored_layers):
            return True
        parent, _, leaf = module_name.rpartition(".")
        parts = _FUSED_NAMES.get(leaf)
        if not parts:
            return False
        listed = [_listed(f"{parent}.{p}" if parent else p, self.ignored_layers) for p in parts]
        if any(listed) and not all(listed):
            raise ValueError(
                f"quantization_config: {module_name} fuses {', '.join(parts)}, which must all be "
                "quantized or all be listed in modules_to_not_convert / ignored_layers"
            )
        return all(listed)

    @staticmethod
    def from_hf(qc: Any, where: str) -> Fp8Config:
        """A config.json's `quantization_config`, checked; anything atomrt cannot run is a
        ValueError naming the field."""
        if not isinstance(qc, dict):
            raise ValueError(f"{where}: quantization_config must be a mapping, got {qc!r}")
        method = qc.get("quant_method")
        if method != "fp8":
            raise ValueError(
                f"{where}: quantization_config.quant_method {method!r} is not supported "
                "(atomrt loads 'fp8' checkpoints: per tensor, per channel or 128x128 blocks)"
            )
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(
                f"{where}: quantization_config.fmt {fmt!r} is not supported (only 'e4m3')"
            )
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(
                f"{where}: quantization_config.activation_scheme {scheme!r}: one of 'dynamic', "
                "'static'"
            )
        block = qc.get("weight_block_size")
        if block is not None:
            if not isinstance(block, (list, tuple)) or tuple(block) != SUPPORTED_BLOCK:
                raise ValueError(
                    f"{where}: quantization_config.weight_block_size {block!r} is not supported "
                    f"(the FP8 kernels take {list(SUPPORTED_BLOCK)})"
                )
            if scheme != "dynamic":
                raise ValueError(
                    f"{where}: quantization_config.activation_scheme 'static' with "
                    "weight_block_size: block-scaled checkpoints quantize activations dynamically"
                )
            block = SUPPORTED_BLOCK
        ignored: list[str] = []
        for key in ("modules_to_not_convert", "ignored_layers"):
            names = qc.get(key) or []
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
                raise ValueError(
                    f"{where}: quantization_config.{key} must be a list of names, got {names!r}"
                )
            ignored.extend(names)
        return Fp8Config(scheme, block, tuple(ignored))


def _listed(name: str, entries: tuple[str, ...]) -> bool:
    """`name` is an entry, lies under one, or holds one as a run of its dotted parts."""
    dotted = f".{name}."
    return any(e and f".{e.strip('.')}." in dotted for e in entries)


def resolve_fp8_config(
    quantization: Optional[str], hf_quantization: Any, where: str
) -> Optional[Fp8Config]:
    """The model's FP8 configuration from `model_config.quantization` and the checkpoint's
    `quantization_config` (None: a float model)."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"model_config.quantization={quantization!r} is not supported "
            f"(one of {list(QUANTIZATION_METHODS)})"
        )
    if hf_quantization:
        cfg = Fp8Config.from_hf(hf_quantization, where)
        return cfg  # quantization "fp8" (or None) on an FP8 checkpoint: as it ships
    if quantization == "fp8":
        return Fp8Config(online=True)
    return None


# --- the numerics ---


def _groups(k: int, group_k: Optional[int]) -> tuple[int, int]:
    """(group size, number of groups) of `k` input features."""
    g = k if group_k is None else group_k
    return g, max(1, math.ceil(k / g))


def quantize_fp8(
    x: torch.Tensor, group_k: Optional[int], static_scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], float32 scales [..., G]): each row's groups of `group_k`
    features (None: the whole row) scaled by amax / 448, or every element by `static_scale`."""
    k = x.shape[-1]
    xf = x.to(_compute_dtype(x))
    if static_scale is not None:
        scale = static_scale.to(xf.dtype).reshape(1).expand(*x.shape[:-1], 1)
        q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, scale.float().contiguous()
    g, num = _groups(k, group_k)
    pad = num * g - k
    padded = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
    grouped = padded.view(*x.shape[:-1], num, g)
    scale = (grouped.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [..., G]
    q = (grouped / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*x.shape[:-1], num * g)[..., :k], scale.float()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for a float64 input (a reference model's)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    group_k: Optional[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """e4m3 [..., K] with float32 scales [..., G] -> [..., K] in `dtype`."""
    k = q.shape[-1]
    g, num = _groups(k, group_k)
    if scale.shape[-1] == 1:
        return q.to(dtype) * scale.to(dtype)
    expanded = scale.to(dtype).repeat_interleave(g, dim=-1)[..., :k]
    return q.to(dtype) * expanded


def quantize_weight_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., N, K] -> (e4m3 [..., N, K], float32 scale [..., N, 1]): online
    quantization, one scale per output row."""
    return quantize_fp8(w, None)


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: Optional[torch.Tensor],
    group_k: Optional[int],
) -> torch.Tensor:
    """The dequantizing reference of `fp8_linear`, in float32 (float64 for a float64 x),
    returned in x's dtype."""
    dtype = _compute_dtype(x)
    q, s = quantize_fp8(x, group_k, input_scale)
    x_deq = dequantize_fp8(q, s, None if input_scale is not None else group_k, dtype)
    w_deq = dequantize_fp8(weight, weight_scale, group_k, dtype)
    return torch.nn.functional.linear(x_deq, w_deq).to(x.dtype)


# --- the layers ---


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
        from atomrt.workers.layers.quantization.fp8_ops import fp8_linear_op

        return fp8_linear_op(x, layer.weight, scale, input_scale, self.group_k)


def _num_merged(layer: nn.Module) -> int:
    from atomrt.workers.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(layer, QKVParallelLinear):
        return 3
    if isinstance(layer, MergedColumnParallelLinear):
        return len(layer.output_sizes_per_rank)
    return 1


def _shard_index(shard_id: object) -> int:
    if shard_id is None:
        return 0
    if isinstance(shard_id, int):
        return shard_id
    return ("q", "k", "v").index(shard_id)


def convert_linear(layer: nn.Module, config: Fp8Config, name: str) -> None:
    """Make a `_LinearBase` layer FP8: its weight e4m3 (a float weight under online quantization,
    quantized by `finish_linear`), its scales as parameters the checkpoint fills."""
    from atomrt.workers.layers.linear import RowParallelLinear

    n, k = layer.weight.shape
    device = layer.weight.device
    row_parallel = isinstance(layer, RowParallelLinear)
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
    num_groups = _groups(k, config.group_k)[1]
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
        num_groups = _groups(k, config.group_k)[1]
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


def fp8_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    group_k: Optional[int],
) -> torch.Tensor:
    """The dequantizing reference of the FP8 experts: per expert, the routed rows through
    `fp8_linear_ref` (gate/up), silu(gate) * up, `fp8_linear_ref` (down), weighted and summed."""
    from atomrt.workers.layers.activation import silu_and_mul

    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    weights = topk_weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        h = silu_and_mul(fp8_linear_ref(x[tokens], w13[expert], w13_scale[expert], None, group_k))
        y = fp8_linear_ref(h, w2[expert], w2_scale[expert], None, group_k)
        out.index_add_(0, tokens, y * weights[pairs, None].to(x.dtype))
    return out


# --- the model ---


def quantize_model(model: nn.Module, config: Fp8Config) -> None:
    """Convert every linear layer (but the ignored ones) and every MoE layer's experts to FP8,
    before the weights load."""
    from atomrt.workers.layers.linear import _LinearBase
    from atomrt.workers.layers.moe import FusedMoE

    for name, module in list(model.named_modules()):
        if isinstance(module, _LinearBase):
            absorbed = name.rsplit(".", 1)[-1] in DEQUANTIZED_AT_LOAD
            if not config.is_ignored(name) and not (config.online and absorbed):
                module.fp8_float_dtype = module.weight.dtype
                convert_linear(module, config, name)
        elif isinstance(module, FusedMoE) and not config.is_ignored(name):
            convert_experts(module, config, name)


def finish_quantized_weights(model: nn.Module) -> None:
    """After loading, before the layers derive what they keep (`process_weights_after_loading`)."""
    from atomrt.workers.layers.moe import FusedMoE

    for module in model.modules():
        if getattr(module, "quant_method", None) is None:
            continue
        if isinstance(module, FusedMoE):
            finish_experts(module)
        else:
            finish_linear(module)

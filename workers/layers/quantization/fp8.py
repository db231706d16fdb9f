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
- `kv_cache_scheme`, where present, must be static float8 scales per tensor (the FP8 KV cache's,
  loaded by workers/loading/kv_scales.py).

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

This module is the configuration and the numerics (it imports no layer); the layers' conversion
is fp8_layers.py, the custom ops and their kernels fp8_ops.py.

MLA's `kv_b_proj` is dequantized to the model's dtype at load: its weight is absorbed into the
query and output (W_UK, W_UV) and used to decompress the latent cache, never as a plain GEMM.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch

from atomrt.workers.layers.activation import silu_and_mul
from atomrt.workers.layers.quantization.mxfp4 import check_quantization_fields

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
    "q_kv_a_proj": ("q_proj", "kv_a_proj_with_mqa"),
}


@dataclass(frozen=True)
class Fp8Config:
    """How a model's weights are FP8 (see the module docstring)."""

    activation_scheme: str = "dynamic"  # dynamic | static
    weight_block_size: Optional[tuple[int, int]] = None  # None: per tensor / per channel
    ignored_layers: tuple[str, ...] = ()
    online: bool = False  # a float checkpoint quantized at load
    # the experts' format, where the config names it: "fp4" is MXFP4 (DeepSeek-V4's routed
    # experts, held as they ship: mxfp4.py); None or "fp8": e4m3 like the other weights
    expert_dtype: Optional[str] = None

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
        _check_kv_cache_scheme(qc.get("kv_cache_scheme"), where)
        check_quantization_fields(qc, where)
        ignored: list[str] = []
        for key in ("modules_to_not_convert", "ignored_layers"):
            names = qc.get(key) or []
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
                raise ValueError(
                    f"{where}: quantization_config.{key} must be a list of names, got {names!r}"
                )
            ignored.extend(names)
        return Fp8Config(scheme, block, tuple(ignored), expert_dtype=qc.get("expert_dtype"))


def _check_kv_cache_scheme(scheme: Any, where: str) -> None:
    """`kv_cache_scheme` (compressed-tensors' name): the checkpoint's KV cache scales, shipped as
    `k_proj.output_scale` / `v_proj.output_scale` (workers/loading/kv_scales.py). atomrt's FP8 cache
    takes static float8 scales, one per tensor; anything else is refused by name."""
    if scheme is None:
        return
    field = f"{where}: quantization_config.kv_cache_scheme"
    if not isinstance(scheme, dict):
        raise ValueError(f"{field} must be a mapping, got {scheme!r}")
    wanted = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    for key, value in wanted.items():
        got = scheme.get(key, value if key in ("strategy", "dynamic") else None)
        if got != value:
            raise ValueError(
                f"{field}.{key} {got!r} is not supported (atomrt's FP8 KV cache takes static "
                "8-bit float scales, one per tensor)"
            )


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


def scale_groups(k: int, group_k: Optional[int]) -> tuple[int, int]:
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
    g, num = scale_groups(k, group_k)
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
    g, num = scale_groups(k, group_k)
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


def fp8_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    group_k: Optional[int],
    sum_pairs: bool = True,
) -> torch.Tensor:
    """The dequantizing reference of the FP8 experts: per expert, the routed rows through
    `fp8_linear_ref` (gate/up), silu(gate) * up, `fp8_linear_ref` (down), weighted, each pair's
    row written in place; summed over a token's top_k pairs, or the pairs [n, top_k, hidden] with
    `sum_pairs=False`."""
    num_tokens, top_k = topk_ids.shape
    per_pair = x.new_zeros(num_tokens * top_k, x.shape[1])  # [pairs, hidden]
    weights = topk_weights.reshape(-1)
    for expert, pairs, tokens in routed_pairs(topk_ids, w13.shape[0]):
        h = silu_and_mul(fp8_linear_ref(x[tokens], w13[expert], w13_scale[expert], None, group_k))
        y = fp8_linear_ref(h, w2[expert], w2_scale[expert], None, group_k)
        per_pair[pairs] = y * weights[pairs, None].to(x.dtype)
    out = per_pair.view(num_tokens, top_k, x.shape[1])
    return out.sum(dim=1) if sum_pairs else out


def routed_pairs(
    topk_ids: torch.Tensor, num_experts: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, pairs, tokens) for each expert a routing [num_tokens, top_k] sends rows to: its
    pairs (token * top_k + slot, in token order) and their tokens. The torch references' loop (the
    float experts' in moe.py too)."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs, expert by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        yield expert, pairs, pairs // top_k

"""MXFP4 weights: the format, its scales, and a checkpoint's MXFP4 weight as it ships.

MXFP4 (OCP microscaling): 4-bit e2m1 values (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1,
1.5, 2, 3, 4, 6 and their negatives), two per byte, the even column in the low nibble; one e8m0
scale (a power of two, 2^(byte - 127)) per 32 consecutive values of a row. A weight [N, K] ships
as packed bytes [N, K / 2] (int8, uint8 or float4_e2m1fn_x2) and its scale [N, K / 32]
(float8_e8m0fnu, or uint8 holding the exponent byte). DeepSeek-V4 ships its routed experts so;
v4_checkpoint.py streams such a checkpoint in.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from atomrt.workers.layers.weight_utils import read_all, shape_of

MXFP4_BLOCK = 32  # values per e8m0 scale
FP8_BLOCK = 128  # V4's FP8 projections: one scale per 128x128 block
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; bit 3 is the sign
EXPERT_DTYPES = ("fp8", "fp4")  # quantization_config.expert_dtype's values
SCALE_FORMATS = ("ue8m0",)  # quantization_config.scale_fmt's values (float32 scales: absent)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": _E8M0,
    "F4": _FP4X2,
}


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 e2m1 codes' values, float32."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat((values, -values))


def e8m0_to_float(scale: torch.Tensor, name: str) -> torch.Tensor:
    """An e8m0 scale (float8_e8m0fnu, or uint8 exponent bytes) as float32 powers of two."""
    if _E8M0 is not None and scale.dtype == _E8M0:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise ValueError(
            f"{name}: an e8m0 scale must be float8_e8m0fnu or uint8, not {scale.dtype}"
        )
    if bool((scale == 255).any()):
        raise ValueError(f"{name}: an e8m0 scale holds NaN (0xff)")
    return torch.exp2(scale.to(torch.float32) - 127.0)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K / 2] bytes -> [..., K] float32: the low nibble is the even column."""
    u8 = packed.contiguous().view(torch.uint8)
    table = e2m1_table(packed.device)
    values = torch.stack((table[(u8 & 0xF).long()], table[(u8 >> 4).long()]), dim=-1)
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """An MXFP4 weight ([N, K / 2] packed, [N, K / 32] e8m0) as float32 [N, K]."""
    if packed.dtype not in (torch.int8, torch.uint8) and packed.dtype != _FP4X2:
        raise ValueError(
            f"{name}: an MXFP4 weight is packed e2m1 pairs (int8, uint8 or float4_e2m1fn_x2), "
            f"not {packed.dtype}"
        )
    values = unpack_e2m1(packed)
    rows, k = values.shape
    if tuple(scale.shape) != (rows, k // MXFP4_BLOCK) or k % MXFP4_BLOCK:
        raise ValueError(
            f"{name}: an MXFP4 weight of {rows} x {k} values takes a scale of "
            f"{(rows, k // MXFP4_BLOCK)} (one per {MXFP4_BLOCK} values), not {tuple(scale.shape)}"
        )
    factors = e8m0_to_float(scale, name).repeat_interleave(MXFP4_BLOCK, dim=1)
    return values * factors


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] (K a multiple of 32) -> (packed uint8 [N, K / 2], e8m0 exponent bytes uint8
    [N, K / 32]): each group of 32 over the smallest power of two that brings its largest |value|
    to at most 6, rounded to the nearest e2m1 value. Values an MXFP4 weight dequantized to come
    back as the same values (so a dequantized checkpoint packs again without loss)."""
    n, k = w.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"quantize_mxfp4: {k} input features is not a multiple of {MXFP4_BLOCK}")
    groups = w.to(torch.float32).reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = groups.abs().amax(-1)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127.0, 127.0)  # amax 0: -inf -> -127
    scaled = groups / torch.exp2(exponent)[..., None]
    # the nearest magnitude's code: the midpoints between e2m1's magnitudes split them
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    codes = torch.bucketize(scaled.abs(), (table[1:] + table[:-1]) / 2).to(torch.uint8)
    codes = (codes | ((scaled < 0).to(torch.uint8) << 3)).reshape(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (exponent + 127).to(torch.uint8)


def block_scale_rows(scale: torch.Tensor, weight_shape: tuple[int, int], name: str) -> torch.Tensor:
    """A checkpoint's block scale [ceil(N/128), ceil(K/128)] (e8m0 or float32) as float32
    [N, ceil(K/128)]: each block's scale repeated over its rows."""
    n, k = weight_shape
    grid = (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"{name}: an FP8 weight of {n} x {k} takes a scale per {FP8_BLOCK}x{FP8_BLOCK} block, "
            f"{grid}, not {tuple(scale.shape)}"
        )
    if scale.dtype in (torch.float32, torch.bfloat16, torch.float16):
        factors = scale.to(torch.float32)
    else:
        factors = e8m0_to_float(scale, name)
    return factors.repeat_interleave(FP8_BLOCK, dim=0)[:n].contiguous()


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """An e4m3 weight [N, K] with a scale per 128x128 block ([ceil(N/128), ceil(K/128)], e8m0 or
    float32) as float32 [N, K]."""
    rows = block_scale_rows(scale, tuple(weight.shape), name)
    return weight.to(torch.float32) * rows.repeat_interleave(FP8_BLOCK, 1)[:, : weight.shape[1]]


def expert_dtype_of(hf_config: dict[str, Any]) -> Optional[str]:
    """`expert_dtype` from the quantization config, or the config's top level (DeepSeek-V4's
    first checkpoints put it there)."""
    qc = hf_config.get("quantization_config")
    inner = qc.get("expert_dtype") if isinstance(qc, dict) else None
    return inner if inner is not None else hf_config.get("expert_dtype")


def check_quantization_fields(qc: dict[str, Any], where: str) -> None:
    """`expert_dtype` and `scale_fmt` of a quantization_config, checked by name."""
    expert_dtype = qc.get("expert_dtype")
    if expert_dtype is not None and expert_dtype not in EXPERT_DTYPES:
        raise ValueError(
            f"{where}: quantization_config.expert_dtype {expert_dtype!r} is not supported "
            f"(one of {list(EXPERT_DTYPES)})"
        )
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt is not None and scale_fmt not in SCALE_FORMATS:
        raise ValueError(
            f"{where}: quantization_config.scale_fmt {scale_fmt!r} is not supported "
            f"(one of {list(SCALE_FORMATS)}, or float32 scales without it)"
        )


def dtype_of(weight: Any) -> Optional[torch.dtype]:
    """A tensor's or a safetensors slice's dtype (None for one torch does not name)."""
    if isinstance(weight, torch.Tensor):
        return weight.dtype
    return _SAFETENSORS_DTYPES.get(weight.get_dtype())


def is_quantized(dtype: Optional[torch.dtype]) -> bool:
    return dtype is not None and (
        dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn) or dtype == _FP4X2
    )


class MXFP4Weight:
    """A checkpoint's MXFP4 weight as it ships, read lazily: `packed` [N, K / 2] e2m1 pairs and
    `scale` [N, K / 32] e8m0 exponents (tensors or safetensors slices). `get_shape()` is the
    weight's [N, K], what a loader checks it against; `narrow` reads a slice of rows or of whole
    32-feature groups, packed."""

    def __init__(self, packed: Any, scale: Any, name: str) -> None:
        self.packed, self.scale, self.name = packed, scale, name
        rows, half = shape_of(packed)
        if dtype_of(packed) not in (torch.int8, torch.uint8) and dtype_of(packed) != _FP4X2:
            raise ValueError(
                f"{name}: an MXFP4 weight is packed e2m1 pairs (int8, uint8 or "
                f"float4_e2m1fn_x2), not {dtype_of(packed)}"
            )
        if dtype_of(scale) not in (torch.uint8, _E8M0):
            raise ValueError(
                f"{name}: an e8m0 scale must be float8_e8m0fnu or uint8, not {dtype_of(scale)}"
            )
        if tuple(shape_of(scale)) != (rows, 2 * half // MXFP4_BLOCK) or (2 * half) % MXFP4_BLOCK:
            raise ValueError(
                f"{name}: an MXFP4 weight of {rows} x {2 * half} values takes a scale of "
                f"{(rows, 2 * half // MXFP4_BLOCK)} (one per {MXFP4_BLOCK} values), not "
                f"{tuple(shape_of(scale))}"
            )

    def get_shape(self) -> tuple[int, int]:
        rows, half = shape_of(self.packed)
        return rows, 2 * half

    def narrow(self, dim: int, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed uint8, exponent bytes uint8) of rows [start, start + size) (dim 0) or of input
        features [start, start + size) (dim 1: whole 32-feature groups)."""
        if dim == 0:
            packed = self.packed[start : start + size]
            scale = self.scale[start : start + size]
        else:
            if start % MXFP4_BLOCK or size % MXFP4_BLOCK:
                raise ValueError(
                    f"{self.name}: input features {start}..{start + size} do not split at whole "
                    f"{MXFP4_BLOCK}-feature scale groups"
                )
            packed = self.packed[:, start // 2 : (start + size) // 2]
            scale = self.scale[:, start // MXFP4_BLOCK : (start + size) // MXFP4_BLOCK]
        scale = scale.contiguous().view(torch.uint8)
        if bool((scale == 255).any()):
            raise ValueError(f"{self.name}: an e8m0 scale holds NaN (0xff)")
        return packed.contiguous().view(torch.uint8), scale

    def dequantize(self) -> torch.Tensor:
        """The whole weight, float32 [N, K]."""
        return dequantize_mxfp4(read_all(self.packed), read_all(self.scale), self.name)

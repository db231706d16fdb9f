"""MXFP4 weights, and DeepSeek-V4's quantized checkpoint as it streams in.

MXFP4 (OCP microscaling): 4-bit e2m1 values (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1,
1.5, 2, 3, 4, 6 and their negatives), two per byte, the even column in the low nibble; one e8m0
scale (a power of two, 2^(byte - 127)) per 32 consecutive values of a row. A weight [N, K] ships
as packed bytes [N, K / 2] (int8, uint8 or float4_e2m1fn_x2) and its scale [N, K / 32]
(float8_e8m0fnu, or uint8 holding the exponent byte).

DeepSeek-V4 checkpoints (`quantization_config.expert_dtype: "fp4"`, or the config's top-level
`expert_dtype`) ship the routed experts so: `...ffn.experts.<e>.w1/w2/w3.weight` packed and
`...ffn.experts.<e>.w1/w2/w3.scale`. The other quantized projections are FP8 (e4m3) with one
`.scale` per 128x128 block (`weight_block_size: [128, 128]`, ue8m0 or float32); a checkpoint
transformers wrote may name a scale `.weight_scale_inv`. `v4_weights` pairs each quantized weight
with its scale. The FP8 projections come as they ship, e4m3, with the block scale as one float32
row per weight row (`<name>.weight_scale`), into the FP8 layers that v4_fp8.py puts in their
place, which run them w8a8 (1x128 dynamic activation quantization). An FP8 weight for a
projection the model holds in 16 bits (one a checkpoint quantizes beyond what V4 ships FP8) is
dequantized to float32 under its own name. The routed experts come as they ship too
(`MXFP4Weight`), into MoE layers that hold them so (`v4_checkpoint_weights`, V4MoE.keep_mxfp4)
and run them with 16-bit activations as Hopper does (the w4a16 fused-MoE kernel on CUDA). A float
weight without a scale loads as it is (the checkpoint's norms, router, embeddings, LM head, the
compressors' projections); anything else -- a quantized weight without its scale, a scale without
its weight, a float weight for an FP8 projection, a routed expert that is not MXFP4 where the
config says so, an unknown dtype or a scale grid that does not fit -- is refused by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import torch

from atomrt.workers.layers.weight_utils import read_all, shape_of

MXFP4_BLOCK = 32  # values per e8m0 scale
FP8_BLOCK = 128  # V4's FP8 projections: one scale per 128x128 block
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; bit 3 is the sign
EXPERT_DTYPES = ("fp8", "fp4")  # quantization_config.expert_dtype's values
SCALE_FORMATS = ("ue8m0",)  # quantization_config.scale_fmt's values (float32 scales: absent)
# a weight's scale: DeepSeek's name, and transformers' (as its FP8 quantizer renames it)
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_ROUTED = re.compile(r"\.experts\.\d+\.w[123]\.(weight|scale)$")
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


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """An e4m3 weight [N, K] with a scale per 128x128 block ([ceil(N/128), ceil(K/128)], e8m0 or
    float32) as float32 [N, K]."""
    n, k = weight.shape
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
    factors = factors.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return weight.to(torch.float32) * factors


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


def _dtype_of(weight: Any) -> Optional[torch.dtype]:
    """A tensor's or a safetensors slice's dtype (None for one torch does not name)."""
    if isinstance(weight, torch.Tensor):
        return weight.dtype
    return _SAFETENSORS_DTYPES.get(weight.get_dtype())


def _is_quantized(dtype: Optional[torch.dtype]) -> bool:
    return dtype is not None and (
        dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn) or dtype == _FP4X2
    )


def v4_weights(
    weights: Iterable[tuple[str, Any]],
    expert_dtype: Optional[str],
    where: str,
    fp8_layers: Optional[FP8Layers] = None,
) -> Iterator[tuple[str, Any]]:
    """A DeepSeek-V4 checkpoint's tensors with each quantized weight dequantized (float32) under
    its own name and its `.scale` consumed (see the module docstring). `expert_dtype` "fp4":
    every routed expert's weight must be MXFP4, and comes as it ships (an `MXFP4Weight`). The
    projections `fp8_layers` holds in FP8 take their e4m3 weight as it ships and its block scale
    as `<name>.weight_scale`, one row per weight row (v4_fp8.py)."""
    fp8_layers = fp8_layers or FP8Layers(set(), lambda name: name)
    scales: dict[str, Any] = {}  # a weight's scale, until the weight comes
    scale_names: dict[str, str] = {}
    waiting: dict[str, Any] = {}  # a quantized weight, until its scale comes
    for name, weight in weights:
        suffix = next((x for x in _SCALE_SUFFIXES if name.endswith(x)), None)
        if suffix is not None:
            base = name[: -len(suffix)]
            if base + ".weight" in waiting:
                pending = waiting.pop(base + ".weight")
                yield from _paired(base, pending, weight, expert_dtype, fp8_layers, where)
            else:
                scales[base], scale_names[base] = weight, name
            continue
        if not name.endswith(".weight"):
            yield name, weight
            continue
        base = name[: -len(".weight")]
        if base in scales:
            yield from _paired(base, weight, scales.pop(base), expert_dtype, fp8_layers, where)
        elif _is_quantized(_dtype_of(weight)):
            waiting[name] = weight
        else:
            if fp8_layers.holds(base):
                raise ValueError(
                    f"{where}: {name} is {_dtype_of(weight)} without a .scale, but "
                    "quantization_config says FP8 with 128x128 blocks (list the layer in "
                    "modules_to_not_convert)"
                )
            if expert_dtype == "fp4" and _ROUTED.search(name):
                raise ValueError(
                    f"{where}: {name} is {_dtype_of(weight)}, but quantization_config."
                    "expert_dtype 'fp4' ships routed experts as MXFP4 (packed e2m1 and a .scale)"
                )
            yield name, weight
    if waiting:
        raise ValueError(f"{where}: quantized weights without a .scale: {sorted(waiting)[:4]}")
    for base, scale in scales.items():  # no weight of that name: a tensor of the model's own
        yield scale_names[base], scale


class MXFP4Weight:
    """A checkpoint's MXFP4 weight as it ships, read lazily: `packed` [N, K / 2] e2m1 pairs and
    `scale` [N, K / 32] e8m0 exponents (tensors or safetensors slices). `get_shape()` is the
    weight's [N, K], what a loader checks it against; `narrow` reads a slice of rows or of whole
    32-feature groups, packed."""

    def __init__(self, packed: Any, scale: Any, name: str) -> None:
        self.packed, self.scale, self.name = packed, scale, name
        rows, half = shape_of(packed)
        if _dtype_of(packed) not in (torch.int8, torch.uint8) and _dtype_of(packed) != _FP4X2:
            raise ValueError(
                f"{name}: an MXFP4 weight is packed e2m1 pairs (int8, uint8 or "
                f"float4_e2m1fn_x2), not {_dtype_of(packed)}"
            )
        if _dtype_of(scale) not in (torch.uint8, _E8M0):
            raise ValueError(
                f"{name}: an e8m0 scale must be float8_e8m0fnu or uint8, not {_dtype_of(scale)}"
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


class FP8Layers:
    """The projections a V4 model holds in FP8 (our module names) and `checkpoint_name`, the
    model's map from a checkpoint tensor's name to ours."""

    def __init__(self, names: set[str], checkpoint_name: Callable[[str], str]) -> None:
        self.names, self.checkpoint_name = names, checkpoint_name

    def holds(self, base: str) -> bool:
        """Whether checkpoint weight `<base>.weight` goes to a projection held in FP8."""
        return bool(self.names) and self.checkpoint_name(base + ".weight")[:-7] in self.names


def _paired(
    base: str,
    weight: Any,
    scale: Any,
    expert_dtype: Optional[str],
    fp8_layers: FP8Layers,
    where: str,
) -> Iterator[tuple[str, Any]]:
    """A quantized weight and its scale, as the model takes them."""
    name = base + ".weight"
    if expert_dtype == "fp4" and _ROUTED.search(name) is not None:
        yield name, MXFP4Weight(weight, scale, f"{where}: {name}")  # the layer packs it as is
        return
    if fp8_layers.holds(base):
        from atomrt.workers.layers.quantization.v4_fp8 import block_scale_rows

        if _dtype_of(weight) != torch.float8_e4m3fn:
            raise ValueError(
                f"{where}: {name} is {_dtype_of(weight)} with a .scale, but "
                "quantization_config says FP8 (e4m3) with 128x128 blocks"
            )
        rows = block_scale_rows(read_all(scale), shape_of(weight), f"{where}: {name}")
        yield name, weight
        yield base + ".weight_scale", rows
        return
    w, s = read_all(weight), read_all(scale)
    if w.dtype == torch.float8_e4m3fn:
        yield name, dequantize_fp8_block(w, s, f"{where}: {name}")
        return
    raise ValueError(
        f"{where}: {name} is {w.dtype} with a .scale: atomrt loads DeepSeek-V4's FP8 (e4m3, "
        "128x128 blocks) weights and, with quantization_config.expert_dtype 'fp4', its MXFP4 "
        "routed experts"
    )


def v4_checkpoint_weights(
    model: Any,
    weights: Iterable[tuple[str, Any]],
    fp8: Any,
    hf_config: dict[str, Any],
    where: str,
) -> Iterator[tuple[str, Any]]:
    """`v4_weights` for a DeepSeek-V4 checkpoint of config `hf_config`, whose FP8 configuration
    (fp8.py's Fp8Config, None for a float checkpoint) is `fp8`. With MXFP4 routed experts, the
    model's MoE layers first take them as such (`keep_mxfp4`), holding 4.25 bits per weight;
    with FP8 projections, the model's projections that ship so become FP8 layers first
    (v4_fp8.py's `keep_fp8_linears`)."""
    if fp8 is not None and fp8.online:
        raise ValueError(
            f"{where}: model_config.quantization='fp8' does not quantize DeepSeek-V4 at load: its "
            "checkpoints ship FP8 and MXFP4 weights, which load as they are"
        )
    expert_dtype = expert_dtype_of(hf_config)
    check_quantization_fields({"expert_dtype": expert_dtype}, where)
    if expert_dtype == "fp4":
        for module in model.modules():
            keep = getattr(module, "keep_mxfp4", None)
            if keep is not None:
                keep()
    fp8_layers = None
    if fp8 is not None:  # the projections the checkpoint ships in FP8 stay so
        from atomrt.workers.layers.quantization.v4_fp8 import keep_fp8_linears

        kept = keep_fp8_linears(model, fp8, where)
        fp8_layers = FP8Layers(kept, getattr(model, "checkpoint_name", lambda name: name))
    return v4_weights(weights, expert_dtype, where, fp8_layers)

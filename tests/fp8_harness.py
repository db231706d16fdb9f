"""FP8 checkpoints made from tiny transformers models, and their float64 references.

`quantize_folder` writes an FP8 checkpoint the way FP8 checkpoints ship: e4m3 weights with
`weight_scale_inv` per 128x128 block (DeepSeek-V3's layout, `weight_block_size: [128, 128]`) or a
`weight_scale` per tensor / per channel (and `input_scale` under `activation_scheme: static`, as
Llama FP8 checkpoints ship), `quantization_config` in config.json; the router, norms, embeddings and
LM head stay float. Beside it, `dequantized_folder` holds the same model with every FP8 weight
replaced by its dequantized value, in the source's layout.

`reference_model` loads that folder with transformers in float64 and quantizes each quantized
layer's input as atomrt's FP8 GEMM does (per token and group of 128 features for block weights,
per token otherwise, the static input scale when there is one: the largest of a fused
projection's), dequantizing before the product: the float64 model of the quantized checkpoint.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
SCHEMES = ("block", "tensor", "channel", "tensor_static")
_QUANTIZED = re.compile(r"_proj(_with_mqa)?\.weight$")
_FUSED = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
    "q_a_proj": "qkv_a",
    "kv_a_proj_with_mqa": "qkv_a",
}


def _block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    nb, kb = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    padded = F.pad(w.double(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    blocks = padded.view(nb, BLOCK, kb, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous(), scale.float()


def _block_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    s = scale.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return q.double() * s


def quantize_folder(
    src: Path,
    dst: Path,
    scheme: str,
    deq: Path,
    ignored: tuple[str, ...] = (),
    seed: int = 0,
) -> dict[str, float]:
    """Write the FP8 checkpoint of float folder `src` to `dst` and its dequantized float twin to
    `deq`; tensors whose name starts with an `ignored` entry stay float (listed in
    modules_to_not_convert). Returns the static input scales by projection (tensor_static)."""
    assert scheme in SCHEMES
    gen = torch.Generator().manual_seed(seed)
    for folder in (dst, deq):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    fp8_tensors: dict[str, torch.Tensor] = {}
    deq_tensors: dict[str, torch.Tensor] = {}
    input_scales: dict[str, float] = {}
    for file in sorted(src.glob("*.safetensors")):
        for name, w in load_file(str(file)).items():
            deq_tensors[name] = w
            if not _QUANTIZED.search(name) or any(name.startswith(i) for i in ignored):
                fp8_tensors[name] = w
                continue
            stem = name[: -len(".weight")]
            wd = w.double()
            if scheme == "block":
                q, s = _block_quantize(wd)
                fp8_tensors[name], fp8_tensors[f"{stem}.weight_scale_inv"] = q, s
                deq_tensors[name] = _block_dequantize(q, s).to(w.dtype)
                continue
            if scheme == "channel":
                s = (wd.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [N, 1]
            else:
                s = (wd.abs().amax() / FP8_MAX).reshape(())
            q = (wd / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            fp8_tensors[name], fp8_tensors[f"{stem}.weight_scale"] = q, s.float()
            deq_tensors[name] = (q.double() * s.float().double()).to(w.dtype)
            if scheme == "tensor_static":
                value = 0.01 + 0.02 * torch.rand((), generator=gen).item()
                fp8_tensors[f"{stem}.input_scale"] = torch.tensor(value, dtype=torch.float32)
                input_scales[stem] = float(torch.tensor(value, dtype=torch.float32))
    save_file(fp8_tensors, str(dst / "model.safetensors"))
    save_file(deq_tensors, str(deq / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    qc: dict = {
        "quant_method": "fp8",
        "activation_scheme": "static" if scheme == "tensor_static" else "dynamic",
    }
    if scheme == "block":
        qc["weight_block_size"] = [BLOCK, BLOCK]
    if ignored:
        qc["modules_to_not_convert"] = list(ignored)
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return input_scales


def qdq(x: torch.Tensor, group: Optional[int], static: Optional[float] = None) -> torch.Tensor:
    """x quantized to e4m3 and back, in float64: per row and group of `group` features (None: the
    whole row), or by a static scale."""
    x = x.double()
    if static is not None:
        return (x / static).clamp(-FP8_MAX, FP8_MAX).to(FP8).double() * static
    k = x.shape[-1]
    g = k if group is None else group
    num = math.ceil(k / g)
    padded = F.pad(x, (0, num * g - k)).view(*x.shape[:-1], num, g)
    s = (padded.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (padded / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).double() * s
    return q.view(*x.shape[:-1], num * g)[..., :k]


def reference_model(
    deq: Path,
    scheme: str,
    ignored: tuple[str, ...] = (),
    input_scales: Optional[dict[str, float]] = None,
) -> torch.nn.Module:
    """transformers' model of `deq` in float64 with the FP8 activation quantization (see the
    module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        deq, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    group = BLOCK if scheme == "block" else None
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        quantized = isinstance(module, torch.nn.Linear) and leaf.endswith(("_proj", "_mqa"))
        if not quantized or leaf == "kv_b_proj" or any(name.startswith(i) for i in ignored):
            continue  # kv_b_proj: atomrt absorbs its dequantized weight into MLA
        static = None
        if input_scales is not None:
            parent = name.rsplit(".", 1)[0]
            siblings = [p for p, f in _FUSED.items() if f == _FUSED.get(leaf)] or [leaf]
            static = max(input_scales[f"{parent}.{p}"] for p in siblings)
        module.register_forward_pre_hook(
            lambda _m, args, _s=static: (qdq(args[0], group, _s).to(args[0].dtype),)
        )
    for module in model.modules():
        if type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj"):
            module.forward = _fp8_experts_forward(module, group)
    return model


def _fp8_experts_forward(experts: torch.nn.Module, group: Optional[int]):
    """transformers' expert loop with each GEMM's input quantized."""

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(experts.num_experts):
            token_idx, slot = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            x = qdq(hidden_states[token_idx], group)
            gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = qdq(F.silu(gate) * up, group)
            y = F.linear(h, experts.down_proj[e]) * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    return forward


def reference_logits(model: torch.nn.Module, sequence: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0]

"""DeepSeek-V4's FP8 projections held as they ship: e4m3 weights with a scale per 128x128 block.

A V4 checkpoint whose `quantization_config` is `quant_method: "fp8"` with `weight_block_size:
[128, 128]` ships these of the model's projections as e4m3 with a `.scale` per block (ue8m0, a
power of two, or float32): the attention's `wq_a`, `wq_b`, `wkv`, the grouped output projection
`wo_a` and `wo_b`, the indexer's `wq_b`, and the shared expert's `w1`, `w2`, `w3`. The
compressors' `wkv` / `wgate` and the indexer's `weights_proj` ship in 16 bits (transformers keeps
them so too), as do the router, the norms, the hyper-connections, the embeddings and the head.

`keep_fp8_linears` replaces each such projection (but those `modules_to_not_convert` lists) by a
`BlockFp8Linear` before the weights load: `weight` e4m3 [N, K] and `weight_scale` float32 [N, G]
(G = ceil(K / 128)), the block scale repeated over its 128 rows -- fp8.py's layout, exact, since
an e8m0 scale is a power of two. It runs `fp8_linear` with per-token, per-128-feature dynamic
activation quantization: the Triton w8a8 GEMM on CUDA, the dequantizing reference elsewhere.
`wo_a` projects each output group with its own rows (`forward_grouped`).

A checkpoint weight for a kept projection that is not e4m3 with its scale is refused by name.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from atomrt.workers.layers.quantization.fp8 import FP8_DTYPE, Fp8Config
from atomrt.workers.layers.quantization.fp8_ops import fp8_linear_op
from atomrt.workers.layers.quantization.mxfp4 import FP8_BLOCK

# the projections a V4 checkpoint ships in FP8, by our module names
_V4_FP8 = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)$|\.shared_experts\.w[123]$")


class BlockFp8Linear(nn.Module):
    """y = x @ W^T with W e4m3 [N, K] and a float32 scale per output row and 128 input features,
    x quantized per token and 128 features (fp8.py's `fp8_linear`)."""

    def __init__(self, n: int, k: int, device: torch.device) -> None:
        super().__init__()
        self.in_features, self.out_features = k, n
        self.weight = nn.Parameter(
            torch.empty(n, k, dtype=FP8_DTYPE, device=device), requires_grad=False
        )
        groups = math.ceil(k / FP8_BLOCK)
        self.weight_scale = nn.Parameter(
            torch.empty(n, groups, dtype=torch.float32, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear_op(x, self.weight, self.weight_scale, None, FP8_BLOCK)

    def forward_grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, G, K] -> [n, G, N / G]: group g through rows [g N / G, (g + 1) N / G) (the
        grouped output projection, block-diagonal)."""
        groups = x.shape[1]
        rows = self.out_features // groups
        outs = [
            fp8_linear_op(
                x[:, g],
                self.weight[g * rows : (g + 1) * rows],
                self.weight_scale[g * rows : (g + 1) * rows],
                None,
                FP8_BLOCK,
            )
            for g in range(groups)
        ]
        return torch.stack(outs, dim=1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 128x128"


def keep_fp8_linears(model: nn.Module, fp8: Fp8Config, where: str) -> set[str]:
    """Replace the projections a V4 FP8 checkpoint ships in FP8 (see the module docstring) by
    `BlockFp8Linear`s; returns their names. Refuses a configuration the layers cannot hold."""
    if fp8.weight_block_size is None:
        raise ValueError(
            f"{where}: quantization_config without weight_block_size: DeepSeek-V4's FP8 "
            f"projections ship a scale per {FP8_BLOCK}x{FP8_BLOCK} block "
            f"(weight_block_size: [{FP8_BLOCK}, {FP8_BLOCK}])"
        )
    tp = getattr(model, "tp", None)
    tp_size = tp.tp_size if tp is not None else 1
    kept: set[str] = set()
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not _V4_FP8.search(name) or fp8.is_ignored(name):
            continue
        n, k = module.weight.shape
        dim = getattr(module.weight, "tp_shard_dim", None)
        if dim == 1 and tp_size > 1 and k % FP8_BLOCK:
            raise ValueError(
                f"{where}: {name}'s input features per tensor-parallel shard ({k}) must be a "
                f"multiple of the FP8 block {FP8_BLOCK} "
                f"(tensor_parallel_size={tp_size})"
            )
        layer = BlockFp8Linear(n, k, module.weight.device)
        if dim is not None:  # the loader narrows the checkpoint's tensors along it
            layer.weight.tp_shard_dim = layer.weight_scale.tp_shard_dim = dim
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer)
        kept.add(name)
    return kept

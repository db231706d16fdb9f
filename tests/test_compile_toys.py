"""Toy models and the child-process entry point shared by the compile tests (no tests here).

Two custom ops stand in for attention: `atomrt.test_attn` (writes its output buffer, like the
real attention op) and `atomrt.test_mix` (returns a new tensor). `ToyModel` calls `test_attn`
in every layer, or alternates the two with `two_ops=True`.

Run as a script (`python tests/test_compile_toys.py CACHE_DIR LEVEL [TWO_OPS [LAYERS]]`) it compiles the
toy model at LEVEL with the test config, runs the test token counts, and prints one line
`RESULT {json}` with the compilation counter and the largest difference from eager.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import torch
import torch.nn as nn

from atomrt.compile import compilation_counter, direct_register_custom_op, support_torch_compile
from atomrt.runtime.config import CompilationConfig, Config

HIDDEN = 16
VOCAB = 32
SPLITTING_OPS = ["atomrt.test_attn", "atomrt.test_mix"]
COMPILE_SIZES = [4]
TOKEN_COUNTS = [8, 4, 3, 4, 1, 6]  # the first must be >= 2 (it compiles); 4 is in compile_sizes


def _test_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor) -> None:
    # A causal running mean of gated values: each row sees the rows before it.
    # [num_tokens, hidden]
    gated = v * torch.sigmoid(q * k)
    counts = torch.arange(1, q.shape[0] + 1, device=q.device, dtype=q.dtype)[:, None]
    output.copy_(torch.cumsum(gated, dim=0) / counts)


def _test_attn_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor
) -> None:
    return None


def _test_mix(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tanh(x)


def _test_mix_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


direct_register_custom_op(
    "test_attn", _test_attn, mutates_args=["output"], fake_impl=_test_attn_fake
)
direct_register_custom_op("test_mix", _test_mix, mutates_args=[], fake_impl=_test_mix_fake)


class ToyModelEager(nn.Module):
    """Embedding, then per layer: a qkv linear, a splitting op, a residual; then an MLP."""

    def __init__(self, num_layers: int = 2, two_ops: bool = False):
        super().__init__()
        self.two_ops = two_ops
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.ModuleList(nn.Linear(HIDDEN, 3 * HIDDEN) for _ in range(num_layers))
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.scale_output = False  # a Python attribute Dynamo guards on (see the guard test)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = (
            self.embed(input_ids) + positions[:, None].to(torch.float32) * 0.01
        )  # [num_tokens, hidden]
        for i, layer in enumerate(self.qkv):
            q, k, v = layer(h).chunk(3, dim=-1)
            if self.two_ops and i % 2 == 1:
                h = h + torch.ops.atomrt.test_mix(q + k + v)
            else:
                o = torch.empty_like(q)
                torch.ops.atomrt.test_attn(q, k, v, o)
                h = h + o
        h = torch.relu(self.out(h))
        return h * 2.0 if self.scale_output else h


ToyModel = support_torch_compile(ToyModelEager)


def make_config(level: int, cache_dir: str = "", **overrides: Any) -> Config:
    cc = dict(
        level=level,
        cache_dir=cache_dir,
        cudagraph_capture_sizes=[1, 2, 4, 8],
        compile_sizes=list(COMPILE_SIZES),
        splitting_ops=list(SPLITTING_OPS),
    )
    cc.update(overrides)
    return Config(model="toy-compile-test", compilation_config=CompilationConfig(**cc))


def make_models(
    config: Config, two_ops: bool = False, num_layers: int = 2
) -> tuple[nn.Module, nn.Module]:
    """(the decorated model built with `config`, an eager twin with the same weights)."""
    model = ToyModel(num_layers=num_layers, two_ops=two_ops, config=config)
    eager = ToyModelEager(num_layers=num_layers, two_ops=two_ops)
    eager.load_state_dict(model.state_dict())
    return model.eval(), eager.eval()


def inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(num_tokens)
    return torch.randint(0, VOCAB, (num_tokens,), generator=gen), torch.arange(num_tokens)


def max_diff(model: nn.Module, eager: nn.Module, token_counts: list[int] = TOKEN_COUNTS) -> float:
    worst = 0.0
    with torch.no_grad():
        for n in token_counts:
            ids, pos = inputs(n)
            worst = max(worst, (model(ids, pos) - eager(ids, pos)).abs().max().item())
    return worst


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cache_dir, level = argv[0], int(argv[1])
    two_ops = len(argv) > 2 and argv[2] == "1"
    num_layers = int(argv[3]) if len(argv) > 3 else 2
    torch.manual_seed(0)
    model, eager = make_models(
        make_config(level, cache_dir), two_ops=two_ops, num_layers=num_layers
    )
    diff = max_diff(model, eager)
    print(
        "RESULT " + json.dumps({"counter": compilation_counter.snapshot(), "max_diff": diff}),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1:])

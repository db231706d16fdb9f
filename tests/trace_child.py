"""One process of the kept-trace differential test (tests/test_trace_cache_processes.py).

`main(argv)` builds the models a plan names, each twice: compiled (level 2 or 3, sharing the cache
directory with the other processes of the test) and at level 0 with the same code and state, calls
both, and prints one `RESULT {json}` line: per scenario, both outputs and whether the compiled one
was built from a kept trace. The toys read what a kept trace must not bake in: a module global
(`SCALE`), a class attribute (`ClassAttrToy.factor`), two parameters that may be one (`PairToy`).
Every scenario passes its name to the constructor: the constructor arguments are part of the kept
trace's key, so each scenario has an entry of its own, shared by the processes that run it.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atomrt.compile import compilation_counter, support_torch_compile
from atomrt.runtime.config import CompilationConfig, Config

SCALE = 1.0  # read by GlobalToy.forward; each scenario sets it before building


@support_torch_compile
class GlobalToy(nn.Module):
    def __init__(self, tag: str, width: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x)) * SCALE


@support_torch_compile
class ClassAttrToy(nn.Module):
    factor = 1.0  # each scenario sets it on the class before building

    def __init__(self, tag: str, width: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x)) * self.factor


@support_torch_compile
class PairToy(nn.Module):
    def __init__(self, tag: str, width: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(width, width, bias=False)
        self.b = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


TOYS = {"global": GlobalToy, "class": ClassAttrToy, "pair": PairToy}


def _config(level: int, cache_dir: str, use_inductor: bool, model: str = "toy") -> Config:
    cc = CompilationConfig(
        level=level,
        cache_dir=cache_dir,
        use_inductor=use_inductor,
        compile_sizes=[],
        cudagraph_capture_sizes=[1, 2, 4],
    )
    return Config(model=model, device="cpu", compilation_config=cc)


def _build_toy(spec: dict, config: Any) -> nn.Module:
    global SCALE
    SCALE = spec.get("scale", 1.0)
    ClassAttrToy.factor = spec.get("factor", 1.0)
    torch.manual_seed(spec.get("seed", 0))
    model = TOYS[spec["toy"]](spec["tag"], spec.get("width", 4), config=config)
    if spec.get("tie"):  # after construction: what no constructor argument shows
        model.b.weight = model.a.weight
    return model.eval()


def _run_toy(model: nn.Module, width: int) -> list:
    with torch.no_grad():
        return [model(torch.linspace(-1, 1, n * width).reshape(n, width)).tolist() for n in (3, 2)]


def _run_llama(model_dir: str, level: int, cache_dir: str, use_inductor: bool) -> list:
    from model_harness import run_prefill_and_decode

    from atomrt.workers.loading.loader import load_model

    config = _config(level, cache_dir, use_inductor, model=model_dir)
    torch._dynamo.reset()
    model = load_model(config, "cpu", torch.float32).model
    logits = run_prefill_and_decode(model, [[1, 5, 9, 2], [7, 3, 3, 8, 1], [4, 4]], 2).logits
    return [step.tolist() for step in logits]


def _entries(cache_dir: str) -> set[str]:
    return {str(p) for p in Path(cache_dir).glob("forward/**/*.pkl")}


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    cache_dir, level, use_inductor, plan = argv[0], int(argv[1]), argv[2] == "1", argv[3]
    results = {}
    for spec in json.loads(plan):
        before = compilation_counter.num_trace_loads
        entries = _entries(cache_dir)
        if spec["toy"] == "llama":
            compiled = _run_llama(spec["model"], level, cache_dir, use_inductor)
            loaded = compilation_counter.num_trace_loads - before
            eager = _run_llama(spec["model"], 0, cache_dir, use_inductor)
        else:
            width = spec.get("width", 4)
            # a model name per scenario: one compile cache per toy, as an engine has per model
            config = _config(level, cache_dir, use_inductor, model=f"toy-{spec['tag']}")
            compiled = _run_toy(_build_toy(spec, config), width)
            loaded = compilation_counter.num_trace_loads - before
            eager = _run_toy(_build_toy(spec, None), width)
        results[spec["name"]] = {
            "compiled": compiled,
            "eager": eager,
            "trace_loads": loaded,
            "entries_written": sorted(_entries(cache_dir) - entries),
        }
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

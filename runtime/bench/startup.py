"""Start-up benchmark: cold vs warm compile at level 3 (`atomrt bench startup`).

Two child processes build the same model with the same config, one after the other, sharing a
fresh compile cache directory: the first compiles every piece (cold), the second loads them
(warm). Each child gets its own fresh TORCHINDUCTOR_CACHE_DIR, so the warm number counts only
atomrt's cache. Compile time is `compilation_counter.compile_seconds` (Dynamo + Inductor or
loads); start-up time is the child's whole construction + first forwards. Prints one line (cold
and warm compile s, their ratio, target <= 25%; cold and warm start-up s; Inductor compiles per
child) and writes the same numbers as JSON.

    python -m atomrt.runtime.bench.startup [--model NAME] [--toy] [--out bench_startup.json]

With `--toy` the children compile a two-layer toy model instead of constructing `LLM`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

from atomrt.runtime.bench import goals, records
from atomrt.runtime.bench.records import add_record_flag, resolve_record_flag, save
from atomrt.runtime.bench.targets import (
    env_variant,
    goal_key,
    model_name,
    row_case,
    weights_variant,
)
from atomrt.runtime.config import DEFAULT_MODEL

CHILD_TIMEOUT_S = 1800.0


@dataclass
class ChildResult:
    seconds: float  # model construction + first forward(s): the compile or the cache load
    counter: dict
    # LLM children: process start to first token, phase by phase, (name, seconds) in order
    phases: list = field(default_factory=list)
    # modules this child compiled from source and could not cache (see uncached_modules)
    uncached_modules: int = 0


def uncached_modules() -> int:
    """How many imported source modules have no bytecode where Python looks for it (beside the
    source, or under PYTHONPYCACHEPREFIX): each was compiled from source on import, and will be
    again by the next process. Python writes bytecode as it imports; a read-only site-packages
    installed without it (or PYTHONDONTWRITEBYTECODE) leaves every start paying for the compile,
    seconds for torch alone, a cost a normal install does not have."""
    count = 0
    for module in list(sys.modules.values()):
        spec = getattr(module, "__spec__", None)
        cached = getattr(spec, "cached", None) if spec is not None else None
        origin = getattr(spec, "origin", None) or ""
        if cached and origin.endswith(".py") and not os.path.exists(cached):
            count += 1
    return count


@dataclass
class StartupBench:
    model: str
    cold_compile_s: float  # compilation_counter.compile_seconds of the cold child
    warm_compile_s: float
    ratio: float  # warm_compile_s / cold_compile_s (goal: startup-compile, benchmarks/goals.json)
    cold_startup_s: float  # the child's whole timed section (construction + first forwards)
    warm_startup_s: float
    cold_inductor_compiles: int
    warm_inductor_compiles: int
    warm_cache_loads: int
    warm_trace_loads: int  # models the warm child built from Dynamo's kept trace (no Dynamo)
    cold_phases: list = field(default_factory=list)  # see ChildResult.phases
    warm_phases: list = field(default_factory=list)
    warm_uncached_modules: int = 0  # see uncached_modules: > 0 inflates the import phases


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="atomrt bench startup", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument(
        "--toy", action="store_true", help="compile a toy model instead of constructing LLM"
    )
    p.add_argument("--load-format", default="auto", help="auto | dummy (random weights)")
    p.add_argument("--cudagraph-mode", default=None, help="CUDA-graph mode (default: level 3's)")
    p.add_argument("--out", default="bench_startup.json", help="where to write the JSON result")
    p.add_argument("--child", metavar="CACHE_DIR", help=argparse.SUPPRESS)
    p.add_argument("--spawned-at", type=float, default=None, help=argparse.SUPPRESS)
    add_record_flag(p)
    args = p.parse_args(argv)
    resolve_record_flag(args, p)
    return args


# ---- the child ------------------------------------------------------------------------------


def _toy_startup(cache_dir: str) -> None:
    import torch.nn as nn

    from atomrt.compile import direct_register_custom_op, support_torch_compile
    from atomrt.runtime.config import CompilationConfig, Config

    def mix(x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)

    direct_register_custom_op(
        "bench_toy_mix", mix, mutates_args=[], fake_impl=lambda x: torch.empty_like(x)
    )

    @support_torch_compile
    class ToyBenchModel(nn.Module):
        def __init__(self, hidden: int = 64, num_layers: int = 2):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.ops.atomrt.bench_toy_mix(torch.relu(layer(x)) + x)
            return x

    cc = CompilationConfig(
        level=3,
        cache_dir=cache_dir,
        splitting_ops=["atomrt.bench_toy_mix"],
        cudagraph_capture_sizes=[1, 2, 4],
        compile_sizes=[4],
    )
    model = ToyBenchModel(config=Config(model="bench-toy", compilation_config=cc))
    with torch.no_grad():
        for n in (8, 4):
            model(torch.randn(n, 64))


def _llm_startup(args: argparse.Namespace) -> list:
    """Build the LLM and stream one request's first token; the phases from the process's start
    (`--spawned-at`, wall clock) to that token."""
    from atomrt.runtime.config import CompilationConfig
    from atomrt.runtime.entrypoints.llm import LLM
    from atomrt.runtime.sampling_params import SamplingParams

    phases = [["import (interpreter, torch, atomrt)", time.time() - args.spawned_at]]
    start = time.time()
    mode = {"cudagraph_mode": args.cudagraph_mode} if args.cudagraph_mode else {}
    cc = CompilationConfig(level=3, cache_dir=args.child, **mode)
    llm = LLM(model=args.model, load_format=args.load_format, compilation_config=cc)
    built = time.time()
    worker = llm.engine.info.startup_phases
    phases += [[name, seconds] for name, seconds in worker]
    phases.append(["processes, groups, engine", built - start - sum(s for _, s in worker)])
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1), use_tqdm=False)
    first = time.time()
    phases.append(["first token (one request's prefill)", first - built])
    phases.append(["total: process start to first token", first - args.spawned_at])
    llm.shutdown()
    return phases


def _child(args: argparse.Namespace) -> None:
    from atomrt.compile import compilation_counter

    start = time.perf_counter()
    phases = []
    if args.toy:
        _toy_startup(args.child)
    else:
        phases = _llm_startup(args)
    result = ChildResult(
        time.perf_counter() - start, compilation_counter.snapshot(), phases, uncached_modules()
    )
    print("CHILD " + json.dumps(asdict(result)), flush=True)


# ---- the parent -----------------------------------------------------------------------------


def _run_child(args: argparse.Namespace, cache_dir: Path, inductor_dir: Path) -> ChildResult:
    cmd = [
        sys.executable,
        "-m",
        "atomrt.runtime.bench.startup",
        "--child",
        str(cache_dir),
        "--model",
        args.model,
        "--load-format",
        args.load_format,
        "--spawned-at",
        str(time.time()),
    ]
    if args.cudagraph_mode:
        cmd += ["--cudagraph-mode", args.cudagraph_mode]
    if args.toy:
        cmd.append("--toy")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor_dir))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"bench startup: a child took over {CHILD_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench startup: child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CHILD ")]
    if len(lines) != 1:
        raise RuntimeError(f"bench startup: child printed no result:\n{proc.stdout[-2000:]}")
    return ChildResult(**json.loads(lines[0][len("CHILD ") :]))


def bytecode_notes(warm_uncached: int, dont_write: Optional[bool] = None) -> list[str]:
    """What a record says of Python's bytecode cache: where it was kept, and how many modules the
    warm child still compiled from source, and why (`dont_write`: PYTHONDONTWRITEBYTECODE, which
    the children inherit; default this process's)."""
    if dont_write is None:
        dont_write = sys.dont_write_bytecode
    notes = []
    if sys.pycache_prefix:  # PYTHONPYCACHEPREFIX's, or atomrt's own (runtime/bytecode_cache.py)
        notes.append(f"bytecode cached under {sys.pycache_prefix}")
    if warm_uncached:
        why = (
            "PYTHONDONTWRITEBYTECODE is set, so Python writes no bytecode and atomrt keeps no "
            "cache; unset it"
            if dont_write
            else "no writable bytecode cache (a read-only site-packages without bytecode?); "
            "PYTHONPYCACHEPREFIX gives one"
        )
        notes.append(f"the warm child compiled {warm_uncached} modules from source: {why}")
    return notes


def startup_figures(
    bench: StartupBench, args: argparse.Namespace, on_gpu: bool
) -> list[records.Figure]:
    """startup-compile: warm compile over cold; startup-time: process start to first token, cold
    and warm (a toy run: the child's construction and first forwards)."""
    axes = model_name(bench.model)
    axes += f" {args.cudagraph_mode}" if args.cudagraph_mode else ""
    variant = ([] if args.toy else weights_variant(args.load_format)) + env_variant()
    extra = {
        "cold": records.Quantity(bench.cold_compile_s, "s"),
        "warm": records.Quantity(bench.warm_compile_s, "s"),
    }
    out = [
        records.figure(
            "startup-compile",
            row_case(f"{axes}, level 3", variant),
            bench.ratio,
            "×",
            threshold=goals.threshold("startup-compile"),
            extra=extra,
        )
    ]
    judged = on_gpu and not variant
    for name, phases, seconds in (
        ("cold", bench.cold_phases, bench.cold_startup_s),
        ("warm", bench.warm_phases, bench.warm_startup_s),
    ):
        total = phases[-1][1] if phases else seconds  # the LLM child's last phase is the total
        out.append(
            records.figure(
                "startup-time",
                row_case(f"{axes} {name}", variant),
                round(total, 2),
                "s",
                threshold=goals.threshold("startup-time", model=goal_key(bench.model), phase=name)
                if judged
                else None,
            )
        )
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    if args.child:
        _child(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="atomrt-bench-startup-") as tmp:
        root = Path(tmp)
        cold = _run_child(args, root / "compile_cache", root / "inductor_cold")
        warm = _run_child(args, root / "compile_cache", root / "inductor_warm")
    bench = StartupBench(
        model="toy" if args.toy else args.model,
        cold_compile_s=round(cold.counter["compile_seconds"], 2),
        warm_compile_s=round(warm.counter["compile_seconds"], 2),
        ratio=round(warm.counter["compile_seconds"] / cold.counter["compile_seconds"], 3),
        cold_startup_s=round(cold.seconds, 2),
        warm_startup_s=round(warm.seconds, 2),
        cold_inductor_compiles=cold.counter["num_inductor_compiles"],
        warm_inductor_compiles=warm.counter["num_inductor_compiles"],
        warm_cache_loads=warm.counter["num_cache_loads"],
        warm_trace_loads=warm.counter["num_trace_loads"],
        cold_phases=cold.phases,
        warm_phases=warm.phases,
        warm_uncached_modules=warm.uncached_modules,
    )
    notes = bytecode_notes(bench.warm_uncached_modules)
    for note in notes:
        print(f"note: {note}")
    goal = goals.threshold("startup-compile")
    print(
        f"startup {bench.model} level 3: compile cold {bench.cold_compile_s:.2f} s, warm {bench.warm_compile_s:.2f} s, "
        f"warm/cold {bench.ratio:.2f} (target <= {goal.value if goal else '-'}); start-up cold {bench.cold_startup_s:.2f} s, "
        f"warm {bench.warm_startup_s:.2f} s; Inductor compiles cold {bench.cold_inductor_compiles} / warm "
        f"{bench.warm_inductor_compiles}, warm loads {bench.warm_cache_loads}, warm models built "
        f"from the kept trace {bench.warm_trace_loads}"
    )
    for (name, c), (_, w) in zip(bench.cold_phases, bench.warm_phases):
        print(f"  {name:<58} cold {c:8.2f} s   warm {w:8.2f} s")
    Path(args.out).write_text(json.dumps(asdict(bench), indent=1) + "\n")
    if args.record is not None:
        on_gpu = not args.toy and torch.cuda.is_available()  # where the children built the model
        phases = {"cold_phases": bench.cold_phases, "warm_phases": bench.warm_phases}
        argv = sys.argv[1:] if argv is None else argv
        figures = startup_figures(bench, args, on_gpu)
        save(args.record, "startup", argv, figures, on_gpu=on_gpu, details=phases, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

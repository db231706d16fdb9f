"""How a bench figure's row is named: the helpers every `atomrt bench` subcommand builds its
figures' cases with. Each subcommand owns its figures (latency_figures.py, spec_figures.py,
serve_figures.py, and `*_figures` in dp.py, throughput.py, transport.py, startup.py); their goals
are data, in benchmarks/goals.json (runtime/bench/goals.py).

A figure's target names its table in docs/perf.md, its case names the row: the axes the run swept
(model, batch size, mode, ...) and, after a comma, whatever the run set apart from the standard
settings the tables assume (level 3, dummy weights, the default dtype, 128-token prompts, no
non-default ATOMRT_* variable), so that a variant run gets a row of its own instead of replacing the
standard one. A figure carries a goal only where its goal applies (on a GPU, standard settings).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from atomrt.runtime.bench.modes import split_mode
from atomrt.runtime.entrypoints.config_args import add_config_args
from atomrt.runtime.envs import ENV

# The ATOMRT_* variables a record's command line names, at their defaults (not a variant).
ENV_DEFAULTS = {
    "ATOMRT_PDL": "0",
    "ATOMRT_TRACE_CACHE": "1",
    "ATOMRT_COMPILE_CACHE_READ_ONLY": "0",
    "ATOMRT_FP8_NORM_PROLOGUE": "1",
    "ATOMRT_SERVE_UVLOOP": "0",
}


def model_name(model: str) -> str:
    """A model's name in a case: a preset as given, a folder or file by its last part."""
    return Path(model).name if "/" in model else model


def goal_key(model: str) -> str:
    """A model's name in the goals (benchmarks/goals.json): an -Instruct variant as its base."""
    return model_name(model).replace("-Instruct", "")


def env_variant() -> list[str]:
    return [f"{k}={v}" for k, v in ENV.recorded_by_benches if ENV_DEFAULTS.get(k) != v]


def number_text(value: Any) -> str:
    """A number as a case spells it (a float in its shortest form)."""
    return format(value, "g") if isinstance(value, float) else str(value)


def weights_variant(load_format: Optional[str]) -> list[str]:
    if load_format in (None, "dummy"):
        return []
    return ["real weights" if load_format == "auto" else f"{load_format} weights"]


def engine_variant(args: argparse.Namespace, *, ladder: bool = True) -> list[str]:
    """What a latency run set apart from the standard settings (module docstring); the level
    only where a mode compiles."""
    graphs = any(split_mode(m)[0] != "eager" for m in args.modes)
    out = [] if args.level == 3 or not graphs else [f"level {args.level}"]
    out += weights_variant(args.load_format)
    if args.dtype != "auto":
        out.append(args.dtype)
    if getattr(args, "quantization", None) is not None:  # FP8 rows beside the bf16 ones
        out.append(f"--quantization {args.quantization}")
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        out.append(f"--kv-cache-dtype {args.kv_cache_dtype}")
    if args.input_len != 128:
        out.append(f"{args.input_len}-token prompts")
    names = ["max_model_len", "max_num_batched_tokens", "transport_spin_us", "hf_overrides"]
    names += ["max_num_seqs", "cuda_graph_sizes"] if ladder else []
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, dict):
            out.append(f"--{name.replace('_', '-')} {json.dumps(value, separators=(',', ':'))}")
        elif value is not None:
            out.append(f"--{name.replace('_', '-')} {number_text(value)}")
    return out + env_variant()


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags (those of `atomrt generate`) a run set, --model aside, in one order and
    spelling: what tells one engine configuration's case from another's."""
    out = []
    for action in add_config_args(argparse.ArgumentParser(add_help=False)):
        value = getattr(args, action.dest, None)
        if action.dest == "model" or value is None or value is False or value == []:
            continue
        flag = action.option_strings[0]
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            out += [f"{flag} {v}" for v in value]
        elif isinstance(value, dict):
            out.append(f"{flag} {json.dumps(value, separators=(',', ':'))}")
        else:
            out.append(f"{flag} {number_text(value)}")
    return out


def row_case(axes: str, variant: list[str]) -> str:
    return ", ".join([axes, *variant])


def notes_of(notes: list[str], errors: list[str]) -> list[str]:
    """A run's notes for its record, and the first line of each error it survived."""
    return [*notes, *(f"error: {e.splitlines()[0]}" for e in errors)]

"""What `atomrt bench serve` records (runtime/bench/records.py): serving (output tokens/s against
the offline engine's) and serving-latency (a concurrency run's mean request latency), or with
structured outputs structured-outputs and structured-compile-stall; judged against
benchmarks/goals.json on a GPU (structured outputs on any machine)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

import numpy as np

from atomrt.runtime.bench import goals
from atomrt.runtime.bench.records import Figure, Quantity, figure
from atomrt.runtime.bench.targets import engine_flags, env_variant, goal_key, model_name, row_case
from atomrt.runtime.entrypoints.config_args import add_config_args


def load_name(r: Any) -> str:
    """A run's load, and its structured share, in words."""
    load = f"c={r.concurrency}" if r.concurrency is not None else f"{r.request_rate:g} req/s"
    return load if r.structured is None else f"{load} structured x{r.structured.ratio:g}"


def serve_figures(
    runs: list[Any],
    model: str,
    args: argparse.Namespace,
    engine_argv: list[str],
    on_gpu: bool,
    stall: Optional[dict] = None,
) -> list[Figure]:
    """serving: output tokens/s against the offline engine's; serving-latency: the mean request
    latency of a concurrency run; with structured outputs, structured-outputs and
    structured-compile-stall instead (`_structured_figures`)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_config_args(parser)
    flags = engine_flags(parser.parse_args(engine_argv))
    shape = (
        f"dataset {Path(args.dataset).name}"
        if args.dataset
        else f"{args.input_len} → {args.output_len} tokens"
    )
    variant = [" ".join(flags)] if flags else []
    if any(r.structured is not None for r in runs) or stall is not None:
        return _structured_figures(runs, model, args, shape, variant + env_variant(), stall)
    out = []
    for r in runs:
        load = (
            f"c={r.concurrency}" if r.concurrency is not None else f"{r.request_rate:g} requests/s"
        )
        case = row_case(f"{model_name(model)} {load}, {shape}", variant + env_variant())
        extra = {
            "TTFT p50": Quantity(r.ttft_ms["p50"], "ms"),
            "TPOT p50": Quantity(r.tpot_ms["p50"], "ms"),
        }
        if r.api_cpu_us_per_chunk is not None:  # what a streamed chunk costs the API process
            extra["API CPU/chunk"] = Quantity(r.api_cpu_us_per_chunk, "µs")
        out.append(
            figure(
                "serving",
                case,
                r.output_tokens_per_s,
                "tokens/s",
                anchor=r.offline_output_tokens_per_s,
                anchor_name="offline engine",
                threshold=goals.threshold("serving")
                if on_gpu and r.offline_output_tokens_per_s
                else None,
                extra=extra,
            )
        )
        if r.concurrency is None or not r.requests:
            continue
        goal = goals.threshold(
            "serving-latency",
            model=goal_key(model),
            concurrency=r.concurrency,
            input_len=args.input_len,
            output_len=args.output_len,
        )
        mean_ms = sum(latency for _, _, latency in r.requests) / len(r.requests)
        out.append(
            figure(
                "serving-latency",
                case,
                round(mean_ms, 1),
                "ms",
                threshold=goal if on_gpu and not args.dataset else None,
            )
        )
    return out


def _structured_figures(
    runs: list[Any],
    model: str,
    args: argparse.Namespace,
    shape: str,
    variant: list[str],
    stall: Optional[dict],
) -> list[Figure]:
    """structured-outputs: each ratio's output tokens/s (the mean of its runs at a load, when
    the ratios were repeated to interleave them) against the ratio-0 runs' of the same load, with
    the share of valid outputs, the grammar waits and the mask fill time beside it; the last one
    also carries --compile-stall's time between tokens while fresh schemas compile, over before
    (its goal: structured-compile-stall in benchmarks/goals.json)."""
    schema = Path(args.json_schema).name if args.json_schema else "-"
    groups: dict[tuple, list[Any]] = {}
    for r in runs:
        groups.setdefault((r.concurrency, r.request_rate, r.structured.ratio), []).append(r)

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 2)

    out = []
    for (c, rate, ratio), group in groups.items():
        if ratio == 0:  # the anchor
            continue
        base = groups.get((c, rate, 0.0))
        anchor = mean([r.output_tokens_per_s for r in base]) if base else None
        load = f"c={c}" if c is not None else f"{rate:g}/s"
        case = row_case(f"{model_name(model)} {load}, {shape}, {schema} x{ratio:g}", variant)
        views = [r.structured for r in group]
        extra = {"TPOT p50": Quantity(mean([r.tpot_ms["p50"] for r in group]), "ms")}
        if len(group) > 1:
            extra["runs, interleaved"] = Quantity(len(group), "each")
        num = sum(v.num_structured for v in views)
        if num:
            extra["valid"] = Quantity(round(100 * sum(v.num_valid for v in views) / num, 1), "%")
        for name, attr, unit in (
            ("grammar wait, first", "compile_first_ms", "ms"),
            ("cached", "compile_cached_ms", "ms"),
            ("mask fill", "mask_fill_us_per_row", "µs/row"),
        ):
            values = [getattr(v, attr) for v in views if getattr(v, attr) is not None]
            if values:
                extra[name] = Quantity(round(sum(values) / len(values), 3), unit)
        out.append(
            figure(
                "structured-outputs",
                case,
                mean([r.output_tokens_per_s for r in group]),
                "tokens/s",
                anchor=anchor,
                anchor_name="unconstrained" if anchor else None,
                threshold=goals.threshold("structured-outputs") if anchor and ratio == 1 else None,
                extra=extra,
            )
        )
    stall_goal = goals.threshold("structured-compile-stall")
    if out and stall is not None and stall.get("ratio") is not None and stall_goal is not None:
        out[-1].extra["8 fresh schemas compiling"] = Quantity(
            stall["ratio"], f"× the time between tokens before (goal ≤ {stall_goal.value:g}×)"
        )
    return out


def percentiles_ms(values: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 of durations in seconds, in milliseconds (NaN for none)."""
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * 1000.0
    return {f"p{q}": round(float(np.percentile(a, q)), 3) for q in (50, 90, 99)}

"""The targets: what each `atomrt bench` subcommand records (runtime/bench/records.py) and the goals
its figures are judged against.

A figure's target names its table in docs/perf.md, its case names the row: the axes the run swept
(model, batch size, mode, ...) and, after a comma, whatever the run set apart from the standard
settings the tables assume (level 3, dummy weights, the default dtype, 128-token prompts, no
non-default ATOMRT_* variable), so that a variant run gets a row of its own instead of replacing the
standard one. The thresholds are the project's goals on one H200 unless said; a figure carries one
only where its goal applies (on a GPU, standard settings).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from atomrt.runtime.bench.modes import split_mode
from atomrt.runtime.bench.records import Figure, Quantity, Threshold, figure
from atomrt.runtime.entrypoints.config_args import add_config_args
from atomrt.runtime.envs import ENV

if TYPE_CHECKING:
    from atomrt.runtime.bench.latency import Report as LatencyReport
    from atomrt.runtime.bench.spec_decode import SpecReport

# decode-step: ms per decode step, or a multiple of the true floor (model, batch size)
DECODE_MS = {("SmolLM2-135M", 1): 0.5, ("Llama-3.2-1B", 1): 0.7, ("Llama-3.2-1B", 32): 1.0}
DECODE_FLOOR_RATIO = {
    ("Llama-3.1-8B", 1): 1.10,
    ("DeepSeek-V2-Lite", 1): 1.5,  # the floor: the experts the batch touches (step_bytes.py)
    ("GLM-4.7-Flash", 1): 1.5,
}
# tr-hybrid-vs-full: a TR_HYBRID decode step over FULL's, same run (model, batch size)
TR_HYBRID_OVER_FULL = {
    ("SmolLM2-135M", 1): 1.25,
    ("Llama-3.2-1B", 32): 1.05,
    ("Llama-3.1-8B", 1): 1.05,
}
CAPTURE_S = {("SmolLM2-135M", 512): 10.0}  # graph-capture: the ladder 1..512 (model, ladder top)
RAY_OVER_INPROC = 1.05  # ray-vs-inproc: the Ray executor's decode step over in-process
SPEC_SPEEDUP = {"repetitive": 1.6, "random": 0.95}  # speculative-decoding: bs=1, async scheduling
STARTUP_COMPILE_RATIO = 0.25  # startup-compile: warm compile over cold, level 3
# startup-time: process start to first token, (cold, warm) seconds
STARTUP_S = {"SmolLM2-135M": (30.0, 10.0)}
TRANSPORT_US = 100.0  # transport: median driver -> worker -> driver round trip, one node
SERVE_OVER_OFFLINE = 0.95  # serving: the server's output tokens/s over the offline engine's
SERVE_REQUEST_MS = {("Llama-3.1-8B", 8, 32, 128): 500.0}  # serving-latency: (model, c, in, out)
# structured-outputs: output tokens/s with every request constrained over none, same load (CPU
# and GPU alike); beside it, running streams' time between tokens while fresh schemas compile
# over before (bench serve --compile-stall)
STRUCTURED_OVER_PLAIN = 0.95
COMPILE_STALL_RATIO = 1.10
DP_SPEEDUP = 1.8  # data-parallel: DP=2 over DP=1 on Qwen3-30B-A3B, 64 requests per rank
# prefill (benchmarks/bench_prefill.py): TFLOP/s over the bf16 GEMM ceiling (model, NxL shape)
PREFILL_OF_CEILING = {("Llama-3.1-8B", "8x2048"): 0.55}
# mla-decode (benchmarks/bench_mla_decode.py): GB/s over the device copy's, at bs >= the minimum
MLA_DECODE_OF_COPY, MLA_DECODE_MIN_BS = 0.70, 8
# fused-moe (benchmarks/sweep_moe.py): the best config's µs over the weight-read floor, at decode
# sizes (at most MOE_DECODE_TOKENS tokens)
MOE_OVER_FLOOR, MOE_DECODE_TOKENS = 1.3, 64
# The ATOMRT_* variables a record's command line names, at their defaults (not a variant).
ENV_DEFAULTS = {"ATOMRT_PDL": "0", "ATOMRT_TRACE_CACHE": "1", "ATOMRT_COMPILE_CACHE_READ_ONLY": "0"}


def model_name(model: str) -> str:
    """A model's name in a case: a preset as given, a folder or file by its last part."""
    return Path(model).name if "/" in model else model


def _goal_key(model: str) -> str:
    return model_name(model).replace("-Instruct", "")


def env_variant() -> list[str]:
    return [f"{k}={v}" for k, v in ENV.recorded_by_benches if ENV_DEFAULTS.get(k) != v]


def _g(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def _weights(load_format: Optional[str]) -> list[str]:
    if load_format in (None, "dummy"):
        return []
    return ["real weights" if load_format == "auto" else f"{load_format} weights"]


def engine_variant(args: argparse.Namespace, *, ladder: bool = True) -> list[str]:
    """What a latency run set apart from the standard settings (module docstring); the level
    only where a mode compiles."""
    graphs = any(split_mode(m)[0] != "eager" for m in args.modes)
    out = [] if args.level == 3 or not graphs else [f"level {args.level}"]
    out += _weights(args.load_format)
    if args.dtype != "auto":
        out.append(args.dtype)
    if args.input_len != 128:
        out.append(f"{args.input_len}-token prompts")
    names = ["max_model_len", "max_num_batched_tokens", "transport_spin_us", "hf_overrides"]
    names += ["max_num_seqs", "cuda_graph_sizes"] if ladder else []
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, dict):
            out.append(f"--{name.replace('_', '-')} {json.dumps(value, separators=(',', ':'))}")
        elif value is not None:
            out.append(f"--{name.replace('_', '-')} {_g(value)}")
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
            out.append(f"{flag} {_g(value)}")
    return out


def _case(axes: str, variant: list[str]) -> str:
    return ", ".join([axes, *variant])


# ------------------------------------------------------------------ atomrt bench latency


def decode_threshold(model: str, bs: int) -> Optional[Threshold]:
    key = (_goal_key(model), bs)
    if key in DECODE_MS:
        return Threshold("<=", DECODE_MS[key])
    if key in DECODE_FLOOR_RATIO:
        return Threshold("<=", DECODE_FLOOR_RATIO[key], "ratio")
    return None


def latency_figures(report: LatencyReport, args: argparse.Namespace, on_cuda: bool) -> list[Figure]:
    """decode-step per row; tr-hybrid-vs-full per (model, bs) with both modes' graph rows;
    graph-capture per (model, graph mode); ray-vs-inproc per executor comparison."""
    variant = engine_variant(args)
    standard = on_cuda and not variant
    out = []
    graph_rows = {}
    for r in report.rows:
        where = "" if r.executor == "inproc" else f"@{r.executor}"
        graph = r.forward_kind != "eager"
        judged = standard and graph and r.executor == "inproc"
        out.append(
            figure(
                "decode-step",
                _case(f"{model_name(r.model)} bs={r.batch_size} {r.mode}{where}", variant),
                r.ms_median,
                "ms",
                anchor=r.floor_ms,
                anchor_name="true floor",
                threshold=decode_threshold(r.model, r.batch_size) if judged else None,
                extra=_decode_extra(r),
            )
        )
        if on_cuda and graph:
            graph_rows[(r.model, r.mode, r.executor, r.batch_size)] = r
    for (model, mode, executor, bs), tr in graph_rows.items():
        base, async_ = split_mode(mode)
        full_mode = "FULL+async" if async_ else "FULL"
        full = graph_rows.get((model, full_mode, executor, bs))
        if base != "TR_HYBRID" or full is None or executor != "inproc":
            continue
        limit = TR_HYBRID_OVER_FULL.get((_goal_key(model), bs)) if not variant else None
        out.append(
            figure(
                "tr-hybrid-vs-full",
                _case(f"{model_name(model)} bs={bs} {mode}", variant),
                tr.ms_median,
                "ms",
                anchor=full.ms_median,
                anchor_name=full_mode,
                threshold=Threshold("<=", limit, "ratio") if limit else None,
            )
        )
    out += _capture_figures(graph_rows, args)
    for c in report.tp_overhead:
        out.append(
            figure(
                "ray-vs-inproc",
                _case(f"{model_name(c['model'])} bs={c['batch_size']} {c['mode']}", variant),
                c["ray_ms"],
                "ms",
                anchor=c["inproc_ms"],
                anchor_name="in-process",
                threshold=Threshold("<=", RAY_OVER_INPROC, "ratio") if standard else None,
            )
        )
    return out


def _decode_extra(r: Any) -> dict[str, Quantity]:
    """Beside a decode step: its p90 and, for a MoE model, the experts a step touched (per MoE
    layer) and the floor were every expert read."""
    extra = {"p90": Quantity(r.ms_p90, "ms")}
    if r.experts_touched is not None:
        extra["experts touched"] = Quantity(r.experts_touched, "per MoE layer")
    if r.floor_all_experts_ms is not None:
        extra["all-experts floor"] = Quantity(r.floor_all_experts_ms, "ms")
    return extra


def _capture_figures(graph_rows: dict, args: argparse.Namespace) -> list[Figure]:
    out, seen = [], set()
    top = args.cuda_graph_sizes or max(args.batch_sizes)
    variant = engine_variant(args, ladder=False)
    for (model, mode, executor, _), r in graph_rows.items():
        if (model, mode, executor) in seen or r.capture_s <= 0 or executor != "inproc":
            continue
        seen.add((model, mode, executor))
        limit = CAPTURE_S.get((_goal_key(model), top)) if not variant else None
        out.append(
            figure(
                "graph-capture",
                _case(f"{model_name(model)} {mode}, ladder 1..{top}", variant),
                r.capture_s,
                "s",
                threshold=Threshold("<=", limit) if limit else None,
            )
        )
    return out


def speculative_figures(
    report: SpecReport, args: argparse.Namespace, on_cuda: bool
) -> list[Figure]:
    """speculative-decoding: tokens/s with speculation against without, per row that speculated."""
    variant = engine_variant(args) + [f"{args.decode_steps} tokens"]
    plain = {
        (r.model, r.mode, r.batch_size, r.workload, r.num_requests): r
        for r in report.rows
        if r.speculative == "off"
    }
    out = []
    for r in report.rows:
        off = plain.get((r.model, r.mode, r.batch_size, r.workload, r.num_requests))
        if r.speculative == "off" or off is None:
            continue
        axes = f"{model_name(r.model)} {r.mode} bs={r.batch_size} {r.workload}, {r.speculative}"
        if r.num_requests:
            axes += f", {r.num_requests} requests"
        judged = on_cuda and r.batch_size == 1 and not r.num_requests and split_mode(r.mode)[1]
        limit = SPEC_SPEEDUP.get(r.workload) if judged else None
        extra = {}
        if r.mean_acceptance_length is not None:
            extra["acceptance length"] = Quantity(r.mean_acceptance_length, "tokens")
        out.append(
            figure(
                "speculative-decoding",
                _case(axes, variant),
                r.tokens_per_s,
                "tokens/s",
                anchor=off.tokens_per_s,
                anchor_name="without speculation",
                threshold=Threshold(">=", limit, "ratio") if limit else None,
                extra=extra,
            )
        )
    return out


def notes_of(notes: list[str], errors: list[str]) -> list[str]:
    """A run's notes for its record, and the first line of each error it survived."""
    return [*notes, *(f"error: {e.splitlines()[0]}" for e in errors)]


# ------------------------------------------------------------------ the other subcommands


def startup_figures(bench: Any, args: argparse.Namespace, on_gpu: bool) -> list[Figure]:
    """startup-compile: warm compile over cold; startup-time: process start to first token, cold
    and warm (a toy run: the child's construction and first forwards)."""
    axes = model_name(bench.model)
    axes += f" {args.cudagraph_mode}" if args.cudagraph_mode else ""
    variant = ([] if args.toy else _weights(args.load_format)) + env_variant()
    extra = {
        "cold": Quantity(bench.cold_compile_s, "s"),
        "warm": Quantity(bench.warm_compile_s, "s"),
    }
    out = [
        figure(
            "startup-compile",
            _case(f"{axes}, level 3", variant),
            bench.ratio,
            "×",
            threshold=Threshold("<=", STARTUP_COMPILE_RATIO),
            extra=extra,
        )
    ]
    goals = STARTUP_S.get(_goal_key(bench.model)) if on_gpu and not variant else None
    for i, (name, phases, seconds) in enumerate(
        (
            ("cold", bench.cold_phases, bench.cold_startup_s),
            ("warm", bench.warm_phases, bench.warm_startup_s),
        )
    ):
        total = phases[-1][1] if phases else seconds  # the LLM child's last phase is the total
        out.append(
            figure(
                "startup-time",
                _case(f"{axes} {name}", variant),
                round(total, 2),
                "s",
                threshold=Threshold("<=", goals[i]) if goals else None,
            )
        )
    return out


def transport_figures(r: Any, tcp: bool) -> list[Figure]:
    axes = f"bs={r.bs} {'tcp' if tcp else 'ipc'}, spin {r.spin_us:g} µs"
    return [
        figure(
            "transport",
            _case(axes, env_variant()),
            round(r.median_us, 1),
            "µs",
            anchor=round(r.bare_median_us, 1),
            anchor_name="bare pyzmq round trip",
            threshold=Threshold("<=", TRANSPORT_US),
            extra={"p99": Quantity(round(r.p99_us, 1), "µs")},
        )
    ]


def throughput_figures(report: Any, args: argparse.Namespace) -> list[Figure]:
    axes = (
        f"{model_name(report.model)}, {report.num_prompts} {report.prompt_source} prompts × "
        f"{report.output_len} tokens, {report.dtype}"
    )
    hf = report.transformers
    flags = engine_flags(args)
    return [
        figure(
            "offline-throughput",
            _case(axes, [" ".join(flags)] * bool(flags) + env_variant()),
            report.atomrt.output_tokens_per_s,
            "tokens/s",
            anchor=hf.output_tokens_per_s if hf else None,
            anchor_name="transformers generate",
        )
    ]


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
        case = _case(f"{model_name(model)} {load}, {shape}", variant + env_variant())
        extra = {
            "TTFT p50": Quantity(r.ttft_ms["p50"], "ms"),
            "TPOT p50": Quantity(r.tpot_ms["p50"], "ms"),
        }
        out.append(
            figure(
                "serving",
                case,
                r.output_tokens_per_s,
                "tokens/s",
                anchor=r.offline_output_tokens_per_s,
                anchor_name="offline engine",
                threshold=Threshold(">=", SERVE_OVER_OFFLINE, "ratio")
                if on_gpu and r.offline_output_tokens_per_s
                else None,
                extra=extra,
            )
        )
        if r.concurrency is None or not r.requests:
            continue
        key = (_goal_key(model), r.concurrency, args.input_len, args.output_len)
        limit = SERVE_REQUEST_MS.get(key) if on_gpu and not args.dataset else None
        mean_ms = sum(latency for _, _, latency in r.requests) / len(r.requests)
        out.append(
            figure(
                "serving-latency",
                case,
                round(mean_ms, 1),
                "ms",
                threshold=Threshold("<=", limit) if limit else None,
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
    (its goal: at most COMPILE_STALL_RATIO)."""
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
        case = _case(f"{model_name(model)} {load}, {shape}, {schema} x{ratio:g}", variant)
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
                threshold=Threshold(">=", STRUCTURED_OVER_PLAIN, "ratio")
                if anchor and ratio == 1
                else None,
                extra=extra,
            )
        )
    if out and stall is not None and stall.get("ratio") is not None:
        out[-1].extra["8 fresh schemas compiling"] = Quantity(
            stall["ratio"], f"× the time between tokens before (goal ≤ {COMPILE_STALL_RATIO:g}×)"
        )
    return out


def dp_figures(report: Any, args: argparse.Namespace, on_gpu: bool) -> list[Figure]:
    """data-parallel: each layout's output tokens/s against the first layout's, same requests."""
    variant = [] if args.imbalance == 0.5 else [f"imbalance {_g(args.imbalance)}"]
    if args.arrival_interval:
        variant.append(f"an arrival every {args.arrival_interval} steps")
    if args.dp_prefill_align is not None:
        variant.append(f"dp_prefill_align {args.dp_prefill_align}")
    flags = [f for f in engine_flags(args) if not f.startswith("--executor ")]  # an axis here
    variant += [" ".join(flags)] * bool(flags) + env_variant()
    out = []
    for r in report.results:
        first = next(x for x in report.results if x.num_requests == r.num_requests)
        axes = f"{model_name(report.model)} {r.layout}, {r.executor}, tbo={r.enable_tbo}"
        axes += f", {r.num_requests} requests"
        judged = (
            on_gpu
            and "Qwen3-30B-A3B" in report.model
            and (r.dp, r.tp, first.dp, first.tp) == (2, 1, 1, 1)
            and r.num_requests == 64 * r.dp
        )
        out.append(
            figure(
                "data-parallel",
                _case(axes, variant),
                r.output_tokens_per_s,
                "tokens/s",
                anchor=first.output_tokens_per_s if first is not r else None,
                anchor_name=first.layout if first is not r else None,
                threshold=Threshold(">=", DP_SPEEDUP, "ratio") if judged else None,
                extra={"padded": Quantity(round(100 * r.pad_fraction, 1), "%")},
            )
        )
    return out

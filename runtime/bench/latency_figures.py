"""What `atomrt bench latency` records (runtime/bench/records.py): decode-step per row,
tr-hybrid-vs-full, graph-capture and ray-vs-inproc, judged against their goals
(benchmarks/goals.json) on a GPU at the standard settings; and the decode-step goals' verdicts
the bench prints."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Optional

from atomrt.runtime.bench import goals
from atomrt.runtime.bench.modes import split_mode
from atomrt.runtime.bench.records import Figure, Quantity, Threshold, figure
from atomrt.runtime.bench.targets import engine_variant, goal_key, model_name, row_case

if TYPE_CHECKING:
    from atomrt.runtime.bench.latency import Report


def decode_threshold(model: str, bs: int) -> Optional[Threshold]:
    """The decode-step goal of (model, batch size): ms per step, or a multiple of the floor."""
    return goals.threshold("decode-step", model=goal_key(model), batch_size=bs)


def latency_figures(report: Report, args: argparse.Namespace, on_cuda: bool) -> list[Figure]:
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
                row_case(f"{model_name(r.model)} bs={r.batch_size} {r.mode}{where}", variant),
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
        goal = goals.threshold("tr-hybrid-vs-full", model=goal_key(model), batch_size=bs)
        out.append(
            figure(
                "tr-hybrid-vs-full",
                row_case(f"{model_name(model)} bs={bs} {mode}", variant),
                tr.ms_median,
                "ms",
                anchor=full.ms_median,
                anchor_name=full_mode,
                threshold=goal if not variant else None,
            )
        )
    out += _capture_figures(graph_rows, args)
    for c in report.tp_overhead:
        out.append(
            figure(
                "ray-vs-inproc",
                row_case(f"{model_name(c['model'])} bs={c['batch_size']} {c['mode']}", variant),
                c["ray_ms"],
                "ms",
                anchor=c["inproc_ms"],
                anchor_name="in-process",
                threshold=goals.threshold("ray-vs-inproc") if standard else None,
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
        goal = goals.threshold("graph-capture", model=goal_key(model), ladder_top=top)
        out.append(
            figure(
                "graph-capture",
                row_case(f"{model_name(model)} {mode}, ladder 1..{top}", variant),
                r.capture_s,
                "s",
                threshold=goal if not variant else None,
            )
        )
    return out


def check_targets(report: Report) -> list[str]:
    """The decode-step goals, one line per row they apply to (meaningful on one H200 only): rows
    whose decode steps replayed a graph; an eager step is not what the goals are about."""
    lines = []
    for r in report.rows:
        t = decode_threshold(r.model, r.batch_size)
        if r.forward_kind == "eager" or t is None:
            continue
        head = f"target {r.model} {r.mode} bs={r.batch_size}: "
        if t.of == "value":
            verdict = "PASS" if t.judge(r.ms_median, None) else "FAIL"
            lines.append(f"{head}{r.ms_median:.3f} ms <= {t.value} ms: {verdict}")
        elif r.ratio_to_floor is not None:
            verdict = "PASS" if t.judge(r.ms_median, r.ratio_to_floor) else "FAIL"
            lines.append(f"{head}{r.ratio_to_floor:.2f}x floor <= {t.value}x: {verdict}")
    return lines

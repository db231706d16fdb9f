"""What `atomrt bench speculative` prints and records: a row's line, its step costs against the
plain row's, the adaptive policy's phases, and the speculative-decoding figures (tokens/s with
speculation against without, judged against benchmarks/goals.json at bs=1 with async scheduling on
a GPU)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Optional

from atomrt.runtime.bench import goals
from atomrt.runtime.bench.modes import split_mode
from atomrt.runtime.bench.records import Figure, Quantity, figure
from atomrt.runtime.bench.targets import engine_variant, model_name, row_case

if TYPE_CHECKING:
    from atomrt.runtime.bench.spec_decode import SpecReport, SpecRow


HEADER = (
    f"{'model':<24} {'mode':<10} {'bs':>3} {'workload':<10} {'speculative':<16} {'tok/s':>9} "
    f"{'speedup':>7} {'accept_len':>10} {'steps':>6} {'same':>5}  per-position acceptance"
)


def line(r: SpecRow) -> str:
    speedup = f"{r.speedup:.2f}x" if r.speedup is not None else "-"
    accept = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else "-"
    per_pos = " ".join(f"{x:.2f}" for x in r.acceptance_per_position or [])
    same = "-" if r.same_tokens is None else f"{r.same_tokens}/{r.num_requests or r.batch_size}"
    return (
        f"{r.model[-24:]:<24} {r.mode:<10} {r.batch_size:>3} {r.workload:<10} "
        f"{r.speculative:<16} {r.tokens_per_s:>9.1f} {speedup:>7} {accept:>10} "
        f"{r.engine_steps:>6} {same:>5}  {per_pos}"
    )


def step_costs(row: SpecRow, off: SpecRow) -> dict[str, Optional[float]]:
    """A speculative row's step against the plain one of the same workload: ms of each, the
    speculative step split into its draft passes and the rest (the verify step), and those over
    the plain step."""
    plain, spec = off.ms_per_step, row.ms_per_step
    draft = row.draft_ms_per_step or 0.0
    verify = max(spec - draft, 0.0)
    ratio = (lambda x: round(x / plain, 3)) if plain > 0 else (lambda x: None)
    return {
        "plain_ms": plain,
        "speculative_ms": spec,
        "verify_ms": round(verify, 4),
        "draft_ms": round(draft, 4),
        "verify_over_plain": ratio(verify),
        "draft_over_plain": ratio(draft),
        "break_even_tokens": ratio(spec),
    }


def cost_line(row: SpecRow, off: SpecRow) -> str:
    c = step_costs(row, off)

    def x(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.2f}x"

    return (
        f"    step costs: plain {c['plain_ms']:.3f} ms; speculative {c['speculative_ms']:.3f} ms "
        f"= verify {c['verify_ms']:.3f} ms ({x(c['verify_over_plain'])} plain) + draft "
        f"{c['draft_ms']:.3f} ms ({x(c['draft_over_plain'])} plain); speculation gains above "
        f"{x(c['break_even_tokens'])[:-1]} tokens per step"
    )


def policy_line(policy: dict[str, dict[str, Any]]) -> str:
    parts = []
    for name, p in policy.items():
        rate = p["tokens_per_s_per_seq"]
        rate = "-" if rate is None else f"{rate:.1f} tok/s per sequence"
        parts.append(f"{name} {p['phases']} phases, {p['results']} steps, {rate}")
    return "    policy: " + "; ".join(parts)


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
        goal = goals.threshold("speculative-decoding", workload=r.workload) if judged else None
        extra = {}
        if r.mean_acceptance_length is not None:
            extra["acceptance length"] = Quantity(r.mean_acceptance_length, "tokens")
        out.append(
            figure(
                "speculative-decoding",
                row_case(axes, variant),
                r.tokens_per_s,
                "tokens/s",
                anchor=off.tokens_per_s,
                anchor_name="without speculation",
                threshold=goal,
                extra=extra,
            )
        )
    return out

"""Fused-MoE launch configs at the MoE model shapes: GPU time inside a CUDA graph (not a test; GPU machine).

    python benchmarks/sweep_moe.py [--quick] [--shapes "Qwen3-30B-A3B /2"] [--tokens 1,8,64]
        [--json FILE] [--budget-s 1800]

For each shape (experts, top-k, hidden, this rank's intermediate width; bf16) and token count, times
`fused_experts`' two GEMMs (gate_up: hidden -> silu(gate) * up; down: -> hidden, routing-weighted)
under the default config (`pick_config`) and a grid of candidates. Both GEMMs share the routing
layout, so they share block_m: per block_m the best (block_n, block_k, num_warps, num_stages) of each
GEMM is found, and the block_m whose pair is fastest wins. Every candidate is first checked against
the torch reference; one that fails to compile or mismatches is skipped and counted. Routings are
uniform random (top-k of a softmax of normal logits).

Prints one line per (shape, tokens): default and best GPU µs, the weight-read floor (the bytes of the
experts the routing touches over a device copy's bandwidth, measured first) and the best's ratio to
it; then a `CONFIGS` dict literal to paste into workers/kernels/moe/moe_configs.py (entries where the best
beats the default by more than the noise), and the whole result as JSON with --json.

Timing: CALLS back-to-back launches captured into one CUDA graph, replayed REPLAYS times between
CUDA events; per-call time = median replay / CALLS.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time

import torch
import triton
import triton.testing

from atomrt.runtime.bench import goals
from atomrt.runtime.bench.records import (
    Figure,
    Quantity,
    add_record_flag,
    figure,
    resolve_record_flag,
    save,
)
from atomrt.workers.kernels.moe.align import moe_align_block_size
from atomrt.workers.kernels.moe.fused_moe import launch_expert_gemm
from atomrt.workers.kernels.moe.moe_configs import MoEConfig, bucket_tokens, pick_config
from atomrt.workers.layers.moe import fused_experts_ref, select_experts

SHAPES = {  # name: (experts, top_k, hidden, intermediate per rank)
    "Qwen3-30B-A3B": (128, 8, 2048, 768),
    "Qwen3-30B-A3B /2": (128, 8, 2048, 384),
    "Qwen3-30B-A3B /4": (128, 8, 2048, 192),
    "OLMoE-1B-7B": (64, 8, 2048, 1024),
    "OLMoE-1B-7B /2": (64, 8, 2048, 512),
    "DeepSeek-V2-Lite": (64, 6, 2048, 1408),
    # its two shared experts folded into the routed ones (workers/models/deepseek.py)
    "DeepSeek-V2-Lite shared-fused": (66, 8, 2048, 1408),
}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
QUICK_TOKENS = (1, 8, 64, 512)
CALLS = 20
REPLAYS = 7
COPY_BANDWIDTH_GBS = 4260.0  # the floor's bandwidth (an H200's copy) until main measures this GPU's
NOISE = 0.03  # a swept config enters the table only when it beats the default by more than this


@dataclasses.dataclass
class Outcome:
    shape: str
    tokens: int
    default: dict
    default_us: float
    best: dict  # {"gate_up": config, "down": config}
    best_us: float
    floor_us: float
    num_timed: int
    num_skipped: int


def measure_copy_gbs() -> float:
    """This GPU's device-to-device copy bandwidth, bytes read + written per second, over a buffer
    well past L2 (an H100 copies about 3000 GB/s, an H200 about 4260)."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return round(2 * src.numel() * src.element_size() / ms / 1e6, 1)


def gpu_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def candidates(block_m: int, quick: bool) -> list[tuple[int, int, int, int]]:
    """(block_n, block_k, num_warps, num_stages) for one block_m."""
    out = []
    for block_n, block_k in itertools.product((32, 64, 128, 256), (64, 128, 256)):
        if block_m * block_n > 128 * 128 or (quick and block_k == 256):
            continue
        for warps, stages in itertools.product((4, 8), (2, 3, 4, 5)):
            if quick and stages in (2, 5):
                continue
            smem = stages * (block_m + 2 * block_n) * block_k * 2
            if smem <= 200 << 10:
                out.append((block_n, block_k, warps, stages))
    return out


def sweep_shape(name: str, m: int, quick: bool, deadline: float) -> Outcome:
    e, k, h, i = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(m)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) * i**-0.5).bfloat16()
    x = torch.randn(m, h, device="cuda", generator=g).bfloat16()
    weights, ids = select_experts(torch.randn(m, e, device="cuda", generator=g), k, True)
    weights_flat = weights.reshape(-1)
    reference = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    pairs = m * k
    act = x.new_empty(pairs, i)
    per_pair = x.new_empty(pairs, h)

    def time_gemm(gemm: str, cfg: MoEConfig, align) -> float:
        if gemm == "gate_up":
            return gpu_us(
                lambda: launch_expert_gemm(x, w13, act, weights_flat, align, pairs, k, True, cfg)
            )
        return gpu_us(
            lambda: launch_expert_gemm(act, w2, per_pair, weights_flat, align, pairs, 1, False, cfg)
        )

    def check(gu: MoEConfig, dn: MoEConfig, align) -> bool:
        launch_expert_gemm(x, w13, act, weights_flat, align, pairs, k, True, gu)
        launch_expert_gemm(act, w2, per_pair, weights_flat, align, pairs, 1, False, dn)
        out = per_pair.view(m, k, h).sum(1).float()
        return torch.allclose(out, reference, rtol=3e-2, atol=3e-2)

    default = {
        "gate_up": pick_config("gate_up", m, e, k, i, h),
        "down": pick_config("down", m, e, k, h, i),
    }
    default["down"] = dataclasses.replace(default["down"], block_m=default["gate_up"].block_m)
    align = moe_align_block_size(ids, default["gate_up"].block_m, e)
    default_us = time_gemm("gate_up", default["gate_up"], align) + time_gemm(
        "down", default["down"], align
    )
    best, best_us, timed, skipped = dict(default), default_us, 0, 0
    for block_m in (16, 32, 64, 128):
        if block_m > max(16, triton.next_power_of_2(pairs)) or time.monotonic() > deadline:
            continue
        align = moe_align_block_size(ids, block_m, e)
        pick = {}
        other = MoEConfig(block_m, 64, 64, 8, 4, 3)  # the GEMM not being swept, for the check
        for gemm in ("gate_up", "down"):
            scored = []
            for bn, bk, warps, stages in candidates(block_m, quick):
                cfg = MoEConfig(block_m, bn, bk, 8, warps, stages)
                gate_up, down = (cfg, other) if gemm == "gate_up" else (other, cfg)
                try:
                    if not check(gate_up, down, align):
                        skipped += 1
                        continue
                    scored.append((time_gemm(gemm, cfg, align), cfg))
                    timed += 1
                except Exception:  # a config this GPU cannot run (resources): skip it
                    skipped += 1
            if scored:
                pick[gemm] = min(scored, key=lambda s: s[0])
        if len(pick) == 2 and pick["gate_up"][0] + pick["down"][0] < best_us:
            best_us = pick["gate_up"][0] + pick["down"][0]
            best = {"gate_up": pick["gate_up"][1], "down": pick["down"][1]}
    touched = int(ids.unique().numel())
    floor_us = touched * 3 * h * i * 2 / (COPY_BANDWIDTH_GBS * 1e3)
    return Outcome(
        name,
        m,
        {g_: dataclasses.asdict(c) for g_, c in default.items()},
        round(default_us, 2),
        {g_: dataclasses.asdict(c) for g_, c in best.items()},
        round(best_us, 2),
        round(floor_us, 2),
        timed,
        skipped,
    )


def table_literal(outcomes: list[Outcome]) -> str:
    """CONFIGS entries for outcomes whose best beats the default by more than NOISE."""
    entries: dict[tuple, dict[int, dict]] = {}
    for o in outcomes:
        if o.best_us >= o.default_us * (1 - NOISE):
            continue
        e, k, h, i = SHAPES[o.shape]
        for gemm, (n, kdim) in (("gate_up", (i, h)), ("down", (h, i))):
            entries.setdefault((gemm, e, n, kdim), {})[bucket_tokens(o.tokens)] = o.best[gemm]
    lines = ["CONFIGS: dict[tuple[str, int, int, int], dict[int, MoEConfig]] = {"]
    for key, table in sorted(entries.items()):
        lines.append(f"    {key!r}: {{")
        for bucket, c in sorted(table.items()):
            args = ", ".join(str(c[f.name]) for f in dataclasses.fields(MoEConfig))
            lines.append(f"        {bucket}: MoEConfig({args}),")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    p.add_argument("--tokens", default=None, help="comma-separated token counts")
    p.add_argument("--quick", action="store_true", help="fewer token counts and candidates")
    p.add_argument("--budget-s", type=float, default=1800.0, help="stop sweeping past this")
    p.add_argument("--json", default=None)
    add_record_flag(p)
    args = p.parse_args()
    resolve_record_flag(args, p)
    if not torch.cuda.is_available():
        raise SystemExit("sweep_moe.py needs a CUDA GPU")
    tokens = (
        [int(t) for t in args.tokens.split(",")]
        if args.tokens
        else (QUICK_TOKENS if args.quick else TOKENS)
    )
    global COPY_BANDWIDTH_GBS
    COPY_BANDWIDTH_GBS = measure_copy_gbs()  # the floors of this run are at this GPU's copy
    print(f"device copy {COPY_BANDWIDTH_GBS} GB/s on {torch.cuda.get_device_name()}", flush=True)
    deadline = time.monotonic() + args.budget_s
    outcomes = []
    for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {name!r}; known: {', '.join(SHAPES)}")
        for m in tokens:
            o = sweep_shape(name, m, args.quick, deadline)
            outcomes.append(o)
            print(
                f"{o.shape:18s} M={o.tokens:5d}: default {o.default_us:8.1f} us, best "
                f"{o.best_us:8.1f} us ({o.num_timed} timed, {o.num_skipped} skipped), floor "
                f"{o.floor_us:7.1f} us, best/floor {o.best_us / max(o.floor_us, 1e-9):.2f}x",
                flush=True,
            )
    print(table_literal(outcomes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(o) for o in outcomes], f, indent=1)
    if args.record is not None:
        program = "python benchmarks/sweep_moe.py"
        save(
            args.record, "sweep_moe", sys.argv[1:], figures(outcomes), on_gpu=True, program=program
        )


def figures(outcomes: list[Outcome]) -> list[Figure]:
    """fused-moe: the best config's GPU time against the weight-read floor, per shape and tokens."""
    return [
        figure(
            "fused-moe",
            f"{o.shape} M={o.tokens}",
            round(o.best_us, 2),
            "µs",
            anchor=o.floor_us,
            anchor_name=f"weight-read floor at {COPY_BANDWIDTH_GBS} GB/s",
            threshold=goals.threshold("fused-moe", tokens=o.tokens),
            extra={"default config": Quantity(round(o.default_us, 2), "µs")},
        )
        for o in outcomes
    ]


if __name__ == "__main__":
    main()

"""Skinny GEMM against cuBLAS at the model shapes: GPU time inside a CUDA graph (not a test; GPU machine).

    python benchmarks/sweep_gemm.py [--quick] [--json FILE] [--hot]
        [--shapes "8B qkv,8B o"] [--ms 1] [--norm [--stats-values V]]

For M in 1, 8, 32 and every (N, K) of SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B and
DeepSeek-V2-Lite (bf16, per TP rank; --shapes DeepSeek-V2-Lite picks that model's), times
F.linear (cuBLAS), skinny_linear under its default config (pick_config) and a grid of candidate
configs: stage 1 sweeps the tiles (block_n x block_k x use_dot) at warps/stages that suit
each tile, stage 2 then tries the best tile at other num_warps, then the best of those at other
num_stages (--quick: stage 1 only, fewer K tiles, M 1 and 32 only). Every config is first checked
against F.linear; one that fails to compile or mismatches is skipped and counted. One line per
(shape, M), then a CONFIGS dict literal to paste into workers/kernels/gemm/skinny_configs.py, and
the whole result as JSON with --json. About 600 timings and 150 Triton compiles: ~1-2 min on an H200.

Timing: CALLS back-to-back calls captured into one CUDA graph, replayed REPLAYS times between CUDA
events; per-call time = median replay / CALLS. The calls rotate over copies of the weight that
together span ROTATE_BYTES (at most CALLS copies), so weights come from HBM as in a real decode step
rather than from the 50 MB L2 (--hot: one copy, L2-warm for the small weights).
A time budget (--budget-s) keeps the run bounded: past it, remaining shapes time only cuBLAS and the
default config, and say so.

--norm times what a decoder layer runs before and in a projection that follows a residual add and
RMSNorm (qkv, gate_up; broadcast path, M <= 4): on the cuBLAS side the add + norm kernel
(kernels/rms_norm.add_rms_norm) then F.linear, on the skinny side skinny_add_norm_linear, the add and
norm in the GEMM's prologue. --stats-values is the prologue's statistics pass width passed to each
call (`stats_values`; default skinny_gemm.NORM_STATS_VALUES; 0: one K tile per step of the pass).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from atomrt.runtime.bench.records import (
    Figure,
    Quantity,
    add_record_flag,
    figure,
    resolve_record_flag,
    save,
)
from atomrt.workers.kernels.gemm.skinny_configs import (
    BROADCAST_MAX_M,
    SkinnyConfig,
    block_m_for,
    pick_config,
)
from atomrt.workers.kernels.gemm.skinny_gemm import (
    NORM_STATS_VALUES,
    skinny_add_norm_linear,
    skinny_linear,
)
from atomrt.workers.kernels.rms_norm import add_rms_norm

SHAPES = {  # name: (N, K) per TP rank
    "SmolLM2-135M qkv": (960, 576),
    "SmolLM2-135M o": (576, 576),
    "SmolLM2-135M gate_up": (3072, 576),
    "SmolLM2-135M down": (576, 1536),
    "SmolLM2-135M lm_head": (49152, 576),
    "Llama-3.2-1B qkv": (3072, 2048),
    "Llama-3.2-1B o": (2048, 2048),
    "Llama-3.2-1B gate_up": (16384, 2048),
    "Llama-3.2-1B down": (2048, 8192),
    "Llama-3.2-1B lm_head": (128256, 2048),
    "Llama-3.1-8B qkv": (6144, 4096),
    "Llama-3.1-8B o": (4096, 4096),
    "Llama-3.1-8B gate_up": (28672, 4096),
    "Llama-3.1-8B down": (4096, 14336),
    "Llama-3.1-8B lm_head": (128256, 4096),
    # DeepSeek-V2-Lite's dense projections (o is Llama-3.2-1B's; routed experts: the fused MoE)
    "DeepSeek-V2-Lite q+kv_a": (3648, 2048),  # q_proj and kv_a_proj_with_mqa as one GEMM
    "DeepSeek-V2-Lite shared gate_up": (5632, 2048),
    "DeepSeek-V2-Lite shared down": (2048, 2816),
    "DeepSeek-V2-Lite dense gate_up": (21888, 2048),
    "DeepSeek-V2-Lite dense down": (2048, 10944),
    "DeepSeek-V2-Lite lm_head": (102400, 2048),
}
MS = (1, 8, 32)
QUICK_MS = (1, 32)
CALLS = 50
REPLAYS = 5
ROTATE_BYTES = 256 << 20
COPY_BANDWIDTH_GBS = 4260  # H200 device-to-device copy ceiling, for the "% of copy" column
MAX_SMEM_BYTES = 220 << 10  # a block's shared memory limit on H200 is 227 KB


@dataclasses.dataclass
class Result:
    """One timed (or skipped) config of one (shape, M)."""

    shape: str
    m: int
    n: int
    k: int
    config: dict | None  # None: cuBLAS
    label: str  # cublas | default | stage1 | stage2
    us: float | None  # None: skipped
    note: str = ""


@dataclasses.dataclass
class Summary:
    """The outcome for one (shape, M)."""

    shape: str
    m: int
    n: int
    k: int
    cublas_us: float
    default: dict
    default_us: float | None
    best: dict | None
    best_us: float | None
    best_gbs: float | None
    num_timed: int
    num_skipped: int
    searched: bool


def stage1_candidates(
    m: int, n: int, k: int, num_sms: int, quick: bool, norm: bool = False
) -> list[SkinnyConfig]:
    """Tiles that make sense for this shape, each at warps/stages that suit it: broadcast only for
    M <= 8 and block_n <= 64 (only broadcast with `norm`, whose prologue is on that path); enough
    programs to give every SM one (unless the narrowest tile cannot); no K tile wider than K; a
    per-step working set between 2K and 32K values."""
    out = []
    k_cap = max(64, triton.next_power_of_2(k))
    for use_dot in (False,) if norm else (False, True) if m <= 8 else (True,):
        block_m = block_m_for(m, use_dot)
        min_n = 16 if use_dot else 8
        block_ks = (128, 256, 512, 1024) if not use_dot else (64, 128, 256, 512)
        for block_n in (8, 16, 32, 64, 128) if use_dot else (8, 16, 32, 64):
            if block_n < min_n or triton.cdiv(n, block_n) < min(num_sms, triton.cdiv(n, min_n)):
                continue
            for block_k in block_ks[1:] if quick else block_ks:
                values = _step_values(block_n, block_k, use_dot, block_m)
                if block_k > k_cap or not 2048 <= values <= 32768:
                    continue
                num_warps = 2 if values <= 2048 else 4 if values <= 16384 else 8
                num_stages = 2 if triton.cdiv(k, block_k) <= 2 else 3
                config = SkinnyConfig(block_n, block_k, use_dot, num_warps, num_stages)
                if _fits(config, block_m):
                    out.append(config)
    return out


NORM_EPS = 1e-5


def stage2_candidates(best: SkinnyConfig, m: int, k: int, knob: str) -> list[SkinnyConfig]:
    """The best tile at other num_warps, or at other num_stages (1 = plain loads, no cp.async: broadcast
    path only, for the one- or two-step loops of the tiny weights)."""
    stages = (2, 3, 4) if best.use_dot else (1, 2, 3, 4)
    out = []
    for value in (2, 4, 8) if knob == "num_warps" else stages:
        config = dataclasses.replace(best, **{knob: value})
        if config.num_stages > 2 and triton.cdiv(k, config.block_k) < config.num_stages:
            continue  # more stages than K steps pipeline nothing
        if config != best and _fits(config, block_m_for(m, config.use_dot)):
            out.append(config)
    return out


def _step_values(block_n: int, block_k: int, use_dot: bool, block_m: int) -> int:
    """Values one K step holds: W and x tiles (dot), or the fp32 products (broadcast)."""
    return (block_n + block_m) * block_k if use_dot else block_n * block_m * block_k


def _fits(config: SkinnyConfig, block_m: int) -> bool:
    """At most 128 values per thread per step (more spills: checked by compiling for sm_90) and
    the pipeline's shared memory (num_stages W and x tiles of bf16) within the block limit."""
    values = _step_values(config.block_n, config.block_k, config.use_dot, block_m)
    rows = config.block_n + (block_m if config.use_dot else 0)
    smem = config.num_stages * rows * config.block_k * 2
    return values <= 128 * 32 * config.num_warps and smem <= MAX_SMEM_BYTES


def graph_us(call: Callable[[int], object]) -> float:
    """GPU time of one call(i), i = 0..CALLS-1, replayed from a CUDA graph."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            call(i)
    graph.replay()  # warm
    events = [torch.cuda.Event(enable_timing=True) for _ in range(REPLAYS + 1)]
    events[0].record()
    for e in events[1:]:
        graph.replay()
        e.record()
    events[-1].synchronize()
    times = [a.elapsed_time(b) for a, b in itertools.pairwise(events)]
    del graph
    return statistics.median(times) * 1e3 / CALLS


class Bench:
    """Operands and the reference of one (shape, M); times cuBLAS and skinny configs on them. With
    `norm`, each side also makes x from a residual add and RMSNorm (the module docstring's --norm)."""

    def __init__(
        self,
        name: str,
        m: int,
        n: int,
        k: int,
        hot: bool,
        norm: bool = False,
        stats_values: int = NORM_STATS_VALUES,
    ) -> None:
        self.name, self.m, self.n, self.k, self.norm, self.stats_values = (
            name,
            m,
            n,
            k,
            norm,
            stats_values,
        )
        gen = torch.Generator(device="cuda").manual_seed(m * 7919 + n + k)
        self.x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
        copies = 1 if hot else min(CALLS, math.ceil(ROTATE_BYTES / w.nbytes))
        self.weights = [w] + [w.clone() for _ in range(copies - 1)]
        if norm:  # x is the residual stream; the GEMM reads RMSNorm(x + update)
            self.update = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            self.norm_weight = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(
                torch.bfloat16
            )
            self.ref = F.linear(
                add_rms_norm(self.x, self.update, self.norm_weight, NORM_EPS)[1], w
            ).float()
        else:
            self.ref = F.linear(self.x, w).float()
        self.results: list[Result] = []

    def cublas(self) -> float:
        us = graph_us(lambda i: self._cublas_call(self.weights[i % len(self.weights)]))
        self.results.append(Result(self.name, self.m, self.n, self.k, None, "cublas", us))
        return us

    def _cublas_call(self, w: torch.Tensor) -> torch.Tensor:
        if self.norm:
            return F.linear(add_rms_norm(self.x, self.update, self.norm_weight, NORM_EPS)[1], w)
        return F.linear(self.x, w)

    def _skinny_call(self, w: torch.Tensor, config: SkinnyConfig) -> torch.Tensor:
        if self.norm:
            return skinny_add_norm_linear(
                self.x,
                self.update,
                self.norm_weight,
                NORM_EPS,
                w,
                config=config,
                stats_values=self.stats_values,
            )[1]
        return skinny_linear(self.x, w, config=config)

    def skinny(self, config: SkinnyConfig, label: str) -> float | None:
        """Checks `config` against F.linear, then times it; None (and a note) when it cannot run."""
        record = Result(self.name, self.m, self.n, self.k, dataclasses.asdict(config), label, None)
        self.results.append(record)
        try:
            y = self._skinny_call(self.weights[0], config)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit: reported, not fatal
            record.note = f"compile/launch: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            return None
        diff = (y.float() - self.ref).abs()
        if not bool(torch.all(diff <= 0.02 + 0.01 * self.ref.abs())):
            record.note = f"mismatch: max |diff| {diff.max().item():.3g}"
            return None
        record.us = graph_us(
            lambda i: self._skinny_call(self.weights[i % len(self.weights)], config)
        )
        return record.us

    def gbs(self, us: float) -> float:
        return (self.n * self.k + self.m * self.k + self.m * self.n) * 2 / us / 1e3


def short(config: SkinnyConfig) -> str:
    path = "dot" if config.use_dot else "bcast"
    return (
        f"bn={config.block_n} bk={config.block_k} {path} w{config.num_warps} s{config.num_stages}"
    )


def sweep_one(bench: Bench, num_sms: int, quick: bool, search: bool) -> Summary:
    """cuBLAS, default and (when `search`) the candidate grid for one (shape, M); returns the summary."""
    m, n, k = bench.m, bench.n, bench.k
    cublas_us = bench.cublas()
    default = pick_config(m, n, k, num_sms=num_sms)
    default_us = bench.skinny(default, "default")
    timed: dict[SkinnyConfig, float] = {default: default_us} if default_us is not None else {}
    if search:
        for config in stage1_candidates(m, n, k, num_sms, quick, bench.norm):
            if config not in timed and (us := bench.skinny(config, "stage1")) is not None:
                timed[config] = us
        for knob in () if quick or not timed else ("num_warps", "num_stages"):
            for config in stage2_candidates(min(timed, key=timed.get), m, k, knob):
                if config not in timed and (us := bench.skinny(config, "stage2")) is not None:
                    timed[config] = us
    best = min(timed, key=timed.get) if timed else None
    skipped = [r for r in bench.results if r.us is None]
    summary = Summary(
        bench.name,
        m,
        n,
        k,
        cublas_us,
        dataclasses.asdict(default),
        default_us,
        dataclasses.asdict(best) if best else None,
        timed.get(best),
        bench.gbs(timed[best]) if best else None,
        len(timed),
        len(skipped),
        search,
    )
    default_txt = f"{default_us:7.2f}" if default_us is not None else "   fail"
    if best is None:
        best_txt = "no config ran"
    else:
        gbs = bench.gbs(timed[best])
        best_txt = (
            f"best {timed[best]:7.2f} us {short(best):28s} {gbs:6.0f} GB/s "
            f"({100 * gbs / COPY_BANDWIDTH_GBS:3.0f}% copy) x{cublas_us / timed[best]:.2f} vs cuBLAS"
        )
    notes = f" [{len(skipped)} skipped]" if skipped else ""
    notes += "" if search else " [budget: search skipped]"
    print(
        f"{bench.name:21s} M={m:2d} ({n:6d},{k:5d}): cuBLAS {cublas_us:7.2f} us | default {default_txt} us | "
        f"{best_txt}{notes}",
        flush=True,
    )
    return summary


def print_skips(results: list[dict]) -> None:
    """Why configs were skipped: the five commonest reasons, with a count and one example config."""
    reasons: dict[str, list[dict]] = {}
    for r in results:
        if r["us"] is None:
            reasons.setdefault(r["note"][:100], []).append(r)
    for note, rows in sorted(reasons.items(), key=lambda item: -len(item[1]))[:5]:
        r = rows[0]
        print(
            f"skipped x{len(rows)}: {note} (e.g. {r['shape']} M={r['m']} {short(SkinnyConfig(**r['config']))})"
        )


def configs_literal(summaries: list[Summary]) -> str:
    lines = ["CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {"]
    for s in summaries:
        if s.best is not None:
            b = SkinnyConfig(**s.best)
            lines.append(
                f"    ({s.m}, {s.n}, {s.k}): SkinnyConfig({b.block_n}, {b.block_k}, {b.use_dot}, {b.num_warps}, "
                f"{b.num_stages}),  # {s.best_us:.2f} us, cuBLAS {s.cublas_us:.2f} us"
            )
    lines.append("}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="stage 1 only, fewer K tiles, M in 1 and 32"
    )
    ap.add_argument("--hot", action="store_true", help="one weight copy (L2-warm small weights)")
    ap.add_argument(
        "--budget-s", type=float, default=120.0, help="past this, only cuBLAS and default"
    )
    ap.add_argument("--json", default="", help="write every timing and the summaries here")
    ap.add_argument(
        "--shapes",
        default="",
        help="only shapes whose name contains one of these (comma-separated)",
    )
    ap.add_argument(
        "--ms", default="", help="only these M (comma-separated; default 1,8,32, --quick 1,32)"
    )
    ap.add_argument(
        "--norm",
        action="store_true",
        help="the residual add + RMSNorm before the GEMM on both sides (qkv, gate_up; M <= 4)",
    )
    ap.add_argument(
        "--stats-values",
        type=int,
        default=None,
        help="with --norm: the statistics pass's values per step (default NORM_STATS_VALUES; "
        "0: one K tile per step)",
    )
    add_record_flag(ap)
    args = ap.parse_args()
    resolve_record_flag(args, ap)
    if not torch.cuda.is_available():
        raise SystemExit("sweep_gemm.py needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    print(
        f"{props.name} ({num_sms} SMs), torch {torch.__version__}, triton {triton.__version__}; "
        f"{CALLS} calls per graph, median of {REPLAYS} replays, weights {'hot' if args.hot else 'rotated'}"
    )
    start = time.perf_counter()
    summaries, results = [], []
    ms = [int(m) for m in args.ms.split(",")] if args.ms else (QUICK_MS if args.quick else MS)
    stats_values = NORM_STATS_VALUES if args.stats_values is None else args.stats_values
    wanted = [w.strip() for w in args.shapes.split(",") if w.strip()]
    shapes = {
        name: nk for name, nk in SHAPES.items() if not wanted or any(w in name for w in wanted)
    }
    if args.norm:
        if any(m > BROADCAST_MAX_M for m in ms):
            raise SystemExit(
                f"--norm: the fused add + norm runs on the broadcast path, M <= {BROADCAST_MAX_M}"
            )
        shapes = {name: nk for name, nk in shapes.items() if name.endswith(("qkv", "gate_up"))}
        print(f"--norm: add + RMSNorm on both sides; stats_values {stats_values}")
    elif args.stats_values is not None:
        raise SystemExit("--stats-values needs --norm")
    for m in ms:
        for name, (n, k) in shapes.items():
            bench = Bench(name, m, n, k, args.hot, args.norm, stats_values)
            search = time.perf_counter() - start < args.budget_s
            summaries.append(sweep_one(bench, num_sms, args.quick, search))
            results += [dataclasses.asdict(r) for r in bench.results]
            del bench
            torch.cuda.empty_cache()
    elapsed = time.perf_counter() - start
    print_skips(results)
    print(
        f"{len(results)} timings in {elapsed:.0f} s; paste into skinny_configs.py "
        f"(SkinnyConfig(block_n, block_k, use_dot, num_warps, num_stages)):"
    )
    print(configs_literal(summaries))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": props.name,
                    "num_sms": num_sms,
                    "hot": args.hot,
                    "quick": args.quick,
                    "norm": args.norm,
                    "norm_stats_values": stats_values,
                    "elapsed_s": elapsed,
                    "summaries": [dataclasses.asdict(s) for s in summaries],
                    "results": results,
                },
                f,
                indent=1,
            )
    if args.record is not None:
        figs = figures(summaries, args.norm)
        program = "python benchmarks/sweep_gemm.py"
        save(args.record, "sweep_gemm", sys.argv[1:], figs, on_gpu=True, program=program)


def figures(summaries: list[Summary], norm: bool) -> list[Figure]:
    """skinny-gemm: the best swept config's GPU µs (the default's where none was swept) against
    cuBLAS, per (shape, M)."""
    out = []
    for s in summaries:
        best = s.best_us if s.best_us is not None else s.default_us
        if best is None:  # every config was skipped
            continue
        extra = {} if s.default_us is None else {"default config": Quantity(s.default_us, "µs")}
        out.append(
            figure(
                "skinny-gemm",
                f"{s.shape} M={s.m}" + (", with the norm" if norm else ""),
                round(best, 2),
                "µs",
                anchor=round(s.cublas_us, 2),
                anchor_name="cuBLAS",
                extra={k: Quantity(round(q.value, 2), q.unit) for k, q in extra.items()},
            )
        )
    return out


if __name__ == "__main__":
    main()

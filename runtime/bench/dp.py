"""Data-parallel benchmark (`atomrt bench dp`): output tokens/s and padding waste per parallel layout,
and the two-batch-overlap A/B.

    atomrt bench dp [--model tiny-qwen3-moe --load-format dummy] [--layouts 1x1,2x1,2x2]
        [--num-requests 32[,256...] --input-len 64 --output-len 32 --imbalance 0.5]
        [--arrival-interval 0] [--dp-prefill-align N] [--enable-tbo none,prefill,all,auto]
        [--json PATH] [--plot PATH] [engine flags as for `atomrt generate`]

Each layout (`DPxTP`) is an engine of its own running the same synthetic requests: random token ids,
greedy, EOS ignored, so every request makes exactly its output length. New requests go to the
least-loaded DP rank, so requests added together alternate over the ranks; `--imbalance f` makes
every other request (the odd ones: under DP=2, rank 1's) `f` shorter in prompt and output, so that
rank runs out of work first and idles (runs dummy batches) while the other finishes. With
`--arrival-interval K` one request arrives every K engine steps instead of all at once: prompts then
land on one rank while the others decode, the case `--dp-prefill-align` is for.

Per layout it reports output tokens/s, engine steps, the rows run beyond the real ones (padding to
the group's row count and graph buckets; an idle rank's dummy batch counts whole) and their share,
and the dummy batches; then each layout's tokens/s against the first's. Writes JSON, and a PNG plot
(matplotlib) with `--plot`.

Two-batch overlap: `--enable-tbo` takes a list of `parallel_config.enable_tbo` modes, each an engine
of its own on the same requests; every layout runs every mode, and each result carries its tokens/s
against the layout's first mode (`tbo_speedup`), the steps it split, its decode steps' median
milliseconds by batch size (`decode_ms_by_bs`, the engine step's wall time, keyed by the step's
`running_bs`), and under `auto` the start-up measurement of each bucket (`tbo_auto`). Several
`--num-requests` (all arriving at once) run the whole matrix at each batch size. Every layout, DP=1 included, runs through the `mp` executor unless
`--executor` says otherwise (`--executor ray` joins RAY_ADDRESS's cluster, or starts a local one: the
same command works under `ray job submit`). On CPU each rank computes with cores / ranks threads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from atomrt.runtime.bench import goals, records
from atomrt.runtime.bench.records import add_record_flag, resolve_record_flag, save
from atomrt.runtime.bench.targets import (
    engine_flags,
    env_variant,
    model_name,
    number_text,
    row_case,
)
from atomrt.runtime.config import TBO_MODES, Config, ConfigError
from atomrt.runtime.entrypoints.config_args import add_config_args, config_from_args

DEFAULT_MODEL = "tiny-qwen3-moe"
WARMUP_REQUESTS, WARMUP_TOKENS = 2, 4


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int

    @property
    def name(self) -> str:
        return f"DP={self.dp} TP={self.tp}"

    @classmethod
    def parse(cls, text: str) -> Layout:
        try:
            dp, tp = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"--layouts: {text!r} is not DPxTP (e.g. 2x1)") from None
        if dp < 1 or tp < 1:
            raise ValueError(f"--layouts: {text!r}: sizes must be at least 1")
        return cls(dp, tp)


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int


@dataclass
class LayoutResult:
    layout: str
    dp: int
    tp: int
    executor: str
    cpu_threads_per_rank: Optional[int]  # CPU: torch threads each rank computes with; GPU: None
    seconds: float
    output_tokens: int
    output_tokens_per_s: float
    steps: int
    real_tokens: int  # rows of scheduled work, every DP rank
    padded_tokens: int  # rows run beyond the real ones
    pad_fraction: float  # padded / (real + padded)
    dummy_batches: int  # (step, rank) pairs an idle rank ran a dummy batch
    prefill_holds: int  # (step, rank) pairs dp_prefill_align held a prompt back
    enable_tbo: str = "none"
    num_requests: int = 0
    split_steps: int = 0  # steps run as two microbatches
    decode_ms_by_bs: dict[int, float] = field(default_factory=dict)  # median ms per decode step
    tbo_auto: list[dict[str, Any]] = field(default_factory=list)  # auto: each bucket's measurement
    speedup: Optional[float] = None  # output tokens/s against the first layout's
    tbo_speedup: Optional[float] = None  # output tokens/s against the layout's first TBO mode
    num_nodes: int = 1  # distinct nodes the ranks ran on (Ray places them; mp: this node)


@dataclass
class Report:
    model: str
    device: str
    torch_version: str
    num_requests: list[int]
    input_len: int
    output_len: int
    imbalance: float
    arrival_interval: int
    dp_prefill_align: int
    enable_tbo: list[str]
    args: dict[str, Any]
    results: list[LayoutResult] = field(default_factory=list)


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="atomrt bench dp", description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument(
        "--layouts", default="1x1,2x1", help="comma-separated DPxTP layouts (default 1x1,2x1)"
    )
    p.add_argument(
        "--num-requests",
        default="32",
        help="requests per run; a comma-separated list runs every layout and mode at each",
    )
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens of a full request")
    p.add_argument("--output-len", type=int, default=32, help="output tokens of a full request")
    p.add_argument(
        "--imbalance",
        type=float,
        default=0.5,
        help="how much shorter (prompt and output) every other request is, in [0, 1)",
    )
    p.add_argument(
        "--arrival-interval",
        type=int,
        default=0,
        help="engine steps between arrivals (0: every request at once)",
    )
    p.add_argument(
        "--dp-prefill-align",
        type=int,
        default=None,
        help="scheduler_config.dp_prefill_align for every layout (steps; 0: off)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the synthetic token ids")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", default=None, help="where to write the JSON report")
    p.add_argument("--plot", default=None, help="where to write a PNG plot (needs matplotlib)")
    add_record_flag(p)
    args = p.parse_args(argv)
    resolve_record_flag(args, p)
    try:
        args.num_requests = [int(n) for n in args.num_requests.split(",") if n.strip()]
    except ValueError:
        p.error(f"--num-requests: {args.num_requests!r} is not a comma-separated list of integers")
    if not args.num_requests or min(args.num_requests) < 1:
        p.error("--num-requests must be at least 1")
    for name in ("input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    # A list of modes here, one engine each: not the one mode the engine flags take.
    args.tbo_modes = [m.strip() for m in (args.enable_tbo or "").split(",") if m.strip()]
    args.enable_tbo = None
    bad = [m for m in args.tbo_modes if m not in TBO_MODES]
    if bad:
        p.error(f"--enable-tbo: {bad} are not modes; choose from {', '.join(TBO_MODES)}")
    if not 0.0 <= args.imbalance < 1.0:
        p.error("--imbalance must be in [0, 1)")
    if args.arrival_interval < 0:
        p.error("--arrival-interval must be >= 0")
    if args.model is None:
        args.model = DEFAULT_MODEL
        args.load_format = args.load_format or "dummy"
    return args


def make_requests(
    args: argparse.Namespace, vocab_size: int, num_requests: int
) -> list[BenchRequest]:
    """Full requests at even indices, shorter ones (by `--imbalance`) at odd indices."""
    rng = random.Random(args.seed)
    requests = []
    for i in range(num_requests):
        scale = 1.0 - args.imbalance if i % 2 else 1.0
        n_in = max(1, round(args.input_len * scale))
        n_out = max(1, round(args.output_len * scale))
        requests.append(BenchRequest([rng.randrange(vocab_size) for _ in range(n_in)], n_out))
    return requests


def layout_config(
    base: Config,
    layout: Layout,
    executor: Optional[str],
    align: Optional[int],
    tbo: Optional[str] = None,
):
    pc = base.parallel_config
    executor = executor or "mp"  # DP=1 too: every layout pays the same process and step path
    pc = replace(
        pc,
        data_parallel_size=layout.dp,
        tensor_parallel_size=layout.tp,
        executor=executor,
        enable_tbo=tbo or pc.enable_tbo,
    )
    sc = base.scheduler_config
    if align is not None:
        sc = replace(sc, dp_prefill_align=align)
    return replace(base, parallel_config=pc, scheduler_config=sc)


def run_layout(
    config: Config, layout: Layout, requests: list[BenchRequest], interval: int, progress: bool
) -> LayoutResult:
    from atomrt.runtime.entrypoints.llm import LLM
    from atomrt.runtime.sampling_params import SamplingParams

    llm = LLM(config=config)
    try:
        engine = llm.engine
        warm = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
        llm.generate([r.prompt for r in requests[:WARMUP_REQUESTS]], warm, use_tqdm=False)
        before = replace(engine.stats, steps=dict(engine.stats.steps))
        holds_before = _holds(engine)
        pending = list(requests)
        name = f"{layout.name} tbo={config.parallel_config.enable_tbo}"
        bar = tqdm(total=len(requests), desc=name, unit="req", disable=not progress)
        steps = 0
        decode_s: dict[int, list[float]] = {}
        start = time.perf_counter()
        while pending or engine.has_unfinished():
            if pending and (interval == 0 or steps % interval == 0):
                batch, pending = (pending, []) if interval == 0 else (pending[:1], pending[1:])
                for r in batch:
                    params = SamplingParams(
                        temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True
                    )
                    engine.add_request(r.prompt, params)
            step_no, t0 = engine.step_no, time.perf_counter()
            for out in engine.step():
                if out.finished:
                    bar.update(1)
            _time_decode_step(engine, step_no, time.perf_counter() - t0, decode_s)
            steps += 1
        seconds = time.perf_counter() - start
        bar.close()
        stats = engine.stats
        holds = _holds(engine) - holds_before
        tbo_auto = [{**asdict(v), "splits": v.splits} for v in engine.forward_mode.ubatch.verdicts]
        nodes = getattr(engine.executor, "node_ids", None)
        num_nodes = len(set(nodes.values())) if nodes else 1
    finally:
        llm.shutdown()
    real = stats.real_tokens - before.real_tokens
    padded = stats.padded_tokens - before.padded_tokens
    output_tokens = sum(r.max_tokens for r in requests)
    return LayoutResult(
        layout=layout.name,
        dp=layout.dp,
        tp=layout.tp,
        executor=config.parallel_config.executor,
        cpu_threads_per_rank=_cpu_threads(config, layout),
        seconds=round(seconds, 3),
        output_tokens=output_tokens,
        output_tokens_per_s=round(output_tokens / seconds, 2),
        steps=steps,
        real_tokens=real,
        padded_tokens=padded,
        pad_fraction=round(padded / (real + padded), 4) if real + padded else 0.0,
        dummy_batches=stats.dummy_batches - before.dummy_batches,
        prefill_holds=holds,
        enable_tbo=config.parallel_config.enable_tbo,
        num_requests=len(requests),
        split_steps=stats.split_steps - before.split_steps,
        decode_ms_by_bs={
            bs: round(1e3 * statistics.median(s), 3) for bs, s in sorted(decode_s.items())
        },
        tbo_auto=tbo_auto,
        num_nodes=num_nodes,
    )


def _time_decode_step(
    engine: Any, step_no: int, seconds: float, decode_s: dict[int, list[float]]
) -> None:
    """Keep a synchronous decode step's wall time by its running_bs (a call that submitted
    exactly the step it collected)."""
    d = engine.forward_mode.last_decision
    if engine.async_scheduling or engine.step_no != step_no + 1 or d is None or d.is_prefill:
        return
    decode_s.setdefault(d.running_bs, []).append(seconds)


def _cpu_threads(config: Config, layout: Layout) -> Optional[int]:
    """What an mp or Ray rank on CPU sets (workers/process.py); None on GPU."""
    from atomrt.workers.runner.model_runner import resolve_device

    if resolve_device(config).type != "cpu":
        return None
    if config.parallel_config.executor == "inproc":
        return torch.get_num_threads()
    return max(1, (os.cpu_count() or 1) // (layout.dp * layout.tp))


def _holds(engine: Any) -> int:
    aligner = engine.admission.aligner
    return aligner.num_held_steps if aligner is not None else 0


def run_bench(args: argparse.Namespace) -> Report:
    from atomrt.workers.loading.loader import read_arch

    layouts = [Layout.parse(t) for t in args.layouts.split(",") if t.strip()]
    if not layouts:
        raise ValueError("--layouts: name at least one DPxTP layout")
    base = config_from_args(args)
    arch = read_arch(base)
    longest = args.input_len + args.output_len
    max_len = base.model_config.max_model_len or arch.max_position
    if longest > max_len:
        raise ValueError(f"--input-len + --output-len = {longest} exceeds max_model_len {max_len}")
    align = args.dp_prefill_align
    modes = args.tbo_modes or [base.parallel_config.enable_tbo]
    report = Report(
        model=base.model,
        device=base.device,
        torch_version=torch.__version__,
        num_requests=list(args.num_requests),
        input_len=args.input_len,
        output_len=args.output_len,
        imbalance=args.imbalance,
        arrival_interval=args.arrival_interval,
        dp_prefill_align=align if align is not None else base.scheduler_config.dp_prefill_align,
        enable_tbo=modes,
        args=dict(vars(args)),
    )
    # None: mp; an executor the flags or the YAML name is kept
    executor = args.executor or (
        base.parallel_config.executor if base.parallel_config.executor != "inproc" else None
    )
    for n in args.num_requests:
        requests = make_requests(args, arch.vocab_size, n)
        first: Optional[LayoutResult] = None
        for layout in layouts:
            layout_first: Optional[LayoutResult] = None
            for mode in modes:
                config = layout_config(base, layout, executor, align, mode)
                result = run_layout(
                    config, layout, requests, args.arrival_interval, not args.no_progress
                )
                first, layout_first = first or result, layout_first or result
                result.speedup = _ratio(result, first)
                result.tbo_speedup = _ratio(result, layout_first)
                report.results.append(result)
                print(_line(result), flush=True)
    return report


def _ratio(r: LayoutResult, base: LayoutResult) -> float:
    return round(r.output_tokens_per_s / base.output_tokens_per_s, 3)


def _nodes(r: LayoutResult) -> str:
    return f", {r.num_nodes} nodes" if r.num_nodes > 1 else ""


def _line(r: LayoutResult) -> str:
    line = (
        f"{r.layout} ({r.executor}{_threads(r)}{_nodes(r)}), {r.num_requests} requests, "
        f"tbo={r.enable_tbo}: {r.output_tokens} output tokens in {r.seconds:.2f} s: "
        f"{r.output_tokens_per_s:.1f} tokens/s ({r.speedup or 1.0:.2f}x, "
        f"{r.tbo_speedup or 1.0:.2f}x the layout's first mode), {r.steps} steps "
        f"({r.split_steps} split), {r.padded_tokens} padded rows over {r.real_tokens} real "
        f"({100 * r.pad_fraction:.1f}%), {r.dummy_batches} dummy batches"
    )
    if r.decode_ms_by_bs:
        ms = ", ".join(f"{bs}: {t:.2f}" for bs, t in r.decode_ms_by_bs.items())
        line += f"; decode ms/step by batch {{{ms}}}"
    for v in r.tbo_auto:
        line += (
            f"; auto bucket {v['running_bs']}: {v['unsplit_ms']:.3f} ms unsplit, "
            f"{v['split_ms']:.3f} ms split -> {'split' if v['splits'] else 'unsplit'}"
        )
    return line


def _threads(r: LayoutResult) -> str:
    return f", {r.cpu_threads_per_rank} threads/rank" if r.cpu_threads_per_rank else ""


def write_plot(report: Report, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r.layout}\n{r.num_requests} req, tbo={r.enable_tbo}" for r in report.results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 2 * len(names)), 4))
    ax1.bar(range(len(names)), [r.output_tokens_per_s for r in report.results], color="tab:blue")
    ax1.set_xticks(range(len(names)), names, fontsize=7)
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("throughput")
    ax2.bar(range(len(names)), [100 * r.pad_fraction for r in report.results], color="tab:orange")
    ax2.set_xticks(range(len(names)), names, fontsize=7)
    ax2.set_ylabel("padded rows, % of rows run")
    ax2.set_title("padding waste")
    fig.suptitle(
        f"{report.model}: imbalance {report.imbalance}, "
        f"arrival every {report.arrival_interval or 0} steps"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def dp_figures(report: Report, args: argparse.Namespace, on_gpu: bool) -> list[records.Figure]:
    """data-parallel: each layout's output tokens/s against the first layout's, same requests."""
    variant = [] if args.imbalance == 0.5 else [f"imbalance {number_text(args.imbalance)}"]
    if args.arrival_interval:
        variant.append(f"an arrival every {args.arrival_interval} steps")
    if args.dp_prefill_align is not None:
        variant.append(f"dp_prefill_align {args.dp_prefill_align}")
    flags = [f for f in engine_flags(args) if not f.startswith("--executor ")]  # an axis here
    variant += [" ".join(flags)] * bool(flags) + env_variant()
    goal = next(  # the goal's model is a part of the run's model name
        (g for g in goals.of_target("data-parallel") if dict(g.axes)["model"] in report.model),
        None,
    )
    out = []
    for r in report.results:
        first = next(x for x in report.results if x.num_requests == r.num_requests)
        axes = f"{model_name(report.model)} {r.layout}, {r.executor}, tbo={r.enable_tbo}"
        axes += f", {r.num_requests} requests"
        judged = (
            on_gpu
            and goal is not None
            and (r.dp, r.tp, first.dp, first.tp) == (2, 1, 1, 1)
            and r.num_requests == 64 * r.dp
        )
        out.append(
            records.figure(
                "data-parallel",
                row_case(axes, variant),
                r.output_tokens_per_s,
                "tokens/s",
                anchor=first.output_tokens_per_s if first is not r else None,
                anchor_name=first.layout if first is not r else None,
                threshold=goal.threshold if judged else None,
                extra={"padded": records.Quantity(round(100 * r.pad_fraction, 1), "%")},
            )
        )
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    try:
        report = run_bench(args)
        if args.plot:
            write_plot(report, args.plot)
    except (ConfigError, ValueError) as e:
        print(f"atomrt bench dp: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(asdict(report), indent=1) + "\n")
    if args.record is not None:
        on_gpu = report.device != "cpu" and torch.cuda.is_available()
        argv = sys.argv[1:] if argv is None else argv
        save(args.record, "dp", argv, dp_figures(report, args, on_gpu), on_gpu=on_gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

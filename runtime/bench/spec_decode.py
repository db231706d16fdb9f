"""Speculative-decoding benchmark (`atomrt bench latency --speculative-config JSON`): decode tokens/s
with speculation against without, and the acceptance it reached, on a repetitive and a random
workload.

Per (model, mode, batch size, workload) the same greedy requests run without speculation and with
the given `speculative_config` (on CPU, one workload after the other on both engines): `bs` prompts of `--input-len` tokens (repetitive: a short random
pattern repeated; random: uniform token ids), `--decode-steps` output tokens each. The prefill (up
to every request's first token) is not timed; decode tokens/s counts the tokens after it. A draft
pass that ran eagerly while CUDA graphs were on is an error (a drafter captured but not used).
With `--num-requests N` a row instead runs N requests with `bs` of them in flight, a finished one
replaced by the next as a served batch refills, their output lengths spread over 0.5-1.5x
`--decode-steps` (a fixed seed) so that they finish apart; every output token from the first
request's arrival to the last one's end is timed, prefills included (the same work for both
engines). A fixed batch's figure is set by its slowest request and its tail; a refilled batch's is
the steady state a server sees.
Greedy speculation must not change a token: every row records how many requests produced the same
tokens as without speculation; a difference is an error in float32 (in half precision a verify
pass's batch shape can round a near-tie the other way, so it is reported, not failed).

Step costs: every row has its wall time per engine step; a speculative row also the device time of
its draft passes per step (measured on TP rank 0). A line under it sets them against the plain
step of the same workload: what a verify step and its drafting cost whatever the acceptance (with
dummy weights the acceptance means nothing, the costs do): speculation gains when a step's tokens,
1 + the mean accepted drafts, exceed (verify + draft) / plain.
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
from typing import Any, Optional

import torch

from atomrt.runtime.bench.records import save
from atomrt.runtime.bench.spec_figures import (
    HEADER,
    cost_line,
    line,
    policy_line,
    speculative_figures,
)
from atomrt.runtime.bench.targets import notes_of

WORKLOADS = ("repetitive", "random")


@dataclass
class SpecRow:
    model: str
    mode: str
    batch_size: int
    workload: str
    speculative: str  # "off", or the method and k
    decode_tokens: int
    decode_s: float
    tokens_per_s: float
    engine_steps: int  # decode steps (after the prefill)
    mean_acceptance_length: Optional[float]  # tokens per verify step per request
    acceptance_per_position: Optional[list[float]]
    drafted_tokens: int
    accepted_tokens: int
    eager_draft_passes: int
    ms_per_step: float = 0.0  # wall time per engine step
    draft_ms_per_step: Optional[float] = None  # the draft passes' device time per step
    speedup: Optional[float] = None  # tokens/s over the same workload without speculation
    num_requests: Optional[int] = None  # a refilled run's requests (bs of them in flight)
    same_tokens: Optional[int] = None  # requests whose tokens equal those without speculation
    first_difference: Optional[str] = None  # "request i, token t: a != b"
    # with an adaptive policy: the phases that ended during the run, per kind ("speculating",
    # "plain"): phases, results, and the tokens/s per sequence the policy counted (its switch
    # left out)
    policy: Optional[dict[str, dict[str, Any]]] = None
    tokens: Optional[list[list[int]]] = field(default=None, repr=False)


@dataclass
class SpecReport:
    device: str
    torch_version: str
    speculative_config: dict[str, Any]
    args: dict[str, Any]
    rows: list[SpecRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def prompts_for(workload: str, bs: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """`bs` prompts of `input_len` tokens: a random pattern of 3-8 tokens repeated, or uniform ids."""
    rng = random.Random(seed)
    out = []
    for _ in range(bs):
        if workload == "repetitive":
            pattern = [rng.randrange(vocab) for _ in range(rng.randrange(3, 9))]
            out.append((pattern * (input_len // len(pattern) + 1))[:input_len])
        else:
            out.append([rng.randrange(vocab) for _ in range(input_len)])
    return out


def time_workload(
    llm: Any, workload: str, bs: int, args: argparse.Namespace, label: str
) -> SpecRow:
    """Run `bs` greedy requests to `args.decode_steps` tokens; time the steps after the prefill
    (with `args.num_requests`: `time_refilled`)."""
    from atomrt.runtime.sampling_params import SamplingParams

    if args.num_requests:
        return time_refilled(llm, workload, bs, args, label)

    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.decode_steps)
    prompts = prompts_for(workload, bs, args.input_len, engine.info.vocab_size, seed=bs)
    ids = [engine.add_request(p, params, stream=True) for p in prompts]
    mine, started, done = set(ids), set(), set()
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    num_tokens = 0
    while len(started) < bs:  # the prefill, up to every request's first token
        for o in engine.step():
            if o.request_id in mine:
                started.add(o.request_id)
                num_tokens += len(o.outputs[0].token_ids)
                tokens[o.request_id] += o.outputs[0].token_ids
                if o.finished:
                    done.add(o.request_id)
    start = _Counters(engine)
    first_tokens = num_tokens
    t0 = time.perf_counter()
    while len(done) < bs:
        if not engine.has_unfinished():
            raise RuntimeError(f"{label}: the engine stopped with requests unfinished")
        for o in engine.step():
            if o.request_id in mine:
                num_tokens += len(o.outputs[0].token_ids)
                tokens[o.request_id] += o.outputs[0].token_ids
                if o.finished:
                    done.add(o.request_id)
    seconds = time.perf_counter() - t0
    row = start.row(args, bs, workload, label, num_tokens - first_tokens, seconds)
    row.tokens = [tokens[i] for i in ids]
    return row


def refill_lengths(n: int, decode_steps: int, seed: int) -> list[int]:
    """Output lengths of a refilled run: uniform over 0.5-1.5x `decode_steps`."""
    rng = random.Random(seed)
    lo = max(1, decode_steps // 2)
    return [rng.randint(lo, max(lo, decode_steps * 3 // 2)) for _ in range(n)]


def time_refilled(
    llm: Any, workload: str, bs: int, args: argparse.Namespace, label: str
) -> SpecRow:
    """`args.num_requests` greedy requests, at most `bs` in flight (a finished one replaced by
    the next); every output token timed from the first arrival to the last request's end."""
    from atomrt.runtime.sampling_params import SamplingParams

    engine = llm.engine
    n = args.num_requests
    prompts = prompts_for(workload, n, args.input_len, engine.info.vocab_size, seed=bs)
    lengths = refill_lengths(n, args.decode_steps, seed=bs)
    start = _Counters(engine)
    tokens: list[list[int]] = [[] for _ in range(n)]
    which: dict[str, int] = {}
    added = done = 0
    t0 = time.perf_counter()
    while done < n:
        while added < n and added - done < bs:
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=lengths[added])
            which[engine.add_request(prompts[added], params, stream=True)] = added
            added += 1
        if not engine.has_unfinished():
            raise RuntimeError(f"{label}: the engine stopped with requests unfinished")
        for o in engine.step():
            i = which.get(o.request_id)
            if i is not None:
                tokens[i] += o.outputs[0].token_ids
                done += o.finished
    seconds = time.perf_counter() - t0
    row = start.row(args, bs, workload, label, sum(len(t) for t in tokens), seconds)
    row.num_requests, row.tokens = n, tokens
    return row


class _Counters:
    """The engine's speculation, policy and step counters when a timed run starts; `row` makes
    the run's SpecRow from what they moved by."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.spec = _snapshot(engine.stats.spec_decode)
        self.policy = engine.speculation.policy if engine.speculation is not None else None
        self.phases = _policy_totals(self.policy)
        self.steps = sum(engine.stats.steps.values())

    def row(
        self,
        args: argparse.Namespace,
        bs: int,
        workload: str,
        label: str,
        num_tokens: int,
        seconds: float,
    ) -> SpecRow:
        stats = self.engine.stats
        after = _snapshot(stats.spec_decode)
        drafts, drafted, accepted, eager, draft_s = (
            a - b for a, b in zip(after[:5], self.spec[:5])
        )
        per_pos = None
        if drafts:
            per_pos = [round((a - b) / drafts, 3) for a, b in zip(after[5], self.spec[5])]
        steps = sum(stats.steps.values()) - self.steps
        return SpecRow(
            model=args.current_model,
            mode=args.current_mode,
            batch_size=bs,
            workload=workload,
            speculative=label,
            decode_tokens=num_tokens,
            decode_s=round(seconds, 4),
            tokens_per_s=round(num_tokens / max(seconds, 1e-9), 1),
            engine_steps=steps,
            mean_acceptance_length=round(1 + accepted / drafts, 3) if drafts else None,
            acceptance_per_position=per_pos,
            drafted_tokens=drafted,
            accepted_tokens=accepted,
            eager_draft_passes=eager,
            ms_per_step=round(1000 * seconds / max(steps, 1), 4),
            draft_ms_per_step=round(1000 * draft_s / max(steps, 1), 4)
            if stats.spec_decode is not None
            else None,
            policy=_policy_delta(self.phases, _policy_totals(self.policy)),
        )


def _policy_totals(policy: Any) -> Optional[dict[str, tuple]]:
    """The adaptive policy's (phases, results, tokens, seconds) per kind, or None without one."""
    if policy is None:
        return None
    return {
        name: (t.phases, t.results, t.tokens, t.seconds)
        for name, t in (("speculating", policy.totals[True]), ("plain", policy.totals[False]))
    }


def _policy_delta(
    before: Optional[dict[str, tuple]], after: Optional[dict[str, tuple]]
) -> Optional[dict[str, dict[str, Any]]]:
    """What the policy's phases that ended between two snapshots counted, per kind."""
    if before is None or after is None:
        return None
    out = {}
    for name in after:
        phases, results, tokens, seconds = (a - b for a, b in zip(after[name], before[name]))
        rate = round(tokens / seconds, 1) if seconds > 0 else None
        out[name] = {"phases": phases, "results": results, "tokens_per_s_per_seq": rate}
    return out


def compare_tokens(row: SpecRow, base: list[list[int]]) -> None:
    """Fill `row.same_tokens` / `row.first_difference` against the tokens without speculation."""
    assert row.tokens is not None
    row.same_tokens = sum(a == b for a, b in zip(row.tokens, base))
    for r, (a, b) in enumerate(zip(row.tokens, base)):
        t = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if t is None and len(a) != len(b):
            t = min(len(a), len(b))
        if t is not None:
            got = a[t] if t < len(a) else "end"
            want = b[t] if t < len(b) else "end"
            row.first_difference = f"request {r}, token {t}: {got} != {want}"
            return


def _warm_up(llm: Any, bs: int, args: argparse.Namespace) -> None:
    """A short untimed run at the largest batch: first-call costs (weight packing, allocator
    growth) stay out of the figures."""
    from atomrt.runtime.sampling_params import SamplingParams

    if args.warmup_steps <= 0:
        return
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.warmup_steps)
    prompts = prompts_for("repetitive", bs, args.input_len, llm.engine.info.vocab_size, seed=-1)
    llm.generate(prompts, params, use_tqdm=False)


def _snapshot(spec: Any) -> tuple:
    """(drafts, drafted tokens, accepted tokens, eager draft passes, draft seconds, accepted per
    position)."""
    if spec is None:
        return (0, 0, 0, 0, 0.0, [])
    return (
        spec.num_drafts,
        spec.num_draft_tokens,
        spec.num_accepted_tokens,
        spec.num_eager_draft_passes,
        spec.draft_seconds,
        list(spec.accepted_per_position),
    )


def run(args: argparse.Namespace, spec_config: dict[str, Any]) -> int:
    """The benchmark's main: every model x mode x batch size x workload, without then with
    speculation. On CPU both engines stay up and each workload runs on one then the other, so a
    load that drifts (a shared machine) skews the two alike; a GPU holds one engine at a time."""
    from atomrt.runtime.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(spec_config)  # a ConfigError names a bad knob before any load
    label = f"{spec.method} k={spec.num_speculative_tokens}"
    on_cuda = args.device != "cpu" and torch.cuda.is_available()
    report = SpecReport(
        device=torch.cuda.get_device_name() if on_cuda else "cpu",
        torch_version=torch.__version__,
        speculative_config=spec_config,
        args={k: v for k, v in vars(args).items() if k != "speculative_config"},
    )
    if not on_cuda and any(m != "eager" for m in args.modes):
        report.notes.append("no CUDA device: graph modes run eagerly (enforce_eager=True)")
        print("note: " + report.notes[-1], flush=True)
    print(f"device {report.device}, torch {report.torch_version}, speculative_config {spec_config}")
    print(HEADER, flush=True)
    configs = [("off", None), (label, spec_config)]
    groups = [configs] if not on_cuda else [[c] for c in configs]
    for model in args.models:
        for mode in args.modes:
            args.current_model, args.current_mode = model, mode
            base: dict[tuple[int, str], SpecRow] = {}
            for group in groups:
                try:
                    _run_group(args, report, group, base, on_cuda)
                except Exception as e:  # recorded; the other models still run
                    report.errors.append(f"{model} {mode}: {e!r}\n{traceback.format_exc()}")
                    print(f"ERROR {model} {mode}: {e!r}", file=sys.stderr, flush=True)
                _write(report, args.json)
    for e in report.errors:
        print(f"ERROR {e.splitlines()[0]}", file=sys.stderr)
    _write(report, args.json)
    figures = speculative_figures(report, args, on_cuda)
    if args.record and figures:
        notes = notes_of(report.notes, report.errors)
        save(args.record, "latency", args.argv, figures, on_gpu=on_cuda, notes=notes)
    return 1 if report.errors else 0


def _run_group(
    args: argparse.Namespace,
    report: SpecReport,
    group: list[tuple[str, Optional[dict[str, Any]]]],
    base: dict[tuple[int, str], SpecRow],
    on_cuda: bool,
) -> None:
    """Start an engine per (label, speculative_config) of `group`, run every batch size and
    workload on each in turn, shut them down."""
    from atomrt.runtime.bench.modes import mode_settings
    from atomrt.runtime.entrypoints.llm import LLM

    model, mode = args.current_model, args.current_mode
    llms: dict[str, Any] = {}
    try:
        for name, speculative in group:
            settings = dict(
                load_format=args.load_format,
                device=args.device,
                max_num_seqs=args.max_num_seqs or max(args.batch_sizes),
                cuda_graph_sizes=[args.cuda_graph_sizes or max(args.batch_sizes)],
                speculative_config=speculative,
                **mode_settings(mode, args.level, on_cuda),
            )
            if args.max_model_len is not None:
                settings["max_model_len"] = args.max_model_len
            if args.dtype != "auto":
                settings["dtype"] = args.dtype
            llms[name] = LLM(model, **settings)
            _warm_up(llms[name], max(args.batch_sizes), args)
        for bs in args.batch_sizes:
            for workload in WORKLOADS:
                for name, llm in llms.items():
                    row = time_workload(llm, workload, bs, args, name)
                    off = base.get((bs, workload))
                    if name == "off":
                        base[(bs, workload)] = row
                    elif off is not None:
                        row.speedup = round(row.tokens_per_s / max(off.tokens_per_s, 1e-9), 3)
                        compare_tokens(row, off.tokens or [])
                    report.rows.append(row)
                    print(line(row), flush=True)
                    if name != "off" and off is not None:
                        print(cost_line(row, off), flush=True)
                    if row.policy is not None:
                        print(policy_line(row.policy), flush=True)
                    if row.first_difference and _float32(args, on_cuda):
                        report.errors.append(
                            f"{model} {mode} bs={bs} {workload}: greedy tokens changed with "
                            f"speculation ({row.first_difference})"
                        )
                    if not llm.engine.forward_mode.enforce_eager and row.eager_draft_passes:
                        report.errors.append(
                            f"{model} {mode} bs={bs} {workload}: {row.eager_draft_passes} draft "
                            "passes ran eagerly with CUDA graphs on (a drafter captured but not "
                            "replayed)"
                        )
    finally:
        for llm in llms.values():
            llm.shutdown()
        llms.clear()
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()


def _float32(args: argparse.Namespace, on_cuda: bool) -> bool:
    """The engines run in float32 (`auto` is bf16 on a GPU, float32 on CPU)."""
    return args.dtype == "float32" or (args.dtype == "auto" and not on_cuda)


def _write(report: SpecReport, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    doc = asdict(report)
    for row in doc["rows"]:
        row.pop("tokens", None)  # compared in the run; the figures are what the file keeps
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")

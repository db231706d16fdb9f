"""Offline throughput benchmark (`atomrt bench throughput`): output tokens/s of a batch of prompts.

    atomrt bench throughput [--num-prompts 12 --input-len 128 --output-len 48 | --prompts-file F | --chat]
        [--compare-hf] [--repeat N] [--json PATH] [engine flags as for `atomrt generate`]

Prompts are synthetic token ids (`--num-prompts` of `--input-len` tokens), the lines of
`--prompts-file`, or built-in chat prompts (`--chat`, which also wraps file prompts in the model's
chat template). Every prompt is tokenized once, here, so both engines get the same token ids.
Sampling is greedy with EOS ignored: every request makes exactly `--output-len` tokens. One warm-up
pass (the same batch, a few tokens) runs first. `--compare-hf` also runs transformers' `generate` on
the same weights, in this process: the whole batch at once, left-padded with an attention mask,
min_new_tokens = max_new_tokens = `--output-len`, greedy. With `--repeat N` the engines take turns
N times and the median run counts. Prints one line per engine (output tokens/s, requests/s,
seconds) and the ratio, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from atomrt.runtime.bench import records
from atomrt.runtime.bench.records import add_record_flag, resolve_record_flag, save
from atomrt.runtime.bench.targets import engine_flags, env_variant, model_name, row_case
from atomrt.runtime.config import Config, ConfigError
from atomrt.runtime.entrypoints.config_args import add_config_args, config_from_args

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about GPUs.",
    "Name three prime numbers.",
    "Explain what a hash table is in two sentences.",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "How do airplanes stay in the air?",
    "Write a short poem about the sea.",
    "What are the benefits of regular exercise?",
    "Translate 'good morning' into Spanish, French and German.",
    "Why is the sky blue?",
]
WARMUP_TOKENS = 4  # output tokens per prompt of the warm-up pass


@dataclass
class EngineResult:
    engine: str  # "atomrt" | "transformers"
    seconds: float  # the median run
    output_tokens_per_s: float
    requests_per_s: float
    best_s: float  # the fastest run
    runs_s: list[float] = field(default_factory=list)


@dataclass
class Report:
    model: str
    device: str
    dtype: str
    torch_version: str
    torch_threads: int
    num_prompts: int
    output_len: int
    total_input_tokens: int
    total_output_tokens: int
    prompt_source: str  # "synthetic" | "file" | "chat"
    args: dict[str, Any]
    atomrt: Optional[EngineResult] = None
    transformers: Optional[EngineResult] = None
    ratio: Optional[float] = None  # atomrt / transformers output tokens/s


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="atomrt bench throughput", description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="synthetic prompts (default 12); with --chat "
        "or --prompts-file: how many of those prompts, cycled",
    )
    p.add_argument("--input-len", type=int, default=128, help="tokens per synthetic prompt")
    p.add_argument("--output-len", type=int, default=48, help="tokens generated per prompt")
    p.add_argument("--prompts-file", default=None, help="one prompt per line")
    p.add_argument(
        "--chat", action="store_true", help="chat prompts (built-in ones unless --prompts-file)"
    )
    p.add_argument(
        "--compare-hf",
        action="store_true",
        help="also run transformers' generate on the same weights",
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="measured runs per engine; the median counts"
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up pass")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--seed", type=int, default=0, help="seeds the synthetic token ids")
    p.add_argument("--json", default=None, help="where to write the JSON report")
    add_record_flag(p)
    args = p.parse_args(argv)
    resolve_record_flag(args, p)
    for name in ("input_len", "output_len", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error("--num-prompts must be at least 1")
    return args


def build_prompts(
    args: argparse.Namespace, tokenizer: Any, vocab_size: int
) -> tuple[list[list[int]], str]:
    """The prompts as token ids, and where they came from."""
    if args.prompts_file is None and not args.chat:
        rng = random.Random(args.seed)
        n = args.num_prompts or 12
        return [
            [rng.randrange(vocab_size) for _ in range(args.input_len)] for _ in range(n)
        ], "synthetic"
    if args.prompts_file is not None:
        texts = [line.rstrip("\n") for line in Path(args.prompts_file).read_text().splitlines()]
        texts = [t for t in texts if t.strip()]
        if not texts:
            raise ValueError(f"--prompts-file {args.prompts_file}: no prompts in it")
    else:
        texts = list(CHAT_PROMPTS)
    if args.num_prompts is not None:
        texts = [texts[i % len(texts)] for i in range(args.num_prompts)]
    if tokenizer is None:
        raise ValueError(
            "text prompts need a tokenizer; this model has none (use synthetic prompts)"
        )
    if args.chat:
        ids = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True
            )
            for t in texts
        ]
    else:
        ids = [tokenizer.encode(t) for t in texts]
    return ids, "file" if args.prompts_file is not None else "chat"


def _check_lengths(engine: str, generated: list[int], output_len: int) -> None:
    bad = [i for i, n in enumerate(generated) if n != output_len]
    if bad:
        raise RuntimeError(
            f"{engine}: prompt {bad[0]} got {generated[bad[0]]} tokens, expected {output_len}"
        )


def atomrt_runner(llm: Any, prompts: list[list[int]], progress: bool) -> Callable[[int], float]:
    """A function of the output length that runs every prompt through `llm` and returns seconds."""
    from atomrt.runtime.sampling_params import SamplingParams

    def run(output_len: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=progress)
        seconds = time.perf_counter() - start
        _check_lengths("atomrt", [len(o.outputs[0].token_ids) for o in outputs], output_len)
        return seconds

    return run


def hf_source(config: Config) -> tuple[str, dict[str, Any]]:
    """Where transformers finds the weights atomrt loads for `config`: (path, from_pretrained kwargs)."""
    from atomrt.workers.loading.loader import resolve_model

    if config.model_config.load_format == "dummy":
        raise ValueError("--compare-hf needs real weights, not load_format=dummy")
    resolved = resolve_model(config.model)
    if resolved.kind == "gguf":
        return str(resolved.path.parent), {"gguf_file": resolved.path.name}
    if resolved.kind == "safetensors":
        return str(resolved.path), {}
    raise ValueError(
        f"--compare-hf: {config.model!r} is a preset (shapes only); give a folder or a .gguf file"
    )


def load_hf_model(config: Config, device: torch.device, dtype: torch.dtype) -> Any:
    """transformers' model on the weights atomrt loads for `config`."""
    from transformers import AutoModelForCausalLM

    source, kwargs = hf_source(config)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    return model.to(device).eval()


class _TokenBar:
    """A transformers streamer that moves a progress bar one step per generated token."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, desc="transformers", unit="tok/seq", disable=not enabled)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.bar.update(1)
        self.prompt_seen = True  # the first call carries the prompts

    def end(self) -> None:
        self.bar.close()


def hf_runner(
    model: Any, prompts: list[list[int]], device: torch.device, progress: bool
) -> Callable[[int], float]:
    """Like `atomrt_runner`, for transformers' `generate`: one left-padded batch of all prompts."""
    gen = model.generation_config
    pad_id = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    if isinstance(pad_id, (list, tuple)):
        pad_id = pad_id[0]
    pad_id = 0 if pad_id is None else int(pad_id)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention_mask[i, width - len(p) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

    def run(output_len: int) -> float:
        streamer = _TokenBar(output_len, progress and output_len > WARMUP_TOKENS)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                pad_token_id=pad_id,
                temperature=None,
                top_p=None,
                top_k=None,
                streamer=streamer,
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        _check_lengths("transformers", [out.shape[1] - width] * len(prompts), output_len)
        return seconds

    return run


def _result(engine: str, runs: list[float], num_prompts: int, output_len: int) -> EngineResult:
    seconds = statistics.median(runs)
    return EngineResult(
        engine,
        round(seconds, 4),
        round(num_prompts * output_len / seconds, 2),
        round(num_prompts / seconds, 3),
        round(min(runs), 4),
        [round(r, 4) for r in runs],
    )


def _line(r: EngineResult, report: Report) -> str:
    return (
        f"{r.engine}: {report.num_prompts} prompts x {report.output_len} tokens in {r.seconds:.2f} s: "
        f"{r.output_tokens_per_s:.1f} output tokens/s, {r.requests_per_s:.2f} requests/s"
    )


def run_bench(args: argparse.Namespace) -> Report:
    from atomrt.runtime.entrypoints.llm import LLM
    from atomrt.workers.runner.model_runner import resolve_device, resolve_dtype

    config = config_from_args(args)
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    progress = not args.no_progress
    if args.compare_hf:
        hf_source(config)  # a bad source fails before the engine starts
    llm = LLM(config=config)
    try:
        prompts, source = build_prompts(args, llm.tokenizer, llm.engine.info.vocab_size)
        longest = max(len(p) for p in prompts) + args.output_len
        if longest > llm.engine.max_model_len:
            raise ValueError(
                f"prompt + output of {longest} tokens exceeds max_model_len {llm.engine.max_model_len}"
            )
        report = Report(
            model=config.model,
            device=str(device),
            dtype=str(dtype).replace("torch.", ""),
            torch_version=torch.__version__,
            torch_threads=torch.get_num_threads(),
            num_prompts=len(prompts),
            output_len=args.output_len,
            total_input_tokens=sum(len(p) for p in prompts),
            total_output_tokens=len(prompts) * args.output_len,
            prompt_source=source,
            args={k: v for k, v in vars(args).items()},
        )
        runners = {"atomrt": atomrt_runner(llm, prompts, progress)}
        if args.compare_hf:
            runners["transformers"] = hf_runner(
                load_hf_model(config, device, dtype), prompts, device, progress
            )
        if not args.no_warmup:
            for run in runners.values():
                run(min(WARMUP_TOKENS, args.output_len))
        runs: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.repeat):  # the engines take turns, so that drift hits both alike
            for name, run in runners.items():
                runs[name].append(run(args.output_len))
    finally:
        llm.shutdown()
    report.atomrt = _result("atomrt", runs["atomrt"], report.num_prompts, args.output_len)
    if args.compare_hf:
        report.transformers = _result(
            "transformers", runs["transformers"], report.num_prompts, args.output_len
        )
        report.ratio = round(
            report.atomrt.output_tokens_per_s / report.transformers.output_tokens_per_s, 3
        )
    return report


def throughput_figures(report: Report, args: argparse.Namespace) -> list[records.Figure]:
    axes = (
        f"{model_name(report.model)}, {report.num_prompts} {report.prompt_source} prompts × "
        f"{report.output_len} tokens, {report.dtype}"
    )
    hf = report.transformers
    flags = engine_flags(args)
    return [
        records.figure(
            "offline-throughput",
            row_case(axes, [" ".join(flags)] * bool(flags) + env_variant()),
            report.atomrt.output_tokens_per_s,
            "tokens/s",
            anchor=hf.output_tokens_per_s if hf else None,
            anchor_name="transformers generate",
        )
    ]


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    try:
        report = run_bench(args)
    except (ConfigError, ValueError) as e:
        print(f"atomrt bench throughput: error: {e}", file=sys.stderr)
        return 2
    print(_line(report.atomrt, report), flush=True)
    if report.transformers is not None:
        print(_line(report.transformers, report), flush=True)
        print(
            f"atomrt / transformers: {report.ratio:.2f}x output tokens/s "
            f"({report.device}, {report.dtype}, {report.torch_threads} torch threads)",
            flush=True,
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(asdict(report), indent=1) + "\n")
    if args.record is not None:
        argv = sys.argv[1:] if argv is None else argv
        on_gpu = report.device != "cpu"
        save(args.record, "throughput", argv, throughput_figures(report, args), on_gpu=on_gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

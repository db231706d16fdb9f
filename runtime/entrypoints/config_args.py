"""The engine flags shared by `atomrt generate` and the `atomrt bench` subcommands that build an
engine: `add_config_args` adds them to a parser, `config_from_args` turns them into a `Config`.
`EngineArgs.add_cli_args` adds vLLM's: flags named as `LLM(...)`'s keywords, for scripts that pass
the parsed flags to `LLM(**vars(args))` (with vLLM's `FlexibleArgumentParser`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from atomrt.runtime.config import DEFAULT_MODEL


def add_config_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add the engine flags to `p`; returns them, in order (what a bench names a run by)."""
    return [
        p.add_argument(
            "--model",
            default=None,
            help=f"model folder, .gguf file or preset (default {DEFAULT_MODEL})",
        ),
        p.add_argument(
            "--config",
            default=None,
            help="YAML config file (README, Configuration; deploy/examples/)",
        ),
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, e.g. --set compilation_config.level=3 (repeatable)",
        ),
        p.add_argument(
            "--enforce-eager",
            action="store_true",
            default=None,
            help="no compilation, no CUDA graphs",
        ),
        p.add_argument("--level", type=int, default=None, help="compilation level 0-3"),
        p.add_argument(
            "--cudagraph-mode",
            default=None,
            help="NONE | TR_HYBRID | FULL | FULL_DECODE_ONLY | FULL_AND_TR_HYBRID",
        ),
        p.add_argument("--load-format", default=None, help="auto | safetensors | gguf | dummy"),
        p.add_argument(
            "--tokenizer",
            default=None,
            help="the tokenizer: a folder or .gguf file, or 'embedded' (the bundled "
            f"{DEFAULT_MODEL}'s); gives a preset's dummy weights a real one (default: the model's)",
        ),
        p.add_argument("--dtype", default=None, help="auto | float32 | float16 | bfloat16"),
        p.add_argument(
            "--quantization",
            default=None,
            help="fp8: quantize a float checkpoint's weights to e4m3 at load (FP8 checkpoints load "
            "as they ship without it)",
        ),
        p.add_argument("--kv-cache-dtype", default=None, help="auto | fp8 | fp8_e4m3"),
        p.add_argument("--device", default=None, help="auto | cpu | cuda"),
        p.add_argument("--tensor-parallel-size", "--tp", type=int, default=None),
        p.add_argument("--data-parallel-size", "--dp", type=int, default=None),
        p.add_argument("--executor", default=None, help="inproc | mp | ray"),
        p.add_argument(
            "--enable-tbo",
            default=None,
            help="two-batch overlap on MoE models: none | prefill | all | auto",
        ),
        p.add_argument("--max-num-seqs", type=int, default=None),
        p.add_argument(
            "--async-scheduling",
            action="store_true",
            default=None,
            help="plan step N+1 while step N runs on the device",
        ),
        p.add_argument(
            "--scheduler-delay-factor",
            type=float,
            default=None,
            help="hold new prompts while others run until the oldest has waited this many times the "
            "last prompt step's latency, so bursts prefill together (0: off)",
        ),
        p.add_argument("--max-model-len", type=int, default=None),
        p.add_argument(
            "--hf-overrides",
            type=_json_mapping,
            default=None,
            metavar="JSON",
            help='config.json fields to replace before the model is built, e.g. \'{"num_hidden_layers": '
            "4}' (the first 4 layers at the real shapes)",
        ),
        p.add_argument(
            "--speculative-config",
            type=_json_mapping,
            default=None,
            metavar="JSON",
            help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' or '
            '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}\'',
        ),
    ]


def _json_mapping(text: str) -> dict[str, Any]:
    """--speculative-config: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def config_from_args(args: argparse.Namespace):
    from atomrt.runtime.config_io import build_config

    base: dict[str, Any] = {}
    sections = {
        "compilation_config": {"level": args.level, "cudagraph_mode": args.cudagraph_mode},
        "model_config": {
            "load_format": args.load_format,
            "dtype": args.dtype,
            "max_model_len": args.max_model_len,
            "hf_overrides": getattr(args, "hf_overrides", None),
            "tokenizer": getattr(args, "tokenizer", None),
            "quantization": getattr(args, "quantization", None),
        },
        "cache_config": {"kv_cache_dtype": getattr(args, "kv_cache_dtype", None)},
        "parallel_config": {
            "tensor_parallel_size": args.tensor_parallel_size,
            "data_parallel_size": args.data_parallel_size,
            "executor": args.executor,
            "enable_tbo": getattr(args, "enable_tbo", None),
        },
        "scheduler_config": {
            "max_num_seqs": args.max_num_seqs,
            "async_scheduling": getattr(args, "async_scheduling", None),
            "delay_factor": getattr(args, "scheduler_delay_factor", None),
        },
    }
    if getattr(args, "speculative_config", None) is not None:
        base["speculative_config"] = args.speculative_config
    for top in ("model", "enforce_eager", "device"):
        if getattr(args, top) is not None:
            base[top] = getattr(args, top)
    for name, values in sections.items():
        chosen = {k: v for k, v in values.items() if v is not None}
        if chosen:
            base[name] = chosen
    return build_config(args.config, args.overrides, base)


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's `FlexibleArgumentParser`: an ArgumentParser that also takes a flag spelled with
    underscores (`--max_model_len 512` as `--max-model-len 512`)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        import sys

        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args([_dashed(a) for a in argv], namespace)


def _dashed(arg: str) -> str:
    """`--max_model_len=512` -> `--max-model-len=512`; values and short flags stay as written."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def _json_or_level(text: str) -> Any:
    """--compilation-config: a JSON object of its fields, or a level alone (`-O 3`)."""
    if text.strip().isdigit():
        return int(text)
    return _json_mapping(text)


def _section_default(section: str, name: str) -> Any:
    import dataclasses

    from atomrt.runtime.config import _SECTIONS

    (found,) = [f for f in dataclasses.fields(_SECTIONS[section]) if f.name == name]
    return found.default


def add_engine_args(p: Any) -> list[argparse.Action]:
    """The `LLM(...)` keywords as flags whose dests are the keywords and whose defaults are LLM's,
    so `LLM(**vars(parser.parse_args()))` takes every one (vLLM's `EngineArgs.add_cli_args`)."""
    on_off = argparse.BooleanOptionalAction
    model, cache, sched, par = "model_config", "cache_config", "scheduler_config", "parallel_config"
    return [
        p.add_argument("--model", default=DEFAULT_MODEL, help="model folder, .gguf file or preset"),
        p.add_argument(
            "--tokenizer", default=None, help="a folder or .gguf file, or 'embedded' (the model's)"
        ),
        p.add_argument(
            "--dtype",
            default=_section_default(model, "dtype"),
            help="auto | float32 | float16 | bfloat16",
        ),
        p.add_argument("--seed", type=int, default=_section_default(model, "seed")),
        p.add_argument("--max-model-len", type=int, default=None),
        p.add_argument(
            "--load-format",
            default=_section_default(model, "load_format"),
            help="auto | safetensors | gguf | dummy",
        ),
        p.add_argument("--quantization", "-q", default=None, help="fp8 (weights to e4m3 at load)"),
        p.add_argument("--max-logprobs", type=int, default=_section_default(model, "max_logprobs")),
        p.add_argument(
            "--hf-overrides",
            type=_json_mapping,
            default=None,
            metavar="JSON",
            help="config.json fields to replace before the model is built",
        ),
        p.add_argument(
            "--trust-remote-code",
            action="store_true",
            default=False,
            help="not supported (atomrt runs no model code from the checkpoint)",
        ),
        p.add_argument("--device", default="auto", help="auto | cpu | cuda"),
        p.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=_section_default(par, "tensor_parallel_size"),
        ),
        p.add_argument(
            "--data-parallel-size",
            "-dp",
            type=int,
            default=_section_default(par, "data_parallel_size"),
        ),
        p.add_argument(
            "--distributed-executor-backend",
            default=None,
            choices=["uni", "mp", "ray"],
            help="uni (in this process, the default) | mp | ray",
        ),
        p.add_argument(
            "--enable-tbo",
            default=_section_default(par, "enable_tbo"),
            help="two-batch overlap on MoE models: none | prefill | all | auto",
        ),
        p.add_argument("--block-size", type=int, default=_section_default(cache, "block_size")),
        p.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=_section_default(cache, "gpu_memory_utilization"),
        ),
        p.add_argument(
            "--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: from memory)"
        ),
        p.add_argument(
            "--enable-prefix-caching",
            action=on_off,
            default=_section_default(cache, "enable_prefix_caching"),
        ),
        p.add_argument(
            "--kv-cache-dtype",
            default=_section_default(cache, "kv_cache_dtype"),
            help="auto | fp8 | fp8_e4m3",
        ),
        p.add_argument("--max-num-seqs", type=int, default=_section_default(sched, "max_num_seqs")),
        p.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=_section_default(sched, "max_num_batched_tokens"),
        ),
        p.add_argument(
            "--enable-chunked-prefill",
            action=on_off,
            default=_section_default(sched, "enable_chunked_prefill"),
        ),
        p.add_argument(
            "--async-scheduling", action=on_off, default=_section_default(sched, "async_scheduling")
        ),
        p.add_argument(
            "--enforce-eager", action=on_off, default=False, help="no compilation, no CUDA graphs"
        ),
        p.add_argument(
            "--compilation-config",
            "-O",
            type=_json_or_level,
            default={},
            metavar="JSON",
            help='e.g. \'{"level": 3, "cudagraph_mode": "FULL"}\', or a level alone (-O 3)',
        ),
        p.add_argument(
            "--speculative-config",
            type=_json_mapping,
            default=None,
            metavar="JSON",
            help='e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'',
        ),
        p.add_argument(
            "--generation-config",
            default="auto",
            help="auto (the model folder's generation_config.json) | vllm (none) | a folder",
        ),
        p.add_argument(
            "--override-generation-config",
            type=_json_mapping,
            default=None,
            metavar="JSON",
            help="sampling defaults over generation_config's",
        ),
        p.add_argument(
            "--disable-log-stats",
            action="store_true",
            default=False,
            help="no statistics (LLM() counts and logs them when this flag is not given)",
        ),
    ]


# LLM's own keywords among the flags (no engine setting): from_cli_args keeps them only when set
_LLM_ONLY_DEFAULTS = {
    "generation_config": "auto",
    "override_generation_config": None,
    "disable_log_stats": False,
}


class EngineArgs:
    """vLLM's `EngineArgs`: the model and the keywords `LLM(...)` takes, held until
    `create_engine_config()` checks them (a ConfigError names a keyword atomrt does not take).
    `LLMEngine.from_engine_args(EngineArgs(model=...))` builds an engine of them;
    `add_cli_args(parser)` adds those keywords as flags (dests the keyword names, defaults LLM's),
    `from_cli_args(args)` takes them back from the parsed namespace."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        self.model = model
        self.kwargs = kwargs
        self._config: Any = None  # a config built elsewhere, used as is

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in {"model": self.model, **self.kwargs}.items())
        return f"{type(self).__name__}({items})"

    @staticmethod
    def add_cli_args(parser: Any) -> Any:
        """Add the flags to `parser` (or an argument group of one) and return it."""
        add_engine_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The flags add_cli_args added, from `args`; the namespace's other names (a script's
        own flags) are left out."""
        names = [a.dest for a in add_engine_args(argparse.ArgumentParser(add_help=False))]
        kwargs = {n: getattr(args, n) for n in names if hasattr(args, n)}
        for name, default in _LLM_ONLY_DEFAULTS.items():
            if name in kwargs and kwargs[name] == default:
                del kwargs[name]
        return cls(kwargs.pop("model", DEFAULT_MODEL), **kwargs)

    def create_tokenizer(self, config: Any) -> Any:
        """The tokenizer of the engine `config` describes (None for a model without one)."""
        from atomrt.runtime.entrypoints.llm import load_tokenizer_for

        return load_tokenizer_for(config)

    def create_engine_config(self):
        if self._config is not None:
            return self._config
        from atomrt.runtime.entrypoints.llm import config_from_kwargs

        return config_from_kwargs(self.model, dict(self.kwargs))

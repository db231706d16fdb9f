"""The engine flags shared by `atomrt generate` and the `atomrt bench` subcommands that build an
engine: `_add_config_args` adds them to a parser, `config_from_args` turns them into a `Config`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from atomrt.runtime.config import DEFAULT_MODEL


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"model folder, .gguf file or preset (default {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--config", default=None, help="YAML config file (README, Configuration; deploy/examples/)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set compilation_config.level=3 (repeatable)",
    )
    p.add_argument(
        "--enforce-eager", action="store_true", default=None, help="no compilation, no CUDA graphs"
    )
    p.add_argument("--level", type=int, default=None, help="compilation level 0-3")
    p.add_argument(
        "--cudagraph-mode",
        default=None,
        help="NONE | TR_HYBRID | FULL | FULL_DECODE_ONLY | FULL_AND_TR_HYBRID",
    )
    p.add_argument("--load-format", default=None, help="auto | safetensors | gguf | dummy")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer: a folder or .gguf file, or 'embedded' (the bundled "
        f"{DEFAULT_MODEL}'s); gives a preset's dummy weights a real one (default: the model's)",
    )
    p.add_argument("--dtype", default=None, help="auto | float32 | float16 | bfloat16")
    p.add_argument(
        "--quantization",
        default=None,
        help="fp8: quantize a float checkpoint's weights to e4m3 at load (FP8 checkpoints load "
        "as they ship without it)",
    )
    p.add_argument("--kv-cache-dtype", default=None, help="auto | fp8 | fp8_e4m3")
    p.add_argument("--device", default=None, help="auto | cpu | cuda")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=None)
    p.add_argument("--data-parallel-size", "--dp", type=int, default=None)
    p.add_argument("--executor", default=None, help="inproc | mp | ray")
    p.add_argument(
        "--enable-tbo",
        default=None,
        help="two-batch overlap on MoE models: none | prefill | all | auto",
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        default=None,
        help="plan step N+1 while step N runs on the device",
    )
    p.add_argument(
        "--scheduler-delay-factor",
        type=float,
        default=None,
        help="hold new prompts while others run until the oldest has waited this many times the "
        "last prompt step's latency, so bursts prefill together (0: off)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--hf-overrides",
        type=_json_mapping,
        default=None,
        metavar="JSON",
        help='config.json fields to replace before the model is built, e.g. \'{"num_hidden_layers": '
        "4}' (the first 4 layers at the real shapes)",
    )
    p.add_argument(
        "--speculative-config",
        type=_json_mapping,
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' or '
        '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}\'',
    )


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


class EngineArgs:
    """vLLM's `EngineArgs`: the model and the keywords `LLM(...)` takes, held until
    `create_engine_config()` checks them (a ConfigError names a keyword atomrt does not take).
    `LLMEngine.from_engine_args(EngineArgs(model=...))` builds an engine of them;
    `add_cli_args(parser)` / `from_cli_args(args)` take atomrt's engine flags from a command line."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        self.model = model
        self.kwargs = kwargs
        self._config: Any = None  # from_cli_args: the config the flags built

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in {"model": self.model, **self.kwargs}.items())
        return f"{type(self).__name__}({items})"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        _add_config_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        config = config_from_args(args)
        engine_args = cls(config.model)
        engine_args._config = config
        return engine_args

    def create_tokenizer(self, config: Any) -> Any:
        """The tokenizer of the engine `config` describes (None for a model without one)."""
        from atomrt.runtime.entrypoints.llm import load_tokenizer_for

        return load_tokenizer_for(config)

    def create_engine_config(self):
        if self._config is not None:
            return self._config
        from atomrt.runtime.entrypoints.llm import config_from_kwargs

        return config_from_kwargs(self.model, dict(self.kwargs))

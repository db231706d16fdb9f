"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))` and `LLM.chat(...)`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Optional, Union

from tqdm import tqdm

from atomrt.runtime.config import _SECTIONS, DEFAULT_MODEL, Config, ConfigError, parse_section
from atomrt.runtime.driver.engine import LLMEngine, Prompt
from atomrt.runtime.driver.outputs import RequestOutput
from atomrt.runtime.entrypoints.metrics_reader import Metric, OfflineMetrics
from atomrt.runtime.inputs import is_prompt
from atomrt.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]


# vLLM's LLM(...) keywords atomrt names otherwise: (atomrt's name, vLLM's value -> atomrt's)
VLLM_RENAMED: dict[str, tuple[str, dict[Any, Any]]] = {
    "distributed_executor_backend": (
        "executor",
        {None: "inproc", "uni": "inproc", "mp": "mp", "ray": "ray"},
    ),
}
# vLLM's keywords for what atomrt does not do, accepted at the values that ask for nothing: vLLM's
# default (and 0 swap space: atomrt recomputes preempted sequences, it swaps nothing)
VLLM_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "trust_remote_code": (False,),
    "tokenizer_mode": ("auto",),
    "skip_tokenizer_init": (False,),
    "revision": (None,),
    "tokenizer_revision": (None,),
    "pipeline_parallel_size": (1,),
    "cpu_offload_gb": (0,),
    "swap_space": (0, 4),
    "hf_token": (None,),
    "disable_custom_all_reduce": (False,),
    "enable_lora": (False,),
}


def config_from_kwargs(model: str, kwargs: dict[str, Any]) -> Config:
    """Config fields by name, and any section field by its bare name (max_num_seqs=8, level=...).

    `tensor_parallel_size`, `block_size`, `dtype` ... go to the section that holds them; a section
    is given whole as itself or a mapping of its fields, `compilation_config` also as a level
    (vLLM's forms). vLLM's other keywords map to atomrt's (`distributed_executor_backend`) or are
    accepted at the value that asks for nothing; any other keyword is a ConfigError naming it.
    """
    top = {f.name for f in dataclasses.fields(Config)}
    direct: dict[str, Any] = {"model": model}
    sections: dict[str, dict[str, Any]] = {}
    for key, value in kwargs.items():
        if key in VLLM_RENAMED:
            name, values = VLLM_RENAMED[key]
            if value not in values:
                raise ConfigError(f"LLM(): {key}={value!r}: one of {sorted(map(str, values))}")
            key, value = name, values[value]
        elif key in VLLM_DEFAULT_ONLY:
            accepted = VLLM_DEFAULT_ONLY[key]
            if not any(value == a and type(value) is type(a) for a in accepted):
                shown = " or ".join(repr(a) for a in accepted)
                raise ConfigError(
                    f"LLM(): {key}={value!r} is not supported by atomrt (only {shown})"
                )
            continue
        if key in top:
            direct[key] = parse_section(key, value) if key in _SECTIONS else value
            continue
        owners = [
            name
            for name, cls in _SECTIONS.items()
            if name != "speculative_config" and key in {f.name for f in dataclasses.fields(cls)}
        ]
        if not owners:
            raise ConfigError(f"LLM(): unknown argument {key!r}")
        sections.setdefault(owners[0], {})[key] = value
    for name, values in sections.items():
        base = direct.get(name) or _SECTIONS[name]()
        try:
            direct[name] = dataclasses.replace(base, **values)
        except TypeError as e:  # a value its section cannot take (its checks assume the type)
            raise ConfigError(f"LLM(): {e}") from None
    return Config(**direct)


class LLM:
    def __init__(
        self, model: str = DEFAULT_MODEL, *, config: Optional[Config] = None, **kwargs: Any
    ) -> None:
        """`model` and vLLM's keywords (config_from_kwargs), and the LLM's own, as vLLM's:
        `disable_log_stats` (default True; False counts what `get_metrics()` reports and logs a
        line per `generate`), `generation_config` ("auto": the model folder's
        generation_config.json gives `get_default_sampling_params()`; "vllm": none; or a folder
        holding one), `override_generation_config` (a mapping over it), `profiler_config`
        ({"profiler": "torch", "torch_profiler_dir": folder}, for `start_profile()`)."""
        own = {k: kwargs.pop(k) for k in _LLM_OWN if k in kwargs}
        if config is not None and kwargs:
            raise ConfigError("LLM(): pass either config= or keyword settings, not both")
        self.config = config if config is not None else config_from_kwargs(model, kwargs)
        self._generation_config = own.get("generation_config", "auto")
        self._override_generation_config = own.get("override_generation_config") or {}
        if not isinstance(self._generation_config, str):
            raise ConfigError("LLM(): generation_config must be 'auto', 'vllm' or a folder")
        if not isinstance(self._override_generation_config, dict):
            raise ConfigError("LLM(): override_generation_config must be a mapping")
        self._profiler_dir = _profiler_dir(own.get("profiler_config"))
        self._profiler: Any = None
        self.log_stats = not own.get("disable_log_stats", True)
        self._metrics = OfflineMetrics(self.config.model) if self.log_stats else None
        self._default_params: Optional[dict[str, Any]] = None
        tokenizer = load_tokenizer_for(self.config)
        self.tokenizer = tokenizer
        self.engine = LLMEngine(self.config, tokenizer)

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name of the engine."""
        return self.engine

    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer (vLLM's `get_tokenizer()`), None without one."""
        return self.tokenizer.hf if self.tokenizer is not None else None

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams of the model's generation_config.json (its temperature, top_p, top_k,
        min_p, repetition_penalty, and max_new_tokens as max_tokens), with
        `override_generation_config` over it; plain SamplingParams() when there is none or with
        generation_config="vllm"."""
        if self._default_params is None:
            self._default_params = _generation_defaults(
                self.config.model, self._generation_config, self._override_generation_config
            )
        return SamplingParams(**self._default_params)

    def start_profile(self) -> None:
        """Start torch's profiler (CPU and, on a GPU, CUDA activity) over this process's work;
        `stop_profile()` writes the trace under profiler_config's torch_profiler_dir."""
        if self._profiler_dir is None:
            raise ValueError(
                "start_profile: set LLM(profiler_config={'profiler': 'torch', "
                "'torch_profiler_dir': FOLDER}) to say where the trace goes"
            )
        if self.config.parallel_config.executor != "inproc":
            raise ValueError(
                f"start_profile: parallel_config.executor={self.config.parallel_config.executor!r}"
                " runs the model in other processes; profile with the inproc executor"
            )
        if self._profiler is not None:
            raise RuntimeError("start_profile: a profile is already running")
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        handler = torch.profiler.tensorboard_trace_handler(str(self._profiler_dir), use_gzip=True)
        self._profiler = torch.profiler.profile(
            activities=activities, record_shapes=True, on_trace_ready=handler
        )
        self._profiler.start()

    def stop_profile(self) -> None:
        if self._profiler is None:
            raise RuntimeError("stop_profile: no profile is running (call start_profile first)")
        profiler, self._profiler = self._profiler, None
        profiler.stop()

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's metrics as vLLM's reader gives them (Counter, Gauge,
        Histogram); needs LLM(disable_log_stats=False), as vLLM's does."""
        if self._metrics is None:
            raise RuntimeError(
                "get_metrics: stat logging is off; create LLM(disable_log_stats=False)"
            )
        return self._metrics.snapshot(self.engine)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Every prompt is validated before any runs.

        A progress bar (stderr) counts finished requests when there is more than one."""
        if is_prompt(prompts):
            prompts = [prompts]
        elif not isinstance(prompts, Sequence):
            raise ValueError(
                "prompts: must be a prompt (a string, a list of token ids, {'prompt': text} or "
                f"{{'prompt_token_ids': ids}}) or a list of them, got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(prompts))
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Union[Conversation, Sequence[Conversation]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        lora_request: None = None,
        chat_template: Optional[str] = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        mm_processor_kwargs: None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: each conversation through the chat template (the tokenizer's, or
        `chat_template`), then `generate`; the outputs' `prompt` is the templated text.
        `add_generation_prompt` opens the assistant's turn; `continue_final_message` instead
        continues the last (assistant) message; `chat_template_kwargs` go to the template (e.g.
        enable_thinking). `tools` (OpenAI's form) go to the template, as the server's do; to make
        the model call one, constrain the output (SamplingParams.structured_outputs)."""
        if lora_request is not None:
            raise ValueError("lora_request: atomrt serves no LoRA adapters")
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs: atomrt serves text-only models")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(
                "chat_template_content_format: one of 'auto', 'string', 'openai', got "
                f"{chat_template_content_format!r}"
            )
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message: cannot be set with add_generation_prompt (the default); "
                "pass add_generation_prompt=False"
            )
        if messages and isinstance(messages[0], dict):
            messages = [messages]  # type: ignore[list-item]
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        hf = self.tokenizer.hf
        template = chat_template if chat_template is not None else hf.chat_template
        if not template:
            raise ValueError("chat_template: this model's tokenizer has none; pass chat_template=")
        extra = dict(chat_template_kwargs or {})
        for key in ("tokenize", "chat_template", "add_generation_prompt", "tools"):
            if key in extra:
                raise ValueError(f"chat_template_kwargs.{key}: pass it as chat()'s own argument")
        prompts: list[Any] = []
        for conversation in messages:
            conversation = [_text_message(m) for m in conversation]
            if continue_final_message and (
                not conversation or conversation[-1].get("role") != "assistant"
            ):
                raise ValueError("continue_final_message: the last message must be the assistant's")
            text = hf.apply_chat_template(
                conversation,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                tokenize=False,
                **extra,
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)  # the engine may also return outputs of requests aborted before these
        bar = tqdm(
            total=len(ids), desc="Generating", unit="req", disable=not use_tqdm or len(ids) < 2
        )
        try:
            while len(final) < len(ids):
                if not self.engine.has_unfinished():
                    raise RuntimeError(
                        f"engine stopped with {len(ids) - len(final)} requests unfinished"
                    )
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted and out.request_id not in final:
                        final[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in final:
                    self.engine.abort(rid)
            raise
        finally:
            bar.close()
        outputs = [final[rid] for rid in ids]
        if self._metrics is not None:
            for out in outputs:
                self._metrics.observe(out)
            logger.info(
                "%d requests: %d prompt tokens, %d generated tokens (totals %d, %d)",
                len(outputs),
                sum(len(o.prompt_token_ids) for o in outputs),
                sum(len(c.token_ids) for o in outputs for c in o.outputs),
                self._metrics.prompt_tokens,
                self._metrics.generation_tokens,
            )
        return outputs

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


_LLM_OWN = (
    "disable_log_stats",
    "generation_config",
    "override_generation_config",
    "profiler_config",
)
# generation_config.json's fields that are sampling defaults, and their SamplingParams names
_GENERATION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _generation_defaults(
    model: str, generation_config: str, overrides: dict[str, Any]
) -> dict[str, Any]:
    """SamplingParams fields from the model's (or the named folder's) generation_config.json."""
    import json
    from pathlib import Path

    found: dict[str, Any] = {}
    if generation_config != "vllm":
        folder = (
            Path(model).expanduser() if generation_config == "auto" else Path(generation_config)
        )
        if generation_config != "auto" and not folder.is_dir():
            raise ConfigError(f"LLM(): generation_config={generation_config!r} is not a folder")
        path = folder / "generation_config.json"
        if folder.is_dir() and path.is_file():
            found = json.loads(path.read_text())
        found.update(overrides)
    else:
        found = dict(overrides)
    params = {
        _GENERATION_FIELDS[k]: v
        for k, v in found.items()
        if k in _GENERATION_FIELDS and v is not None
    }
    if found and params:
        logger.info("default sampling parameters from the generation config: %s", params)
    return params


def _profiler_dir(profiler_config: Any) -> Optional[str]:
    """vLLM's profiler_config: {"profiler": "torch", "torch_profiler_dir": folder}."""
    if profiler_config is None:
        return None
    if not isinstance(profiler_config, dict):
        profiler_config = dict(vars(profiler_config))
    unknown = set(profiler_config) - {"profiler", "torch_profiler_dir"}
    if unknown:
        raise ConfigError(f"LLM(): profiler_config.{sorted(unknown)[0]}: not supported")
    if profiler_config.get("profiler", "torch") != "torch":
        raise ConfigError("LLM(): profiler_config.profiler: only 'torch'")
    folder = profiler_config.get("torch_profiler_dir")
    if not folder:
        raise ConfigError("LLM(): profiler_config.torch_profiler_dir: the trace folder is needed")
    return str(folder)


def _text_message(message: Any) -> dict[str, Any]:
    """A chat message for the template: OpenAI's content parts of type text joined into one
    string; any other part is refused by name."""
    if not isinstance(message, dict):
        raise ValueError(f"messages: each message must be a mapping, got {type(message).__name__}")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(
                    f"messages.content: part type {kind!r} is not supported (text only)"
                )
            texts.append(part.get("text", ""))
        message = {**message, "content": "".join(texts)}
    return message


def _per_prompt(
    params: Union[SamplingParams, Sequence[SamplingParams], None], n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def load_tokenizer_for(config: Config):
    """The tokenizer of `config.model` (or model_config.tokenizer); None for a preset without one."""
    from atomrt.workers.loading.loader import resolve_model
    from atomrt.workers.loading.tokenizer import load_tokenizer

    resolved = resolve_model(config.model)
    explicit = config.model_config.tokenizer
    if not explicit and resolved.kind == "preset":
        return None
    if (
        not explicit
        and resolved.kind == "safetensors"
        and not any((resolved.path / f).is_file() for f in _TOKENIZER_FILES)
    ):
        logger.warning("%s has no tokenizer files: prompts must be token ids", resolved.path)
        return None
    return load_tokenizer(resolved, explicit)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

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
    "kv_cache_dtype": ("auto",),
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
        if config is not None and kwargs:
            raise ConfigError("LLM(): pass either config= or keyword settings, not both")
        self.config = config if config is not None else config_from_kwargs(model, kwargs)
        tokenizer = load_tokenizer_for(self.config)
        self.tokenizer = tokenizer
        self.engine = LLMEngine(self.config, tokenizer)

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
        conversations: Union[Conversation, Sequence[Conversation]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        tools: Optional[list[dict[str, Any]]] = None,
    ) -> list[RequestOutput]:
        """`tools` (OpenAI's form) go to the chat template, as the server's do; to make the model
        call one, constrain the output (SamplingParams.structured_outputs, the function's
        parameters schema)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        prompts = [
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True, tools=tools)
            for c in conversations
        ]
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
        return [final[rid] for rid in ids]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


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

"""The prompt forms the engine takes, as vLLM spells them (`vllm.inputs`).

A prompt is a string (tokenized by the engine), a list of token ids, a `TextPrompt`
(`{"prompt": text}`) or a `TokensPrompt` (`{"prompt_token_ids": ids}`, with an optional
`"prompt"` text that is reported back and not tokenized). Any other key, or any other type, is a
ValueError naming it: a key is never read as text.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, Optional, TypedDict, Union

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids; `prompt`, when given, is its text as the outputs report it."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]

# vLLM's prompt keys for inputs atomrt does not take (text-only models, no LoRA)
_REFUSED_KEYS = {
    "multi_modal_data": "atomrt serves text-only models",
    "multi_modal_uuids": "atomrt serves text-only models",
    "mm_processor_kwargs": "atomrt serves text-only models",
    "prompt_embeds": "atomrt takes text or token ids, not embeddings",
    "token_type_ids": "atomrt runs generative models only",
    "cache_salt": "atomrt's prefix cache is shared by every request",
    "encoder_prompt": "atomrt runs decoder-only models",
    "decoder_prompt": "atomrt runs decoder-only models",
}


def is_prompt(value: Any) -> bool:
    """Whether `value` is one prompt (not a list of them)."""
    if isinstance(value, (str, Mapping)):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and _is_token(value[0])


def _is_token(t: Any) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def token_ids_of(value: Any, field: str) -> list[int]:
    """`value` as a list of token ids, or a ValueError naming `field`."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{field}: must be a list of token ids, got {type(value).__name__}")
    if all(type(t) is int for t in value):  # the common case, without an ABC check a token
        return list(value)
    if not all(_is_token(t) for t in value):
        raise ValueError(f"{field}: must be a list of token ids (integers)")
    return [int(t) for t in value]


def parse_prompt(prompt: Any, tokenizer: Any) -> tuple[list[int], Optional[str]]:
    """(token ids, prompt text or None) of one prompt; a ValueError names what is wrong."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer, send token ids")
        return tokenizer.encode(prompt), prompt
    if isinstance(prompt, Mapping):
        return _parse_mapping(prompt, tokenizer)
    if isinstance(prompt, (list, tuple)):
        return token_ids_of(prompt, "prompt"), None
    raise ValueError(
        "prompt: must be a string, a list of token ids, {'prompt': text} or "
        f"{{'prompt_token_ids': ids}}, got {type(prompt).__name__}"
    )


def _parse_mapping(prompt: Mapping, tokenizer: Any) -> tuple[list[int], Optional[str]]:
    for key in prompt:
        if key in _REFUSED_KEYS:
            raise ValueError(f"prompt.{key}: not supported ({_REFUSED_KEYS[key]})")
        if key not in ("prompt", "prompt_token_ids"):
            raise ValueError(
                f"prompt.{key}: unknown field; a prompt mapping holds 'prompt' and/or "
                "'prompt_token_ids'"
            )
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"prompt.prompt: must be a string, got {type(text).__name__}")
    if "prompt_token_ids" in prompt:
        return token_ids_of(prompt["prompt_token_ids"], "prompt.prompt_token_ids"), text
    if text is None:
        raise ValueError("prompt: a mapping needs 'prompt' (text) or 'prompt_token_ids'")
    if tokenizer is None:
        raise ValueError("prompt.prompt: this model has no tokenizer, send prompt_token_ids")
    return tokenizer.encode(text), text

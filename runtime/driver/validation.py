"""What the driver checks before it queues a request or launches a worker.

Everything a request carries across a process boundary or that bounds a cost is checked here (the
field-by-field ranges of SamplingParams live in `SamplingParams.validate`, which this calls): a
ValueError names the field and leaves the engine as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from atomrt.runtime.config import Config, ConfigError
from atomrt.runtime.envs import ENV
from atomrt.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_logprobs: int  # model_config.max_logprobs


def check_request(
    token_ids: list[int], params: Any, limits: RequestLimits, max_model_len: int
) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params: must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    if not token_ids:
        raise ValueError("prompt: is empty; send at least one token")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt: has {len(token_ids)} tokens; max_model_len is {max_model_len}, which must leave room "
            "for at least one generated token"
        )
    bad = [t for t in token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"prompt: token ids out of range [0, {limits.vocab_size}): {bad[:5]}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limits.max_logprobs:
            raise ValueError(
                f"{name}: at most model_config.max_logprobs={limits.max_logprobs} top logprobs per "
                f"token, got {value}"
            )
    for name, ids in (
        ("logit_bias", params.logit_bias or ()),
        ("allowed_token_ids", params.allowed_token_ids or ()),
    ):
        bad = [t for t in ids if t >= limits.vocab_size]
        if bad:
            raise ValueError(f"{name}: token ids out of range [0, {limits.vocab_size}): {bad[:5]}")


def tokenize_bad_words(words: Optional[list[str]], tokenizer: Any) -> list[list[int]]:
    """`SamplingParams.bad_words` as the token sequences the sampler masks: each word as written
    (leading spaces dropped) and, where a leading space makes it other tokens of the same count,
    as it reads mid-text (vLLM's rule)."""
    if not words:
        return []
    if tokenizer is None:
        raise ValueError(
            "bad_words: this model has no tokenizer; send allowed_token_ids or logit_bias"
        )
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words: {word!r} is no tokens")
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def check_max_model_len(config: Config, arch: Any) -> None:
    """model_config.max_model_len may not exceed the model's context (arch.max_position) unless
    ATOMRT_ALLOW_LONG_MAX_MODEL_LEN=1, and then with a warning."""
    asked = config.model_config.max_model_len
    if asked is None or asked <= arch.max_position:
        return
    if not ENV.allow_long_max_model_len:
        raise ConfigError(
            f"model_config.max_model_len: {asked} exceeds the model's context of {arch.max_position} tokens; "
            "lower it, or set ATOMRT_ALLOW_LONG_MAX_MODEL_LEN=1 to run past the trained positions"
        )
    logger.warning(
        "model_config.max_model_len=%d exceeds the model's context of %d tokens (ATOMRT_ALLOW_LONG_MAX_MODEL_LEN=1): "
        "outputs past position %d may be garbage",
        asked,
        arch.max_position,
        arch.max_position,
    )

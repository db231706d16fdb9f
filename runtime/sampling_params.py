"""`SamplingParams`: how one request is sampled and when it stops.

Validated once, in `__post_init__`; every error names the field and the allowed range.
Semantics follow the OpenAI / vLLM vocabulary: temperature 0 means greedy; top_k 0 or -1 and
top_p 1 and min_p 0 disable their filter; repetition_penalty follows Hugging Face (divide positive
logits, multiply negative ones, over prompt + output); presence/frequency penalties follow OpenAI
(subtracted per output-token occurrence). `prompt_logprobs`, `logit_bias`, `allowed_token_ids` and
`bad_words` are vLLM's fields of the same names; token ids are checked against the model's
vocabulary when the engine takes the request (runtime/driver/validation.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Union

# Below this a temperature is treated as 0 (greedy): dividing by it would overflow.
_GREEDY_EPS = 1e-5
MAX_SEED = 2**63 - 1  # seeds travel to the workers as int64
MAX_INT32 = 2**31 - 1  # top_k and logprobs travel as int32-sized counts
MAX_N = 128  # samples per request (each is a sequence of its own)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # 0 or -1: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: Union[list[str], str, None] = field(default_factory=list)
    stop_token_ids: Optional[list[int]] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # how many top alternatives to return per sampled token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text in it
    # per prompt position after the first: the prompt token's logprob plus the top k alternatives
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None  # token id -> value added to its logit
    allowed_token_ids: Optional[list[int]] = None  # sample only among these
    bad_words: Optional[list[str]] = None  # words never generated (tokenized by the engine)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (the engine calls it again at add_request: fields may have been changed
        since construction); a ValueError names the field and the allowed range."""
        self._check_types()
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: must be in [1, {MAX_N}], got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_INT32:
            raise ValueError(
                f"top_k: must be -1 or 0 (disabled) or a positive integer <= {MAX_INT32}, got {self.top_k}"
            )
        if self.top_k == 0:
            self.top_k = -1
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty: must be > 0 (1 disables), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}: must be in [-2, 2] (0 disables), got {value}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens: must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_INT32:
                raise ValueError(f"{name}: must be None or an integer >= 0, got {value}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(
                f"seed: must be None or an integer in [0, {MAX_SEED}], got {self.seed}"
            )
        self._normalize_stops()
        self._normalize_logit_fields()

    def _check_types(self) -> None:
        ints = ("n", "top_k", "max_tokens", "min_tokens")
        floats = (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        )
        for name in ints:
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name}: must be an integer, got {getattr(self, name)!r}")
        for name in floats:
            value = getattr(self, name)
            if not _is_number(value) or not _finite(value):
                raise ValueError(f"{name}: must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        for name in ("seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name}: must be None or an integer, got {value!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")

    def _normalize_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(
                f"stop: must be a non-empty string or a list of non-empty strings, got {self.stop!r}"
            )
        self.stop = list(stop)
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(
                f"stop_token_ids: must be a list of token ids >= 0, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(ids)

    def _normalize_logit_fields(self) -> None:
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or not all(
                _is_int(t) and t >= 0 and _is_number(v) and _finite(v) for t, v in bias.items()
            ):
                raise ValueError(
                    f"logit_bias: must map token ids >= 0 to finite numbers, got {_preview(bias)}"
                )
            self.logit_bias = {int(t): float(v) for t, v in bias.items()} or None
        allowed = self.allowed_token_ids
        if allowed is not None:
            if (
                not isinstance(allowed, (list, tuple))
                or not allowed
                or not all(_is_int(t) and t >= 0 for t in allowed)
            ):
                raise ValueError(
                    "allowed_token_ids: must be a non-empty list of token ids >= 0, got "
                    f"{_preview(allowed)}"
                )
            self.allowed_token_ids = list(allowed)
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() for w in words
            ):
                raise ValueError(
                    f"bad_words: must be a list of non-blank strings, got {_preview(words)}"
                )
            self.bad_words = list(words) or None

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of n: one sample each, seeded `seed + index` when
        seeded (reproducible and distinct)."""
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def changes_logits(self) -> bool:
        """Whether sampling adds to the logits before penalties (logit_bias, allowed_token_ids,
        bad_words)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

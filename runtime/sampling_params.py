"""`SamplingParams`: how one request is sampled and when it stops.

Validated once, in `__post_init__`; every error names the field and the allowed range.
Semantics follow the OpenAI / vLLM vocabulary: temperature 0 means greedy; top_k 0 or -1 and
top_p 1 and min_p 0 disable their filter; repetition_penalty follows Hugging Face (divide positive
logits, multiply negative ones, over prompt + output); presence/frequency penalties follow OpenAI
(subtracted per output-token occurrence). `prompt_logprobs`, `logit_bias`, `allowed_token_ids` and
`bad_words` are vLLM's fields of the same names (`logit_bias` values clamped to [-100, 100], the
API's range); token ids are checked against the model's
vocabulary when the engine takes the request (runtime/driver/validation.py). `structured_outputs`
(vLLM's `StructuredOutputsParams`) constrains the output to a JSON schema, a regex, a choice, a
grammar or a structural tag; the engine compiles it (runtime/driver/grammar_compiler.py).
"""

from __future__ import annotations

import dataclasses
import enum
import json as _json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

# Below this a temperature is treated as 0 (greedy): dividing by it would overflow.
_GREEDY_EPS = 1e-5
MAX_SEED = 2**63 - 1  # seeds travel to the workers as int64
MAX_INT32 = 2**31 - 1  # top_k and logprobs travel as int32-sized counts
MAX_N = 128  # samples per request (each is a sequence of its own)
MAX_LOGIT_BIAS = 100.0  # |logit_bias| values past this are clamped to it


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


# StructuredOutputsParams: the fields that name a constraint, exactly one of which is set
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
DEFAULT_MAX_WHITESPACE = 4  # whitespace characters between two JSON elements, unless asked


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one of `json` (a JSON schema, a dict or its text),
    `json_object` (any JSON object), `regex`, `choice` (one of these strings), `grammar` (EBNF, as
    llama.cpp and xgrammar read it) and `structural_tag` (xgrammar's structural tag, a dict or its
    JSON text).

    JSON whitespace: by default at most `max_whitespace` characters between two elements (a model
    that pads with whitespace cannot run to max_tokens on it; None lifts the bound);
    `disable_any_whitespace` allows none beyond the separators `", "` and `": "`. A schema's
    objects hold only the properties it lists unless it allows others (`additionalProperties`)."""

    json: Union[str, dict, None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Union[str, dict, None] = None
    disable_any_whitespace: bool = False
    max_whitespace: Optional[int] = DEFAULT_MAX_WHITESPACE

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """The one constraint field that is set."""
        return next(name for name in CONSTRAINT_FIELDS if self._is_set(name))

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and value is not False

    def validate(self) -> None:
        """Shape checks (a ValueError names the field); whether a schema, regex or grammar means
        anything is the compiler's check, at add_request."""
        chosen = [name for name in CONSTRAINT_FIELDS if self._is_set(name)]
        if len(chosen) != 1:
            raise ValueError(
                "structured_outputs: set exactly one of "
                f"{', '.join(CONSTRAINT_FIELDS)}; got {', '.join(chosen) or 'none'}"
            )
        name = chosen[0]
        value = getattr(self, name)
        where = f"structured_outputs.{name}"
        if name in ("json", "structural_tag") and not isinstance(value, (str, dict)):
            raise ValueError(f"{where}: must be a JSON object or its text, got {_preview(value)}")
        if name in ("json", "structural_tag") and isinstance(value, str):
            try:
                parsed = _json.loads(value)
            except ValueError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"{where}: must be a JSON object, got {_preview(value)}")
        if name in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"{where}: must be a non-empty string, got {_preview(value)}")
        if name == "choice" and (
            not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError(f"{where}: must be a non-empty list of non-empty strings")
        if name == "choice":
            self.choice = list(value)
        if name == "json_object" and value is not True:
            raise ValueError(f"{where}: must be true, got {_preview(value)}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace: must be a bool")
        ws = self.max_whitespace
        if ws is not None and (not _is_int(ws) or ws < 1):
            raise ValueError(
                f"structured_outputs.max_whitespace: must be None or an integer >= 1, got {ws!r}"
            )

    def cache_key(self) -> str:
        """What the compiled grammar depends on: one text per distinct constraint (property order
        kept: it is the order a schema's output follows)."""
        value = getattr(self, self.kind)
        return _json.dumps(
            [self.kind, value, self.disable_any_whitespace, self.max_whitespace],
            separators=(",", ":"),
        )


class RequestOutputKind(enum.IntEnum):
    """What `LLMEngine.step()` returns for a request while it runs (vLLM's)."""

    CUMULATIVE = 0  # every step it produced a token: each sample's whole output so far
    DELTA = 1  # every step it produced a token: only the new text, tokens and logprobs
    FINAL_ONLY = 2  # one output, when the request finishes


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
    max_tokens: Optional[int] = 16  # None: as many as the context leaves after the prompt
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
    # the output follows a JSON schema, regex, choice or grammar (a mapping is taken as its fields)
    structured_outputs: Optional[StructuredOutputsParams] = None
    # vLLM's: keep only the prompt's last k tokens (-1: max_model_len of them)
    truncate_prompt_tokens: Optional[int] = None
    detokenize: bool = True  # False: token ids only, no text (and no stop strings)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # LLMEngine.step()'s outputs
    spaces_between_special_tokens: bool = True  # atomrt's fast tokenizers: True only
    extra_args: Optional[dict[str, Any]] = None  # carried with the request for custom code

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
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be None or >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= (self.max_tokens or MAX_INT32):
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
        self._normalize_structured_outputs()

    def _check_types(self) -> None:
        self._check_vllm_fields()
        ints = ("n", "top_k", "min_tokens")
        if self.max_tokens is not None and not _is_int(self.max_tokens):
            raise ValueError(f"max_tokens: must be None or an integer, got {self.max_tokens!r}")
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

    def _check_vllm_fields(self) -> None:
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(
                f"truncate_prompt_tokens: must be None, -1 (max_model_len) or >= 1, got {k!r}"
            )
        for name in ("detokenize", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        if not self.spaces_between_special_tokens:
            raise ValueError(
                "spaces_between_special_tokens: atomrt's (fast) tokenizers decode special tokens "
                "without added spaces; only True is taken"
            )
        if not self.detokenize and self.stop:
            raise ValueError("stop: stop strings need detokenize=True")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(
                    "output_kind: must be a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY), "
                    f"got {self.output_kind!r}"
                ) from None
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args: must be None or a dict, got {_preview(self.extra_args)}")

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
            # clamped to [-100, 100] as vLLM's and OpenAI's API take it: past that a bias already
            # forces or bans its token, and a larger one (1e38 over a temperature of 0.05) would
            # overflow float32 and turn the row's logits into NaN
            self.logit_bias = {
                int(t): min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(v))) for t, v in bias.items()
            } or None
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

    def _normalize_structured_outputs(self) -> None:
        so = self.structured_outputs
        if so is None or isinstance(so, StructuredOutputsParams):
            if so is not None:
                so.validate()
            return
        if not isinstance(so, dict):
            raise ValueError(
                "structured_outputs: must be a StructuredOutputsParams or a mapping of its fields, "
                f"got {_preview(so)}"
            )
        known = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
        unknown = sorted(set(so) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs: unknown field {unknown[0]!r}; the fields are "
                f"{', '.join(sorted(known))}"
            )
        self.structured_outputs = StructuredOutputsParams(**so)

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

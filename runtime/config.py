"""Configuration: one dataclass per concern, composed by `Config`.

This module imports no other atomrt module but the environment snapshot (`envs`) and the
sections that stand alone (`config_sections`). Names, fields and defaults follow the
guide (`CompilationLevel`, `CompilationConfig`, `CUDAGraphMode`, `Config.__post_init__`).
Values found at run time (KV block count, capture sizes actually recorded) are not stored here.
YAML loading and CLI overrides live in `atomrt.runtime.config_io`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Optional

# The sections that stand alone, and the checks shared with them, re-exported: users and the rest
# of atomrt import every configuration name from `atomrt.runtime.config`.
from atomrt.runtime.config_sections import (  # noqa: F401
    AUTO_SPIN_MIN_CPUS,
    AUTO_SPIN_US,
    DEFAULT_MODEL,
    DEFAULT_SPLITTING_OPS,
    GRAMMAR_BACKENDS,
    TBO_MODES,
    CacheConfig,
    CompilationConfig,
    CompilationLevel,
    ConfigError,
    CUDAGraphMode,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    _choice,
    _is_int,
    _positive_int,
    capture_size_ladder,
    usable_cpu_count,
)

logger = logging.getLogger(__name__)


class SpecMethod:
    """What configuration knows of one speculative method (`speculative_config.method`), asked
    before any engine exists: the fields it takes, the KV slots its drafter writes past a step,
    whether it may run steps without drafts, and what the block manager and the planner do for it.
    The method's driver half (runtime/driver/proposers.py) subclasses it, so the engine asks the
    same object; its worker half is in workers/spec_decode/. One subclass per method, registered
    in `SPEC_METHOD_TYPES`."""

    method: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()  # other names vLLM accepts for it
    # a prefix-cache hit leaves its last block to compute again (BlockManager.recompute_last_hit)
    recompute_last_hit: ClassVar[bool] = False
    # its drafts cost nothing when a step goes without them, so a SpecPolicy may pause it
    adaptive: ClassVar[bool] = False
    # the plan ships the token after a prompt chunk that samples nothing (RankPlanner.next_tokens)
    needs_next_tokens: ClassVar[bool] = False
    # a drafter on the workers reads the target's block tables whole: a windowed model's blocks
    # stay (BlockManager.window_for)
    keeps_window_blocks: ClassVar[bool] = False

    @classmethod
    def check_fields(cls, spec: SpeculativeConfig) -> dict[str, Any]:
        """Check the fields of `spec` it takes or refuses (a ConfigError naming the field); the
        fields it fills in, by name."""
        return {}

    @classmethod
    def num_lookahead_tokens(cls, k: int) -> int:
        """KV slots its drafter writes past a step's last row (`k`: num_speculative_tokens)."""
        return 0

    @classmethod
    def check_config(cls, spec: SpeculativeConfig, config: Config) -> None:
        """Check it against the rest of the configuration (the parallel layout)."""


class NgramMethod(SpecMethod):
    """Prompt lookup on the sequence's own tokens, on the driver."""

    method = "ngram"
    adaptive = True

    @classmethod
    def check_fields(cls, spec: SpeculativeConfig) -> dict[str, Any]:
        """No model; the n-gram window, one bound giving the other, 5..5 when neither is set."""
        if spec.model is not None:
            raise ConfigError(
                "speculative_config.model: method 'ngram' proposes from the prompt and takes no model"
            )
        lo, hi = spec.prompt_lookup_min, spec.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi or lo)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _positive_int(value):
                raise ConfigError(
                    f"speculative_config.{name}: must be a positive integer, got {value!r}"
                )
        if lo > hi:
            raise ConfigError(
                f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )
        return {"prompt_lookup_min": lo, "prompt_lookup_max": hi}


class DraftModelMethod(SpecMethod):
    """A smaller model with the target's vocabulary, run whole on each rank's first GPU."""

    method = "draft_model"
    keeps_window_blocks = True

    @classmethod
    def check_fields(cls, spec: SpeculativeConfig) -> dict[str, Any]:
        if not isinstance(spec.model, str) or not spec.model:
            raise ConfigError(
                "speculative_config.model: method 'draft_model' needs the draft model's path"
            )
        if spec.draft_tensor_parallel_size not in (None, 1):
            raise ConfigError(
                "speculative_config.draft_tensor_parallel_size: the drafter runs whole on each "
                f"rank's first GPU; must be 1, got {spec.draft_tensor_parallel_size!r}"
            )
        return {}


class MTPMethod(SpecMethod):
    """The target's own multi-token-prediction layers, run after a step's tokens are sampled."""

    method = "mtp"
    aliases = ("deepseek_mtp",)
    # an MTP drafter's KV at a position depends on the token after it, which a later sequence
    # sharing the block need not share
    recompute_last_hit = True
    needs_next_tokens = True  # the MTP layer's input at a prompt chunk's last row
    keeps_window_blocks = True

    @classmethod
    def check_fields(cls, spec: SpeculativeConfig) -> dict[str, Any]:
        """The MTP drafter is the target's own layers: no draft model, no n-gram window."""
        for name in ("model", "prompt_lookup_min", "prompt_lookup_max"):
            if getattr(spec, name) is not None:
                raise ConfigError(
                    f"speculative_config.{name}: method 'mtp' drafts with the target's own "
                    "multi-token-prediction layers and takes no such setting"
                )
        return {}

    @classmethod
    def num_lookahead_tokens(cls, k: int) -> int:
        """Its passes 2..k run one position further each, beyond the rows the target verified."""
        return k - 1

    @classmethod
    def check_config(cls, spec: SpeculativeConfig, config: Config) -> None:
        tp = config.parallel_config.tensor_parallel_size
        if spec.draft_tensor_parallel_size not in (None, tp):
            raise ConfigError(
                "speculative_config.draft_tensor_parallel_size: the MTP layers run split as the "
                f"target is (tensor_parallel_size={tp}); got {spec.draft_tensor_parallel_size!r}"
            )


SPEC_METHOD_TYPES: dict[str, type[SpecMethod]] = {
    cls.method: cls for cls in (NgramMethod, DraftModelMethod, MTPMethod)
}
SPEC_METHODS = tuple(SPEC_METHOD_TYPES)
# other names vLLM accepts for a method
SPEC_METHOD_ALIASES = {alias: m for m, cls in SPEC_METHOD_TYPES.items() for alias in cls.aliases}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM users write it: `{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": 4, "prompt_lookup_min": 1}`, `{"method": "draft_model", "model": PATH,
    "num_speculative_tokens": k}` (a smaller model with the target's vocabulary) or `{"method":
    "mtp", "num_speculative_tokens": k}` (the target's own multi-token-prediction layers;
    `deepseek_mtp` is the same). `method` may be left out when `model` is given. The ngram window
    defaults to 5..5, one bound to the other."""

    num_speculative_tokens: int = 0  # k: draft tokens each request verifies per step (required)
    method: Optional[str] = None  # ngram | draft_model | mtp
    model: Optional[str] = None  # the draft model (draft_model)
    prompt_lookup_max: Optional[int] = None  # the longest suffix n-gram ngram matches
    prompt_lookup_min: Optional[int] = None  # the shortest
    draft_tensor_parallel_size: Optional[int] = None  # the drafter runs whole: 1 (or unset)
    # ngram under async scheduling: speculate only while it emits more tokens per second than
    # plain decoding, measured in alternating phases (runtime/driver/speculation.py, SpecPolicy)
    adaptive: bool = True

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not _positive_int(k):
            raise ConfigError(
                "speculative_config.num_speculative_tokens: required, the draft tokens each "
                f"request verifies per step (a positive integer); got {k!r}"
            )
        method = self.method
        if method is None:
            if self.model is None:
                raise ConfigError(
                    "speculative_config.method: give 'ngram', or a draft model with "
                    "speculative_config.model"
                )
            method = DraftModelMethod.method  # vLLM's: a model and no method
        method = SPEC_METHOD_ALIASES.get(method, method)
        _choice("speculative_config.method", method, tuple(SPEC_METHOD_TYPES))
        object.__setattr__(self, "method", method)
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative_config.adaptive: true or false, got {self.adaptive!r}")
        for name, value in self.method_type.check_fields(self).items():
            object.__setattr__(self, name, value)

    @property
    def method_type(self) -> type[SpecMethod]:
        """The method's class: what configuration, the engine and the block manager ask of it."""
        return SPEC_METHOD_TYPES[self.method]

    def may_pause(self, async_scheduling: bool) -> bool:
        """Whether steps without drafts also run: a SpecPolicy pauses a method whose drafts cost
        nothing when a step goes without them (n-gram), under async scheduling, unless
        `adaptive` is off."""
        return self.method_type.adaptive and self.adaptive and async_scheduling

    @property
    def max_q_len(self) -> int:
        """Query rows of a verify step per request: the decoded row and its drafts (`mtp_k + 1`)."""
        return self.num_speculative_tokens + 1

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a drafter writes past a step's last row: an MTP drafter's passes 2..k run one
        position further each, beyond the rows the target verified."""
        return self.method_type.num_lookahead_tokens(self.num_speculative_tokens)

    @classmethod
    def parse(cls, value: Any) -> Optional[SpeculativeConfig]:
        """A SpeculativeConfig, a mapping of its fields (vLLM's dict form), or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(
                f"speculative_config: expected a mapping such as {{'method': 'ngram', "
                f"'num_speculative_tokens': 3}}, got {value!r}"
            )
        return _build_dataclass(cls, value, "speculative_config.")


@dataclass
class Config:
    model: str = DEFAULT_MODEL
    enforce_eager: bool = False
    capture_sizes: Optional[list[int]] = None  # computed from compilation_config
    device: str = "auto"  # auto | cpu | cuda
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: Optional[SpeculativeConfig] = None  # None: no speculative decoding
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model: must be a non-empty path or model name, got {self.model!r}")
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        for name in _SECTIONS:  # vLLM's forms: a mapping of the fields, or a level
            setattr(self, name, parse_section(name, getattr(self, name)))
        self._check_speculation()
        # Derive into a copy: the caller's CompilationConfig stays as given (it may be reused).
        self.compilation_config = cc = copy.deepcopy(self.compilation_config)
        if self.enforce_eager:
            # The guide: enforce_eager skips all compilation and CUDA graphs.
            cc.level = CompilationLevel.NO_COMPILATION
            cc.cudagraph_mode = CUDAGraphMode.NONE
        if not cc.use_cudagraph:
            cc.cudagraph_mode = CUDAGraphMode.NONE
        if cc.level == CompilationLevel.PIECEWISE:
            cc.set_splitting_ops_for_v1()
            self._set_cudagraph_sizes()
            if cc.cudagraph_mode is None:
                cc.cudagraph_mode = CUDAGraphMode.TR_HYBRID
            cc.init_with_cudagraph_sizes(self.capture_sizes)
        else:
            if cc.cudagraph_mode is None:
                # Below level 3 the guide names no default; whole-model graphs need no compiler.
                cc.cudagraph_mode = CUDAGraphMode.FULL
            self._set_cudagraph_sizes()
            cc.init_with_cudagraph_sizes(self.capture_sizes)

    @property
    def max_q_len(self) -> int:
        """Query rows per request of a decode step: 1, or `num_speculative_tokens + 1`."""
        return self.speculative_config.max_q_len if self.speculative_config else 1

    @property
    def capture_q_lens(self) -> tuple[int, ...]:
        """Query rows per request of the decode buckets capture records: `max_q_len`, and 1 too
        where speculation also runs steps without drafts (n-gram speculation that its policy
        pauses under async scheduling)."""
        spec = self.speculative_config
        if spec is not None and spec.may_pause(self.scheduler_config.async_scheduling):
            return (spec.max_q_len, 1)
        return (self.max_q_len,)

    def _check_speculation(self) -> None:
        spec = self.speculative_config
        budget = self.scheduler_config.max_num_batched_tokens
        if spec is not None and spec.max_q_len > budget:
            raise ConfigError(
                f"speculative_config.num_speculative_tokens={spec.num_speculative_tokens}: a "
                f"verify step of one request runs {spec.max_q_len} rows, more than "
                f"scheduler_config.max_num_batched_tokens={budget}"
            )
        if spec is not None:
            spec.method_type.check_config(spec, self)
        tbo = self.parallel_config.enable_tbo
        if spec is not None and tbo != "none":
            raise ConfigError(
                f"speculative_config with parallel_config.enable_tbo={tbo!r}: two-batch overlap "
                "does not split verify steps yet (use enable_tbo: none)"
            )

    def _set_cudagraph_sizes(self) -> None:
        """Capture sizes: explicit list, else the ladder up to cuda_graph_sizes[0], else the list.

        Sizes the scheduler can never produce are dropped from the ladder: above max_num_seqs, or,
        with speculative decoding, above max_num_batched_tokens // (k + 1) (a verify step runs k + 1
        rows per request); an explicit list that holds one is an error.
        """
        cc = self.compilation_config
        max_num_seqs = self.scheduler_config.max_num_seqs
        if self.speculative_config is not None:
            max_num_seqs = min(
                max_num_seqs, self.scheduler_config.max_num_batched_tokens // self.max_q_len
            )
        if cc.cudagraph_capture_sizes is not None:
            sizes = sorted(set(int(s) for s in cc.cudagraph_capture_sizes))
            too_big = [s for s in sizes if s > max_num_seqs]
            if too_big:
                raise ConfigError(
                    f"compilation_config.cudagraph_capture_sizes: {too_big} exceed "
                    f"{max_num_seqs} (scheduler_config.max_num_seqs, or with speculative decoding "
                    "max_num_batched_tokens // (num_speculative_tokens + 1)); raise them or drop "
                    "the sizes"
                )
        elif len(cc.cuda_graph_sizes) == 1:
            sizes = [
                s for s in capture_size_ladder(int(cc.cuda_graph_sizes[0])) if s <= max_num_seqs
            ]
        else:
            sizes = sorted(set(int(s) for s in cc.cuda_graph_sizes if int(s) <= max_num_seqs))
        self.capture_sizes = sizes

    @property
    def cudagraph_mode(self) -> CUDAGraphMode:
        return self.compilation_config.cudagraph_mode

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML-ready); `Config.from_dict(c.to_dict())` round-trips."""
        d = asdict(self)
        d["compilation_config"]["cudagraph_mode"] = self.compilation_config.cudagraph_mode.name
        return d

    def compute_hash(self) -> str:
        """Hash of what changes the compiled model graph; never ports, ranks or placement."""
        factors = {
            "model": self.model,
            "dtype": self.model_config.dtype,
            "load_format_is_gguf": self.model_config.load_format == "gguf",
            "tp": self.parallel_config.tensor_parallel_size,
            "compilation": self.compilation_config.compute_hash(),
        }
        if self.model_config.hf_overrides is not None:  # absent otherwise: earlier keys stay valid
            factors["hf_overrides"] = self.model_config.hf_overrides
        if self.model_config.quantization is not None:  # FP8 layers run other ops
            factors["quantization"] = self.model_config.quantization
        blob = json.dumps(factors, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return _build_dataclass(cls, data, "")


_SECTIONS = {
    "compilation_config": CompilationConfig,
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "speculative_config": SpeculativeConfig,
    "structured_outputs_config": StructuredOutputsConfig,
}


def parse_section(name: str, value: Any) -> Any:
    """A section of `Config` as given: the section itself, a mapping of its fields (vLLM's
    `compilation_config={"level": 3, "cudagraph_mode": "FULL"}`), or for `compilation_config`
    a level alone (vLLM's `compilation_config=3`)."""
    cls = _SECTIONS[name]
    if name == "speculative_config":
        return SpeculativeConfig.parse(value)
    if isinstance(value, cls):
        return value
    if name == "compilation_config" and _is_int(value):
        return CompilationConfig(level=value)
    if isinstance(value, dict):
        return _build_dataclass(cls, value, f"{name}.")
    raise ConfigError(
        f"{name}: expected a {cls.__name__} or a mapping of its fields"
        + (" or a level (0-3)" if name == "compilation_config" else "")
        + f", got {value!r}"
    )


def _build_dataclass(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{prefix}{key}: unknown key; known keys are {sorted(known)}")
        if cls is Config and key == "speculative_config":
            kwargs[key] = SpeculativeConfig.parse(value)
        elif cls is Config and key in _SECTIONS:
            kwargs[key] = _build_dataclass(_SECTIONS[key], value or {}, f"{key}.")
        elif cls is Config and key == "capture_sizes":
            continue  # derived in __post_init__
        else:
            kwargs[key] = _check_type(f"{prefix}{key}", known[key].type, value)
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - dataclass signature mismatch
        raise ConfigError(f"{where}: {e}") from None


def _check_type(name: str, annotation: Any, value: Any) -> Any:
    """Check a YAML/CLI value against a field's annotation (a string under `from __future__`)."""
    ann = str(annotation).replace(" ", "")
    if value is None:
        if ann.startswith("Optional["):
            return None
        raise ConfigError(f"{name}: must not be null")
    if ann.startswith("Optional["):
        ann = ann[len("Optional[") : -1]
    if "CUDAGraphMode" in ann:
        return CUDAGraphMode.parse(value)
    checks = {
        "bool": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        # a number or a keyword ("auto"); the field's __post_init__ checks which
        "Union[float,str]": lambda v: isinstance(v, (int, float, str)) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "dict": lambda v: isinstance(v, dict),
        "list[int]": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
        "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "list[Union[int,str]]": lambda v: (
            isinstance(v, list) and all(_is_int(x) or isinstance(x, str) for x in v)
        ),
    }
    check = checks.get(ann)
    if check is None:  # pragma: no cover - a new field type without a check
        raise ConfigError(f"{name}: no type check for {ann}")
    if not check(value):
        raise ConfigError(f"{name}: expected {ann}, got {value!r} ({type(value).__name__})")
    return float(value) if ann == "float" else value

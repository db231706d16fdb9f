"""`Worker`: one (DP rank, TP rank). It owns a ModelRunner and the mirror of its sequences,
applies each `StepPlan`, runs the step and, on TP rank 0, returns a `StepResult`.

The same class runs in-process, in an `mp` child process and as a Ray actor; the transport loop
that feeds it plans lives in workers/process.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from atomrt.compile import compilation_counter
from atomrt.distributed.communication_op import DPInfo, TPInfo
from atomrt.distributed.messages import GrammarBitmask, PromptLogprobs, StepPlan, StepResult
from atomrt.runtime.config import Config
from atomrt.runtime.decision import ForwardDecision, TboTiming
from atomrt.workers.probes import probing
from atomrt.workers.runner.compile_warmup import (
    CompileReport,
    compile_all_sizes,
    compile_report,
    prefetch_triton_key,
)
from atomrt.workers.runner.input_batch import PromptRows, SeqMirrors, dummy_idle_inputs
from atomrt.workers.runner.kernel_warmup import warm_eager_kernels
from atomrt.workers.runner.kv_sizing import determine_num_blocks
from atomrt.workers.runner.model_runner import ModelRunner, StepForward, resolve_device
from atomrt.workers.runner.readback import Readback
from atomrt.workers.runner.sampler import SamplingTensors
from atomrt.workers.runner.ubatch_auto import measure_tbo
from atomrt.workers.step_bytes import StepBytes, runner_step_bytes

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PendingStep:
    """A launched step: its sampled sequences and, until `Worker.finish`, the readback in flight.
    A step with grammar-constrained rows waits on the sampling worker with its forward run and its
    sampling not (`forward`), until its masks arrive (`Worker.apply_grammar`)."""

    step: int
    seq_ids: list[int]
    readback: Optional[Readback] = None  # TP rank 0, until finished
    result: Optional[StepResult] = None
    prompt_rows: Optional[PromptRows] = None  # the rows that computed prompt logprobs
    forward: Optional[StepForward] = None  # structured outputs: sampling waits for the masks
    grammar_rows: Optional[np.ndarray] = None  # the logits rows the masks constrain
    probe: Optional[np.ndarray] = None  # what the plan's probe counted (workers/probes.py)

    @property
    def done(self) -> bool:
        return self.readback is None and self.forward is None

    @property
    def awaits_grammar(self) -> bool:
        return self.forward is not None


@dataclass(frozen=True)
class WorkerInfo:
    """What the driver learns from a worker at start-up (plain data: crosses Ray and mp)."""

    num_kv_blocks: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    capture_seconds: float
    compile_seconds: float  # torch.compile (Dynamo + Inductor, or a cache load) in this process
    capture_sizes: tuple[int, ...]
    req_keys: tuple[tuple[int, int], ...]
    prefill_token_sizes: tuple[int, ...]
    decode_token_sizes: tuple[int, ...]
    tbo_req_keys: tuple[tuple[int, int], ...] = ()  # request buckets recorded as TBO graphs
    tbo_timings: tuple[TboTiming, ...] = ()  # enable_tbo: auto's start-up measurements
    # TR_HYBRID: request buckets whose decode steps replay their token graph as one launch
    token_req_keys: tuple[tuple[int, int], ...] = ()
    # What each rank compiled and loaded at start-up, in rank order: a worker reports its own, the
    # mp and ray executors gather every rank's.
    compile_reports: tuple[CompileReport, ...] = ()
    # This worker's start-up, phase by phase in order: (name, seconds); see Worker.phase
    startup_phases: tuple[tuple[str, float], ...] = ()
    # What a decode step of this rank's model reads (workers/step_bytes.py): a bench's floor
    step_bytes: Optional[StepBytes] = None


class Worker:
    def __init__(
        self,
        config: Config,
        dp_rank: int = 0,
        tp_rank: int = 0,
        local_device: Optional[int] = None,
        tp_group: Any = None,
        progress: Optional[Callable[[], None]] = None,
        dp_group: Any = None,
    ) -> None:
        """`progress` is called while a step waits on the device (the process's heartbeat);
        `dp_group` joins this rank to the same TP rank of every DP rank (MoE layers gather there)."""
        self.config = config
        self.progress = progress
        self.dp_rank, self.tp_rank = dp_rank, tp_rank
        pc = config.parallel_config
        tp = TPInfo(tp_rank, pc.tensor_parallel_size, tp_group)
        dp = DPInfo(dp_rank, pc.data_parallel_size, dp_group, timeout_s=pc.worker_timeout_s)
        device = resolve_device(config, local_device)
        self._compile_counts = compilation_counter.snapshot()  # this start's work is the difference
        self._phases: list[tuple[str, float]] = []
        start = time.perf_counter()
        prefetch_triton_key(device)  # hashed while the model loads
        self.runner = ModelRunner(config, device, tp, dp)
        self._phase("model and weights", start)
        self.mirrors = SeqMirrors(config.cache_config.block_size)
        self.next_step = 0
        self._unfinished: Optional[PendingStep] = (
            None  # TP rank 0: the last launched step, until finished
        )

    def _phase(self, name: str, start: float) -> float:
        """Record that start-up phase `name` ran from `start` (perf_counter) until now."""
        now = time.perf_counter()
        self._phases.append((name, now - start))
        return now

    def determine_num_blocks(self) -> int:
        start = time.perf_counter()
        num_blocks = determine_num_blocks(self.runner).num_blocks
        self._phase("KV sizing (its profile run compiles the general shape)", start)
        return num_blocks

    def initialize(self, num_blocks: int) -> WorkerInfo:
        """Allocate the KV cache (the group agreed on `num_blocks`), compile every piece at every
        compile size (levels 2-3), compile the eager attention kernels' variants, and capture
        graphs."""
        start = time.perf_counter()
        self.runner.allocate_kv_cache(num_blocks)
        start = self._phase("KV cache allocation", start)
        sizes, skipped = compile_all_sizes(self.runner)
        start = self._phase("compile sizes", start)
        warm_eager_kernels(self.runner)
        start = self._phase("eager attention kernels", start)
        seconds = self.runner.capture_cudagraph()
        start = self._phase("graph capture", start)
        graphs = self.runner.graphs
        captured = graphs.captured_buckets(self.runner.model)
        # unseeded requests draw from the default generators: seeded by model_config.seed once
        # the warm-up is done, so that an engine's sampled outputs repeat from run to run
        torch.manual_seed(self.config.model_config.seed)
        timings = ()
        if self.config.parallel_config.enable_tbo == "auto":
            timings = measure_tbo(self.runner, captured)
            self._phase("TBO measurement", start)
        arch = self.runner.arch
        return WorkerInfo(
            num_kv_blocks=num_blocks,
            vocab_size=arch.vocab_size,
            max_model_len=self.runner.shape.max_model_len,
            eos_token_ids=tuple(arch.eos_token_ids),
            capture_seconds=seconds,
            compile_seconds=compilation_counter.compile_seconds,
            capture_sizes=tuple(graphs.capture_sizes),
            req_keys=captured.req_keys,
            prefill_token_sizes=captured.prefill_token_sizes,
            decode_token_sizes=captured.decode_token_sizes,
            tbo_req_keys=captured.tbo_req_keys,
            tbo_timings=timings,
            token_req_keys=captured.token_req_keys,
            compile_reports=(compile_report(self.runner, self._compile_counts, sizes, skipped),),
            startup_phases=tuple(self._phases),
            step_bytes=runner_step_bytes(self.runner),
        )

    def launch(self, plan: StepPlan) -> PendingStep:
        """Apply the plan and start its forward and sampling on the device; `finish` waits for
        them. A probed plan's rows are counted (workers/probes.py) into the step's result."""
        if not plan.probe or plan.ranks[self.dp_rank].num_seqs == 0:
            return self._launch(plan)
        with probing(plan.probe, self.runner.model) as probed:
            pending = self._launch(plan)
        pending.probe = probed.counts
        if pending.result is not None:
            pending.result.probe = probed.counts
        return pending

    @torch.inference_mode()
    def _launch(self, plan: StepPlan) -> PendingStep:
        """`launch` without the probe.

        Rows whose input is PENDING_TOKEN read the token this worker sampled for that sequence in
        the previous step, on the device. The sampling history of penalised and seeded rows must be
        exact, so such a step first finishes the previous one (which records its tokens)."""
        batch = plan.ranks[self.dp_rank]
        if batch.reset:
            self.reset()
        elif plan.step != self.next_step:
            raise RuntimeError(
                f"worker dp={self.dp_rank} tp={self.tp_rank}: got plan step {plan.step}, expected {self.next_step}"
            )
        self.next_step = plan.step + 1
        self.mirrors.apply(batch)
        decision = plan.decision
        if batch.num_seqs == 0:
            if self.runner.tokens is not None:
                self.runner.tokens.record([])
            return PendingStep(plan.step, [], result=self._idle(plan, decision))
        inputs = self.mirrors.build(batch, self.runner.tokens)
        seq_ids = inputs.seq_ids[inputs.sample_seq_idx].tolist()
        mirrors = [self.mirrors.seqs[s] for s in seq_ids]
        if self._unfinished is not None and any(m.sampling_params.needs_history for m in mirrors):
            self.finish(self._unfinished)
        sampling = SamplingTensors.from_params(
            [m.sampling_params for m in mirrors],
            [m.prompt_token_ids for m in mirrors],
            [m.output_token_ids for m in mirrors],
            self.runner.arch.vocab_size,
            self.runner.device,
            may_change_logits=self.mirrors.num_changing_logits > 0,
        )
        sampling.constrained = bool(batch.grammar_rows.size)
        if sampling.constrained and self.tp_rank == 0:  # sampling waits for the grammar masks
            forward = self.runner.forward(inputs, decision, sampling)
            if self.runner.tokens is not None:
                self.runner.tokens.record(seq_ids)
            pending = PendingStep(plan.step, seq_ids, prompt_rows=inputs.prompt_rows)
            pending.forward, pending.grammar_rows = forward, batch.grammar_rows
            self._unfinished = pending
            return pending
        out = self.runner.execute(inputs, decision, sampling)
        if self.runner.tokens is not None:  # async scheduling: the next step's pending rows
            self.runner.tokens.record(seq_ids)
        if self.tp_rank != 0:
            return PendingStep(plan.step, seq_ids, result=None)
        pending = PendingStep(
            plan.step, seq_ids, self.runner.start_readback(out), prompt_rows=inputs.prompt_rows
        )
        self._unfinished = pending
        return pending

    @torch.inference_mode()
    def apply_grammar(self, masks: Optional[GrammarBitmask]) -> None:
        """Sample the step that waits for its grammar masks (`masks`; None: the driver discarded
        the step, which samples unconstrained so the TP ranks' collectives still match)."""
        pending = self._unfinished
        if pending is None or not pending.awaits_grammar:
            raise RuntimeError(
                f"worker dp={self.dp_rank} tp={self.tp_rank}: grammar masks of step "
                f"{masks.step if masks else '?'}, but no step waits for them"
            )
        if masks is not None and (
            masks.step != pending.step or masks.bitmask.shape[0] != pending.grammar_rows.shape[0]
        ):
            raise RuntimeError(
                f"worker dp={self.dp_rank} tp={self.tp_rank}: grammar masks of step {masks.step} "
                f"({masks.bitmask.shape[0]} rows), but step {pending.step} waits for "
                f"{pending.grammar_rows.shape[0]} rows"
            )
        grammar = None
        if masks is not None:
            grammar = self.runner.grammar_mask(pending.grammar_rows, masks.bitmask)
        out = self.runner.sample(pending.forward, grammar)
        pending.forward = None
        pending.readback = self.runner.start_readback(out)

    def reset(self) -> None:
        """The driver discarded the steps in flight: let the last one finish, then forget what it
        sampled (the plan's batch then clears the mirrors, `SeqMirrors.apply`)."""
        if self._unfinished is not None:
            self.finish(self._unfinished)
        if self.runner.tokens is not None:
            self.runner.tokens.record([])

    def finish(self, pending: PendingStep) -> Optional[StepResult]:
        """Wait for a launched step's tokens; TP rank 0's StepResult (None on other TP ranks)."""
        if pending.done:
            return pending.result
        if pending.awaits_grammar:  # its masks never came: the step was discarded
            self.apply_grammar(None)
        arrays = pending.readback.wait(  # the step's one host synchronisation
            self.config.parallel_config.heartbeat_timeout_s,
            self.progress,
            f"worker dp={self.dp_rank} tp={self.tp_rank}, step {pending.step}",
        )
        tokens = arrays.tokens
        drafts: list[int] = []
        if self.runner.spec is not None:  # speculative decoding: each request's tokens (drafts)
            tokens, drafts = self.runner.spec.unpack(tokens), self.runner.spec.unpack_drafts(tokens)
        self.mirrors.record_sampled(pending.seq_ids, tokens)
        pending.result = self._result(
            pending.step, pending.seq_ids, tokens, arrays.logprobs, drafts
        )
        pending.result.probe = pending.probe
        if arrays.prompt_logprobs is not None:
            rows = pending.prompt_rows
            pending.result.prompt_logprobs = PromptLogprobs(
                rows.seq_ids, rows.num_positions, *arrays.prompt_logprobs
            )
        pending.readback = None
        if self._unfinished is pending:
            self._unfinished = None
        return pending.result

    def _idle(self, plan: StepPlan, decision: ForwardDecision) -> Optional[StepResult]:
        """A DP rank with no work runs a dummy batch of the decision's shape, so collectives match."""
        if len(plan.ranks) > 1 and decision.running_tokens > 0:
            shape = decision.dummy_batch()
            vocab = self.runner.arch.vocab_size
            inputs = dummy_idle_inputs(
                shape.num_tokens, shape.max_seqlen_q, self.runner.shape.max_model_len, vocab
            )
            empty = SamplingTensors.from_params([], [], [], vocab, self.runner.device)
            self.runner.execute(inputs, decision, empty)
        return None if self.tp_rank != 0 else StepResult(step=plan.step, dp_rank=self.dp_rank)

    def _result(
        self, step: int, seq_ids: list[int], tokens: list, logprobs: Any, drafts: list[int]
    ) -> StepResult:
        """`tokens`: a token per request, or (speculative decoding) a list of tokens each;
        `drafts`: (MTP) each request's drafts for its next step, in turn."""
        spec = self.runner.spec
        res = StepResult(
            step=step,
            dp_rank=self.dp_rank,
            seq_ids=np.asarray(seq_ids, dtype=np.int64),
            sampled_token_ids=np.asarray([t[0] for t in tokens] if spec else tokens, np.int32),
        )
        if spec is not None:
            res.num_accepted = np.asarray([len(t) - 1 for t in tokens], dtype=np.int32)
            res.more_token_ids = np.asarray([x for t in tokens for x in t[1:]], dtype=np.int32)
            res.num_eager_draft_passes = spec.take_eager_passes()
            res.draft_token_ids = np.asarray(drafts, dtype=np.int32)
            res.draft_seconds = spec.take_draft_seconds()
        if logprobs is not None:
            res.logprobs, res.top_logprob_ids, res.top_logprobs = logprobs
        return res

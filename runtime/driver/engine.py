"""`LLMEngine`: the driver. Schedulers (one per DP rank), ForwardMode, the executor, outputs.

The step reads top to bottom: schedule -> decide -> submit plan -> collect results -> postprocess.
Structured outputs (runtime/driver/structured_outputs.py) come in at two points: once the step is
submitted (its grammar masks) and once its results are applied (the masks that waited for them).
With `scheduler_config.async_scheduling` the results collected are the previous step's: step N+1
is scheduled and submitted while step N runs, so the driver's and the workers' host work hides
behind the GPU (see runtime/driver/scheduler.py for what that changes). A step whose grammar masks
went out submits the next plan before it returns: the step those masks are for samples at once and
its successor's forward should not wait on the caller's handling of the outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from typing import Any, Optional, Union

from atomrt.distributed.messages import GrammarBitmask, StepPlan, StepResult
from atomrt.runtime.config import Config
from atomrt.runtime.decision import BatchShape, CapturedBuckets
from atomrt.runtime.driver.admission import Admission
from atomrt.runtime.driver.block_manager import BlockManager
from atomrt.runtime.driver.forward_mode import ForwardMode
from atomrt.runtime.driver.interrupts import InterruptGuard
from atomrt.runtime.driver.outputs import RequestOutput
from atomrt.runtime.driver.planner import RankPlanner, make_plan
from atomrt.runtime.driver.prompt_logprobs import apply_prompt_logprobs
from atomrt.runtime.driver.proposers import check_speculation
from atomrt.runtime.driver.request import (
    EngineRequest,
    StepOutputs,
    bind_add_request,
    fit_to_context,
    step_logprobs,
)
from atomrt.runtime.driver.scheduler import Scheduler, SchedulerOutput
from atomrt.runtime.driver.sequence import Sequence
from atomrt.runtime.driver.speculation import make_speculation, sampled_tokens
from atomrt.runtime.driver.stats import EngineStats, log_startup, log_summary
from atomrt.runtime.driver.structured_outputs import StructuredOutputs
from atomrt.runtime.driver.ubatch_policy import check_tbo
from atomrt.runtime.driver.validation import (
    RequestLimits,
    check_max_model_len,
    check_request,
    tokenize_bad_words,
)
from atomrt.runtime.executors.base import Executor, WorkerError
from atomrt.runtime.executors.factory import make_executor
from atomrt.runtime.inputs import PromptType, parse_prompt
from atomrt.runtime.sampling_params import RequestOutputKind, SamplingParams
from atomrt.workers.loading.loader import check_parallel_layout, read_arch

logger = logging.getLogger(__name__)

Prompt = PromptType


class EngineDeadError(RuntimeError):
    """The engine stopped (a worker failed); the message says why. Every later call raises it."""


class LLMEngine:
    """The driver. Single-threaded by contract: `add_request`, `abort`, `step`, `has_unfinished` and
    `shutdown` are called from one thread (a server puts a thread-safe front on it).

    A step is atomic from the caller's view: an exception or a KeyboardInterrupt anywhere in it
    discards the steps in flight (their sequences go back to the waiting queue and recompute, the
    workers are told to drop what they hold) and the engine takes the next call with correct
    results; only a failed worker makes the engine dead (`EngineDeadError`, naming the rank and
    the phase).
    """

    def __init__(self, config: Config, tokenizer=None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        arch = read_arch(config)  # errors a user can fix, found before anything is launched
        pc = config.parallel_config
        check_parallel_layout(arch, pc.tensor_parallel_size, pc.data_parallel_size)
        check_tbo(pc.enable_tbo, arch)
        check_max_model_len(config, arch)
        check_speculation(config, arch)
        if tokenizer is not None and tokenizer.vocab_size > arch.vocab_size:
            raise ValueError(  # its ids would index past the model's embeddings
                f"model_config.tokenizer: {tokenizer.vocab_size} tokens, more than the model's "
                f"vocabulary of {arch.vocab_size}"
            )
        stop_ids = set(arch.eos_token_ids) | set(
            tokenizer.eos_token_ids if tokenizer is not None else ()
        )
        self.grammars = StructuredOutputs(  # structured outputs: their backend loads on first use
            tokenizer, arch.vocab_size, sorted(stop_ids), config.structured_outputs_config
        )
        self.executor: Executor = make_executor(config)
        start = time.perf_counter()
        self.info = info = self.executor.start()
        log_startup(time.perf_counter() - start, info.startup_phases)
        self.max_model_len = info.max_model_len
        self.eos_token_ids = frozenset(info.eos_token_ids) | frozenset(
            tokenizer.eos_token_ids if tokenizer is not None else ()
        )
        self.limits = RequestLimits(info.vocab_size, config.model_config.max_logprobs)
        cc = config.cache_config
        self.speculation = make_speculation(config, info.req_keys)
        proposer = self.speculation.proposer if self.speculation is not None else None
        self.schedulers = [
            Scheduler(
                config.scheduler_config,
                cc,
                BlockManager(
                    info.num_kv_blocks,
                    cc.block_size,
                    cc.enable_prefix_caching,
                    recompute_last_hit=proposer is not None and proposer.recompute_last_hit,
                    window=BlockManager.window_for(arch, config),
                ),
                tokenizer=tokenizer,
                max_model_len=self.max_model_len,
                speculation=self.speculation,
                ready=self.grammars.ready,  # a grammar still compiling: its request waits
            )
            for _ in range(config.parallel_config.data_parallel_size)
        ]
        next_tokens = proposer is not None and proposer.needs_next_tokens
        self.planners = [RankPlanner(next_tokens=next_tokens) for _ in self.schedulers]
        sc = config.scheduler_config
        self.admission = Admission(sc.dp_prefill_align, sc.delay_factor, len(self.schedulers))
        captured = CapturedBuckets(
            info.req_keys,
            info.prefill_token_sizes,
            info.decode_token_sizes,
            info.tbo_req_keys,
            info.tbo_timings,
            info.token_req_keys,
        )
        self.forward_mode = ForwardMode(config, captured, config.max_q_len - 1)
        self.forward_mode.ubatch.log_verdicts()
        self.step_no = 0
        self.async_scheduling = config.scheduler_config.async_scheduling
        self._inflight: deque[tuple[int, list[SchedulerOutput]]] = (
            deque()
        )  # submitted, not collected
        # the next step was submitted at the end of the last `step()` (after its grammar masks)
        self._submitted_ahead = False
        self.dead: Optional[str] = None  # why the engine stopped (a worker failed)
        self._guard = InterruptGuard()
        self._ids = itertools.count()
        self._requests: dict[str, EngineRequest] = {}  # running or waiting, by request id
        self.stats = EngineStats()
        if self.speculation is not None:
            self.stats.spec_decode = self.speculation.stats
        self._aborted: list[
            RequestOutput
        ] = []  # final outputs of aborted requests, for the next step

    # ---------------------------------------------------------------- requests

    def add_request(self, *args: Any, **kwargs: Any) -> str:
        """Validate and queue a request; a ValueError (naming the field) leaves the engine as it was.

        vLLM's form: `add_request(request_id, prompt, params, arrival_time=None, lora_request=None,
        tokenization_kwargs=None, trace_headers=None, priority=0)`; `params.output_kind` says what
        `step()` returns: CUMULATIVE (vLLM's default) every sample's output so far every step it
        produced a token, DELTA only the new text, tokens and logprobs, FINAL_ONLY one output when
        the request finishes. The older form `add_request(prompt, params=None, request_id=None,
        stream=False)` returns the final output only, or with `stream=True` deltas.

        A prompt is a string, a list of token ids, `{"prompt": text}` or
        `{"prompt_token_ids": ids}` (atomrt.runtime.inputs)."""
        prompt, params, request_id, kind = bind_add_request(args, kwargs)
        self._check_alive()
        with self._guard.critical():
            return self._add(prompt, params, request_id, kind)

    def _add(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams],
        request_id: Optional[str],
        kind: Union[bool, RequestOutputKind],
    ) -> str:
        params = params if params is not None else SamplingParams()
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id: must be a string, got {request_id!r}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        token_ids, prompt_text = parse_prompt(prompt, self.tokenizer)
        if isinstance(params, SamplingParams):
            token_ids, params = fit_to_context(token_ids, params, self.max_model_len)
        check_request(token_ids, params, self.limits, self.max_model_len)
        bad_words = tokenize_bad_words(params.bad_words, self.tokenizer)
        grammar = self.grammars.prepare(params)  # structured outputs: compiling on a thread
        dp_rank = min(range(len(self.schedulers)), key=lambda r: self.schedulers[r].num_unfinished)
        scheduler = self.schedulers[dp_rank]
        seqs: list[Sequence] = []
        share = self.config.cache_config.enable_prefix_caching
        for i in range(params.n):  # n samples: sequences of their own, the prompt's blocks shared
            sample = params if params.n == 1 else params.for_sample(i)
            if i and sample.prompt_logprobs is not None:  # sample 0 scores the prompt
                sample = dataclasses.replace(sample, prompt_logprobs=None)
            seqs.append(
                Sequence(
                    request_id,
                    token_ids,
                    sample,
                    eos_token_ids=self.eos_token_ids,
                    index=i,
                    parent=seqs[0] if i and share else None,
                    bad_words_token_ids=bad_words,
                    prompt_logprobs=[None] if sample.prompt_logprobs is not None else None,
                )
            )
        scheduler.check_fits(seqs[0])  # raises on requests that can never fit, before any is queued
        if grammar is not None:
            self.grammars.admit(request_id, seqs, grammar)
        for seq in seqs:
            scheduler.add(seq)
        if kind is True or kind is False:
            stream, cumulative = kind, False
        else:
            stream = kind is RequestOutputKind.DELTA
            cumulative = kind is RequestOutputKind.CUMULATIVE
        self._requests[request_id] = EngineRequest(dp_rank, seqs, prompt_text, stream, cumulative)
        return request_id

    def abort(self, request_id: str) -> None:
        """End a request now: its KV blocks are freed, and the next `step()` returns its final
        output (finish_reason "abort"; for a streamed request, a delta). Unknown ids are ignored."""
        with self._guard.critical():
            self._abort(request_id)

    def _abort(self, request_id: str, error: Optional[str] = None) -> None:
        """End a request ("abort"); `error`: why, told to the client in its final output."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        aborted = self.schedulers[req.dp_rank].abort(request_id)
        self.grammars.abort(request_id)
        self.planners[req.dp_rank].forget([s.seq_id for s in aborted])
        if req.stream:  # the samples still running end here; finished ones were streamed whole
            final = req.delta_output(sorted(aborted, key=lambda s: s.index))
        else:
            final = req.final_output()
        if error is not None:
            final.error = error
        self._aborted.append(final)

    def has_unfinished_requests(self) -> bool:
        """vLLM's name of `has_unfinished`."""
        return self.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks (vLLM's call, e.g. before a benchmark run). Blocks that
        running requests hold stay theirs; True once done."""
        with self._guard.critical():
            for scheduler in self.schedulers:
                scheduler.block_manager.reset_prefix_cache()
        return True

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> LLMEngine:
        """An engine of `EngineArgs(model=..., **LLM's keywords)` (vLLM's constructor)."""
        config = engine_args.create_engine_config()
        return cls(config, engine_args.create_tokenizer(config))

    def has_unfinished(self) -> bool:
        """Whether `step()` has more to give: running or waiting requests, or aborted ones' final
        outputs (False once the engine is dead)."""
        if self.dead:
            return False
        return bool(self._aborted) or any(s.has_unfinished() for s in self.schedulers)

    # ---------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """schedule -> decide -> publish the plan -> collect results -> postprocess (atomic: see the
        class docstring). Under async scheduling the results collected are the previous step's."""
        self._check_alive()
        try:
            with self._guard.critical():
                submitted = self._submitted_ahead or self._schedule_and_submit()
                self._submitted_ahead = False
            if not self._inflight or (
                submitted and self.async_scheduling and len(self._inflight) < 2
            ):
                return self._take_aborted()
            step, outs = self._inflight[0]
            results = self.executor.collect(step, flush=not submitted)  # Ctrl-C may land here
            with self._guard.critical():
                self._inflight.popleft()
                aborted = self._take_aborted()
                return aborted + self._postprocess(outs, results)
        except BaseException as e:
            self._recover(e)
            raise

    def _masks_and_next_plan(self) -> Optional[BaseException]:
        """The grammars advanced on a step's tokens: structured outputs' masks of the step in
        flight go out. Those let that step sample at once, so under async scheduling the plan
        after it goes out now too, rather than after the outputs are built and the caller has
        handled them (the next `step()` collects without scheduling). An error is handed back,
        to be raised once the step's outputs are kept."""
        try:
            planned = None
            if self.grammars.pending and self.async_scheduling:  # masks go out below
                # the next plan is built first, while the GPU still runs the step the masks are
                # for; after them only its submit remains before that GPU can go on
                planned = self._schedule_and_plan()
            masks = self.grammars.took_results()
            self._send_masks(masks)
            if planned is not None:
                self._submitted_ahead = self._schedule_and_submit(planned)
        except BaseException as e:
            return e
        return None

    def _schedule_and_plan(self) -> tuple[list[SchedulerOutput], Optional[tuple[StepPlan, Any]]]:
        """Schedule a step and build its plan (None: it runs nothing), not yet submitted."""
        outs = self._schedule()
        return outs, None if all(o.is_empty for o in outs) else self._plan(outs)

    def _schedule_and_submit(
        self, planned: Optional[tuple[list[SchedulerOutput], Optional[tuple[StepPlan, Any]]]] = None
    ) -> bool:
        """Schedule a step (or take one `_schedule_and_plan` built) and submit it, if it runs
        anything; True when it did."""
        outs, built = self._schedule_and_plan() if planned is None else planned
        plan = None if built is None else self._submit(outs, *built)
        # structured outputs: the step's grammar masks, failed grammars; nothing to do: a short
        # wait for a compiling grammar, not a spin
        masks, failed = self.grammars.plan(plan, outs, idle=not self._inflight)
        self._send_masks(masks)
        for f in failed:
            logger.warning("request %r failed: %s", f.request_id, f.error)
            self._abort(f.request_id, f.error)
        return plan is not None

    def _schedule(self) -> list[SchedulerOutput]:
        if self.admission.active:  # dp_prefill_align, delay_factor: off by default
            admits = self.admission.admits(self.schedulers)
            outs = [s.schedule(admit) for s, admit in zip(self.schedulers, admits)]
            self.admission.observe(outs)
        else:
            outs = [s.schedule() for s in self.schedulers]
        return outs

    def _plan(self, outs: list[SchedulerOutput]) -> tuple[StepPlan, Any]:
        """The plan of a scheduled step (numbered as the next to go out), and its decision."""
        probe = self.executor.probing  # a probe reads its steps in Python: they run eagerly
        decision = self.forward_mode.decide([_shape(o) for o in outs], eager=bool(probe))
        batches = [planner.batch(o) for planner, o in zip(self.planners, outs)]
        plan = make_plan(self.step_no, decision, batches, pipelined=self.async_scheduling)
        plan.probe = probe
        return plan, decision

    def _submit(self, outs: list[SchedulerOutput], plan: StepPlan, decision: Any) -> StepPlan:
        self.executor.submit(plan)
        self.step_no += 1  # at once: the plan went out under this number
        padded = self.stats.count(decision)
        if padded and len(outs) > 1:
            logger.debug(
                "step %d: %d rows padded (real rows per DP rank %s, each runs %d)",
                plan.step,
                padded,
                decision.dp_num_tokens,
                decision.running_tokens,
            )
        for scheduler, out in zip(self.schedulers, outs):
            scheduler.advance(out)
        self._inflight.append((plan.step, outs))
        return plan

    def _postprocess(
        self, outs: list[SchedulerOutput], results: list[StepResult]
    ) -> list[RequestOutput]:
        """Apply each DP rank's results; returns at most one output per request (a streamed
        request's delta, or a request's final output), and exactly one `finished` output per
        request over its life."""
        num_tokens = num_seqs = 0
        sampled_by_rank = [sampled_tokens(res) for res in results]
        self.grammars.advance(outs, sampled_by_rank, speculative=self.speculation is not None)
        for dp_rank, (out, res) in enumerate(zip(outs, results)):
            sampled = sampled_by_rank[dp_rank]
            if self.speculation is not None:
                self.speculation.observe(out, res)
                num_tokens += sum(len(t) if isinstance(t, list) else 1 for t in sampled.values())
                num_seqs += len(sampled)
            if res.prompt_logprobs is not None:
                starts = {r.seq.seq_id: (r.seq, r.num_computed_tokens) for r in out.scheduled}
                apply_prompt_logprobs(res.prompt_logprobs, starts, self.tokenizer)
            finished = self.schedulers[dp_rank].postprocess(out, sampled, step_logprobs(res, out))
            self.planners[dp_rank].forget([s.seq_id for s in finished])
        error = self._masks_and_next_plan()  # before the outputs: the GPU may wait for these
        built = StepOutputs(self._requests)
        for out in outs:
            for row in out.scheduled:
                if row.token_applied:
                    built.add(row.seq)
        outputs = built.finish()
        if self.speculation is not None:
            self.speculation.step_done(num_tokens, num_seqs)
        if error is not None:  # the outputs come with the next step's
            self._aborted = outputs + self._aborted
            raise error
        return outputs

    def _send_masks(self, masks: list[GrammarBitmask]) -> None:
        if masks:
            self.executor.send_grammar(masks)

    def _take_aborted(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        return outputs

    # ---------------------------------------------------------------- failures

    def _recover(self, error: BaseException) -> None:
        """A step raised: discard what is in flight, or give up when a worker failed."""
        if self.dead:
            return
        if isinstance(error, WorkerError):
            self._fail(str(error))
            return
        try:
            num_discarded = len(self._inflight)
            self._inflight.clear()
            self._submitted_ahead = False
            self.executor.discard_in_flight()
            self.grammars.forget_pending()
            for scheduler, planner in zip(self.schedulers, self.planners):
                scheduler.requeue_running()
                planner.reset()
        except BaseException as e:  # recovery itself failed: the engine cannot go on
            self._fail(f"recovering from {type(error).__name__} in step {self.step_no} failed: {e}")
            return
        logger.warning(
            "step %d raised %s: %d step(s) in flight discarded, their sequences will recompute",
            self.step_no,
            type(error).__name__,
            num_discarded,
        )

    def _fail(self, reason: str) -> None:
        """A worker failed: every request ends (aborted); later calls raise EngineDeadError."""
        self.dead = f"engine stopped: {reason}"
        self._inflight.clear()
        self._submitted_ahead = False
        logger.error("%s; aborting %d requests", self.dead, len(self._requests))
        for request_id in list(self._requests):
            self.abort(request_id)
        self._aborted.clear()  # nobody can step a dead engine to receive them
        self.executor.shutdown()

    def _check_alive(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)

    def shutdown(self) -> None:
        log_summary(self.stats, len(self.schedulers), self.admission)
        self.executor.shutdown()
        self.grammars.shutdown()


def _shape(out: SchedulerOutput) -> BatchShape:
    if out.is_empty:
        return BatchShape.idle()
    return BatchShape(out.num_seqs, out.num_tokens, out.max_seqlen_q, out.is_prefill)

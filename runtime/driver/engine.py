"""`LLMEngine`: the driver. Schedulers (one per DP rank), ForwardMode, the executor, outputs.

The step reads top to bottom: schedule -> decide -> submit plan -> collect results -> postprocess.
With `scheduler_config.async_scheduling` the results collected are the previous step's: step N+1
is scheduled and submitted while step N runs, so the driver's and the workers' host work hides
behind the GPU (see runtime/driver/scheduler.py for what that changes).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import Optional, Union

from atomrt.runtime.driver.block_manager import BlockManager
from atomrt.runtime.config import Config
from atomrt.runtime.executors.base import Executor, WorkerError
from atomrt.runtime.executors.factory import make_executor
from atomrt.runtime.decision import BatchShape, CapturedBuckets
from atomrt.runtime.driver.forward_mode import ForwardMode
from atomrt.runtime.driver.outputs import RequestOutput, make_request_output
from atomrt.runtime.driver.planner import RankPlanner, make_plan
from atomrt.runtime.sampling_params import SamplingParams
from atomrt.runtime.driver.scheduler import Scheduler, SchedulerOutput
from atomrt.runtime.driver.sequence import Sequence
from atomrt.distributed.messages import StepResult

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]


class LLMEngine:
    def __init__(self, config: Config, tokenizer=None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.executor: Executor = make_executor(config)
        info = self.executor.start()
        self.info = info
        self.max_model_len = info.max_model_len
        self.eos_token_ids = frozenset(info.eos_token_ids) | frozenset(
            tokenizer.eos_token_ids if tokenizer is not None else ()
        )
        dp = config.parallel_config.data_parallel_size
        self.schedulers = [
            Scheduler(
                config.scheduler_config,
                config.cache_config,
                BlockManager(info.num_kv_blocks, config.cache_config.block_size, config.cache_config.enable_prefix_caching),
                tokenizer=tokenizer,
                max_model_len=self.max_model_len,
            )
            for _ in range(dp)
        ]
        self.planners = [RankPlanner() for _ in range(dp)]
        captured = CapturedBuckets(info.req_keys, info.prefill_token_sizes, info.decode_token_sizes)
        self.forward_mode = ForwardMode(config, captured)
        self.step_no = 0
        self.async_scheduling = config.scheduler_config.async_scheduling
        self._inflight: deque[tuple[int, list[SchedulerOutput]]] = deque()  # submitted, not collected
        self.dead: Optional[str] = None  # why the engine stopped (a worker failed)
        self._ids = itertools.count()
        self._prompts: dict[str, Optional[str]] = {}
        self._streamed: set[str] = set()  # requests that get a delta output every step
        self._seqs: dict[str, tuple[int, Sequence]] = {}  # request_id -> (dp rank, sequence)

    # ---------------------------------------------------------------- requests

    def add_request(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        stream: bool = False,
    ) -> str:
        """Validate and queue a request; a ValueError leaves the engine as it was.

        `step()` returns the request's RequestOutput when it finishes; with `stream=True`, also a
        delta output (new text and tokens only) every step it produced a token."""
        if self.dead:
            raise RuntimeError(self.dead)
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already running")
        token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: send at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, which must "
                "leave room for at least one generated token"
            )
        bad = [t for t in token_ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.info.vocab_size}): {bad[:5]}")
        seq = Sequence(request_id, token_ids, params, eos_token_ids=self.eos_token_ids)
        dp_rank = min(range(len(self.schedulers)), key=lambda r: self.schedulers[r].num_unfinished)
        self.schedulers[dp_rank].add(seq)  # raises on requests that can never fit
        self._seqs[request_id] = (dp_rank, seq)
        self._prompts[request_id] = prompt if isinstance(prompt, str) else None
        if stream:
            self._streamed.add(request_id)
        return request_id

    def abort(self, request_id: str) -> None:
        entry = self._seqs.pop(request_id, None)
        if entry is None:
            return
        dp_rank, _ = entry
        self._streamed.discard(request_id)
        aborted = self.schedulers[dp_rank].abort(request_id)
        self.planners[dp_rank].forget([s.seq_id for s in aborted])
        self._prompts.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    # ---------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        outs = [s.schedule() for s in self.schedulers]
        if all(o.is_empty for o in outs):
            return self._collect(flush=True) if self._inflight else []
        decision = self.forward_mode.decide([_shape(o) for o in outs])
        batches = [planner.batch(o) for planner, o in zip(self.planners, outs)]
        plan = make_plan(self.step_no, decision, batches, pipelined=self.async_scheduling)
        try:
            self.executor.submit(plan)
        except WorkerError as e:
            self._fail(e)
            raise
        for scheduler, out in zip(self.schedulers, outs):
            scheduler.advance(out)
        self._inflight.append((plan.step, outs))
        self.step_no += 1
        if self.async_scheduling and len(self._inflight) < 2:
            return []  # the first step of a run: its results come with the next step
        return self._collect(flush=False)

    def _collect(self, flush: bool) -> list[RequestOutput]:
        """Collect and apply the oldest submitted step's results."""
        step, outs = self._inflight.popleft()
        try:
            results = self.executor.collect(step, flush)
        except WorkerError as e:
            self._fail(e)
            raise
        return self._postprocess(outs, results)

    def _postprocess(self, outs: list[SchedulerOutput], results: list[StepResult]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for dp_rank, (out, res) in enumerate(zip(outs, results)):
            if res.error:
                raise RuntimeError(f"DP rank {dp_rank} failed step {res.step}: {res.error}")
            sampled = dict(zip(res.seq_ids.tolist(), res.sampled_token_ids.tolist()))
            finished = self.schedulers[dp_rank].postprocess(out, sampled, _logprobs(res, out))
            self.planners[dp_rank].forget([s.seq_id for s in finished])
            for row in out.scheduled:
                if not row.token_applied:
                    continue
                seq = row.seq
                streamed = seq.request_id in self._streamed
                if streamed or seq.is_finished:
                    outputs.append(make_request_output(seq, self._prompts.get(seq.request_id), delta=streamed))
            for seq in finished:
                self._seqs.pop(seq.request_id, None)
                self._prompts.pop(seq.request_id, None)
                self._streamed.discard(seq.request_id)
        return outputs

    def _fail(self, error: WorkerError) -> None:
        """A worker died: every in-flight request ends (aborted); later calls raise at once."""
        self.dead = f"engine stopped: {error}"
        self._inflight.clear()
        logger.error("%s; aborting %d requests", self.dead, len(self._seqs))
        for request_id in list(self._seqs):
            self.abort(request_id)
        self.executor.shutdown()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: send prompt token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids")
        return list(prompt)


def _shape(out: SchedulerOutput) -> BatchShape:
    if out.is_empty:
        return BatchShape.idle()
    return BatchShape(out.num_seqs, out.num_tokens, out.max_seqlen_q, out.is_prefill)


def _logprobs(res: StepResult, out: SchedulerOutput) -> Optional[dict[int, dict[int, float]]]:
    """seq_id -> {token id: logprob}: the sampled token plus the request's own top-`logprobs`
    (the worker sends the batch's largest k for every row)."""
    if res.logprobs is None:
        return None
    wanted = {r.seq.seq_id: r.seq.sampling_params.logprobs for r in out.scheduled}
    rows: dict[int, dict[int, float]] = {}
    for i, (seq_id, tok) in enumerate(zip(res.seq_ids.tolist(), res.sampled_token_ids.tolist())):
        k = wanted.get(seq_id)
        if k is None:
            continue
        top_ids, top_lps = res.top_logprob_ids[i, :k].tolist(), res.top_logprobs[i, :k].tolist()
        row = {int(t): float(lp) for t, lp in zip(top_ids, top_lps)}
        row[int(tok)] = float(res.logprobs[i])
        rows[seq_id] = row
    return rows

"""`GraphRunner`: one model runner's CUDA graphs, captured once and replayed per step.

Capture follows the guide's flow. Sizes descending (largest first, so smaller recordings reuse the
shared pool's blocks); per size a dummy decode batch of `bs` sequences x `max_q_len` rows, the
forward context with `running_tokens` the same on every rank (capture is symmetric), a warm-up
run, the recording, `torch.cuda.synchronize()`. Every size's warm-up runs once before, under
`compile_ahead` (workers/kernels/launch.py), its Triton launches turned into compiles on threads, so
that the kernels capture needs compile side by side: in the eager warm-up's pass (`warm_up_ahead`:
one pool for both phases), or, where that pass did not run them, before the first size. FULL (and
FULL_DECODE_ONLY) record `ReqGraph`s, the LM head and the greedy argmax included (a recording's
outputs are every row's logits and their argmax); TR_HYBRID (and FULL_AND_TR_HYBRID, recorded
exactly as TR_HYBRID) record the model's token graphs, asked once for decode and once for prefill
(the same recording serves both), or for decode alone where the model says so
(`token_graph_phases`, DeepSeek-V4). GC is off during capture; a progress bar shows on rank 0.
Every recording drains pending NCCL work first (graphs/region_graph.py).

Two-batch overlap (`enable_tbo` all / auto) under FULL: a bucket that splits
(`decode_bucket_splits`) is also recorded as a TBO graph, its two microbatches cut at
`decode_ubatch_request_ranges(bs)` on every rank, both streams forked and joined inside the one
capture (workers/runner/ubatch.py); under `all` its plain graph, which no step would replay, is not.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch
from tqdm import tqdm

from atomrt.graphs.buckets import capture_order, request_bucket
from atomrt.graphs.markers import captured_token_sizes, token_graph_of, token_graph_units
from atomrt.graphs.region_graph import RegionRequest, ReqGraph, TokenGraph, graph_pool_bytes
from atomrt.graphs.ubatch import decode_bucket_splits, decode_ubatch_request_ranges, split_decision
from atomrt.runtime.config import Config, CUDAGraphMode
from atomrt.runtime.decision import CapturedBuckets, ForwardDecision, ForwardKind
from atomrt.runtime.forward_context import (
    AttentionMetaData,
    Context,
    DPMetadata,
    set_forward_context,
)
from atomrt.workers.kernels.launch import compile_ahead
from atomrt.workers.runner.input_batch import dummy_decode_inputs

if TYPE_CHECKING:
    from atomrt.workers.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def recorded_phases(model: torch.nn.Module) -> tuple[bool, ...]:
    """The `is_prefill` of each token-graph record pass of a capture size: decode, then prefill;
    decode alone for a model that says so (`token_graph_phases = ("decode",)`, DeepSeek-V4), whose
    prefill steps then run eagerly and which reports no prefill bucket."""
    phases = getattr(model, "token_graph_phases", ("decode", "prefill"))
    return tuple(p == "prefill" for p in ("decode", "prefill") if p in phases)


class StagedBucket(NamedTuple):
    """A capture size's staged dummy batch: what its warm-up and its recordings run (a drafter
    records its first pass on it too)."""

    bs: int
    rows: int
    decision: ForwardDecision
    md: AttentionMetaData
    ctx: Context
    scope: dict
    ids: torch.Tensor
    pos: torch.Tensor


class GraphRunner:
    """What capture recorded and how a step replays it. `enabled` is false on CPU, under
    `enforce_eager`, in mode NONE and without capture sizes: then nothing is recorded."""

    def __init__(self, config: Config, enabled: bool) -> None:
        mode = config.cudagraph_mode
        self.config = config
        self.enabled = enabled and mode != CUDAGraphMode.NONE and bool(config.capture_sizes)
        self.records_token_graphs = mode.uses_tr_hybrid()
        self.records_request_graphs = mode.records_request_graphs()
        self.req_graph = ReqGraph()
        self.tbo = config.parallel_config.enable_tbo
        self.records_tbo = self.records_request_graphs and self.tbo in ("all", "auto")
        self.tbo_graph = ReqGraph()  # the TBO recordings, by request bucket
        # TR_HYBRID: the recording unit's TokenGraph and the request buckets whose decode step it
        # runs whole, as one launch (TokenGraph.launch_step)
        self.unit_graph: Optional[TokenGraph] = None
        self.step_keys: set[tuple[int, int]] = set()
        self.capture_sizes: list[int] = []  # ascending, once captured
        # every capture size's warm-up ran in the eager warm-up's compile-ahead pass
        self.warmed_ahead = False
        self.pool_bytes = 0  # the shared pool after capture
        self.largest_pool_bytes = (
            0  # the pool after the largest bucket: the whole ladder should need about this
        )

    @property
    def packed_bucket(self) -> int:
        """The largest request bucket (steps replaying a whole-step graph are staged packed for
        them: request graphs, TR_HYBRID's joined decode steps), 0 without any."""
        if not (self.enabled and self.records_logits):
            return 0
        return max(self.config.capture_sizes)

    @property
    def records_logits(self) -> bool:
        """Whether recordings hold an LM head (every row's logits): request graphs, and TR_HYBRID's
        whole decode steps."""
        return self.records_request_graphs or self.records_token_graphs

    def capture(self, runner: ModelRunner) -> float:
        """Record every capture size's graphs; returns the seconds it took."""
        if not self.enabled:
            return 0.0
        sizes = capture_order(self.config.capture_sizes)
        assert sizes[0] <= runner.shape.max_num_seqs, f"capture size {sizes[0]} > max_num_seqs"
        self.req_graph, self.tbo_graph = ReqGraph(), ReqGraph()
        self.step_keys = set()
        self._find_unit_graph(runner)
        start = time.perf_counter()
        gc.collect()
        gc.disable()
        try:
            if not self.warmed_ahead:  # the eager warm-up's pass ran none of capture's warm-ups
                self._compile_ahead(runner, sizes)
            for bs in tqdm(sizes, desc="Capturing CUDA graphs", disable=runner.rank != 0):
                # a decode row per request, and its drafts' rows with speculative decoding
                for q in self.config.capture_q_lens:
                    self._capture_one(runner, bs, max_q_len=q)
                torch.cuda.synchronize()
                self.largest_pool_bytes = self.largest_pool_bytes or (graph_pool_bytes() or 0)
            if runner.spec is not None:  # the drafter's DraftGraphs, in the same pool
                runner.spec.capture(runner, sizes)
        finally:
            gc.enable()
        elapsed = time.perf_counter() - start
        self.pool_bytes = graph_pool_bytes() or 0
        self.capture_sizes = sorted(sizes)
        logger.info(
            "captured %d %s graphs (%d TBO) in %.2f s; graph pool %.1f MiB (%.1f MiB after the "
            "largest bucket)",
            len(sizes),
            "token" if self.records_token_graphs else "request",
            len(self.tbo_graph),
            elapsed,
            self.pool_bytes / 2**20,
            self.largest_pool_bytes / 2**20,
        )
        return elapsed

    def _find_unit_graph(self, runner: ModelRunner) -> None:
        """TR_HYBRID: the recording unit's TokenGraph, when the model has one unit (a whole decode
        step joins around it; a model of several runs its units' joins)."""
        units = token_graph_units(runner.model) if self.records_token_graphs else []
        self.unit_graph = token_graph_of(units[0]) if len(units) == 1 else None

    def warm_up_ahead(self, runner: ModelRunner) -> int:
        """Inside the caller's `compile_ahead` (the eager warm-up's, kernel_warmup.py): every
        capture size's warm-up once, so that the kernels capture launches compile in that one pool
        beside the eager batches' (no second pool waits for its slowest compile), and capture runs
        no pass of its own. Returns how many warm-ups ran (none when nothing is recorded)."""
        if not self.enabled:
            return 0
        self._find_unit_graph(runner)
        ran = self._warm_up_every_bucket(runner, capture_order(self.config.capture_sizes))
        self.warmed_ahead = True
        return ran

    def _warm_up_every_bucket(self, runner: ModelRunner, sizes: list[int]) -> int:
        """Each bucket's warm-up once (sizes x capture_q_lens); how many ran."""
        for bs in sizes:
            for q in self.config.capture_q_lens:
                self._warm_up(runner, self.stage_bucket(runner, bs, q))
        return len(sizes) * len(self.config.capture_q_lens)

    def _compile_ahead(self, runner: ModelRunner, sizes: list[int]) -> None:
        """Every bucket's warm-up once under `compile_ahead`: the Triton kernels that capture
        launches for the first time (a GEMM tile or an attention plan per batch size) compile and
        load side by side on threads, not one after another inside capture. With Triton's cache
        warm it costs one forward per bucket, its kernel launches skipped."""
        start = time.perf_counter()
        with compile_ahead() as ahead:
            if not ahead:
                return
            self._warm_up_every_bucket(runner, sizes)
        torch.cuda.synchronize()
        logger.info(
            "rank %d: capture's kernels compiled ahead in %.2f s",
            runner.rank,
            time.perf_counter() - start,
        )

    def stage_bucket(self, runner: ModelRunner, bs: int, max_q_len: int) -> StagedBucket:
        """Stage the dummy decode batch of a capture size: `bs` sequences x `max_q_len` rows."""
        rows = bs * max_q_len
        kind = ForwardKind.TOKEN_GRAPH if self.records_token_graphs else ForwardKind.REQ_GRAPH
        decision = ForwardDecision(
            kind=kind,
            running_bs=bs,
            running_tokens=rows,
            is_prefill=False,
            draft_num=max_q_len - 1,
            req_key=request_bucket(bs, max_q_len),
        )
        inputs = dummy_decode_inputs(bs, max_q_len, runner.shape.block_size)
        md, ctx = runner.buffers.prepare(inputs, decision)
        fv = runner.buffers.forward_vars
        scope = dict(
            no_compile_layers=runner.attn_layers,
            kv_cache_data=runner.kv_cache,
            # symmetric: every DP rank records this bucket, running_tokens rows each
            dp_metadata=DPMetadata.for_capture(runner.dp.dp_size, rows)
            if runner.dp.dp_size > 1
            else None,
        )
        return StagedBucket(
            bs, rows, decision, md, ctx, scope, fv["input_ids"][:rows], fv["positions"][:rows]
        )

    def _warm_up(self, runner: ModelRunner, b: StagedBucket) -> None:
        """The bucket's forward once, outside any recording."""
        with set_forward_context(b.md, self.config, b.ctx, **b.scope):
            runner.buffers.unpack(b.bs, b.rows)
            hidden = runner.model(b.ids, b.pos)
            # whatever a recording ends with runs once first: kernels' scratch buffers (the
            # argmax's split workspace) cannot be allocated inside a capture
            if self.records_request_graphs or self.unit_graph is not None:
                runner.greedy_tokens(runner.model.compute_logits(hidden))

    def _capture_one(self, runner: ModelRunner, bs: int, max_q_len: int) -> None:
        b = self.stage_bucket(runner, bs, max_q_len)
        self._warm_up(runner, b)
        _, rows, decision, md, ctx, scope, ids, pos = b
        fv = runner.buffers.forward_vars
        splits = self.records_tbo and decode_bucket_splits(bs)
        if self.records_request_graphs and not (splits and self.tbo == "all"):

            def forward() -> tuple[torch.Tensor, torch.Tensor]:
                """The request graph: unpack the staged step, run, keep the hidden states, and
                return every row's logits (a decode step samples every row) and their argmax."""
                runner.buffers.unpack(bs, rows)
                return self._outputs(runner, runner.model(ids, pos), rows)

            with set_forward_context(md, self.config, ctx, **scope):
                self.req_graph.record(decision.req_key, forward)
        if splits:
            split = split_decision(
                replace(decision, draft_num=max_q_len - 1),
                len(decode_ubatch_request_ranges(bs).first),
            )

            def tbo_forward() -> tuple[torch.Tensor, torch.Tensor]:
                """The TBO graph: as `forward`, the two microbatches overlapped."""
                runner.buffers.unpack(bs, rows)
                hidden = runner.ubatch.forward_bucket(runner.model, ids, fv, split)
                return self._outputs(runner, hidden, rows)

            with set_forward_context(md, self.config, ctx, **scope):
                tbo_forward()  # warm-up
                self.tbo_graph.record(decision.req_key, tbo_forward)
        if self.records_token_graphs:
            # The decode pass records the eager regions' launches for this request bucket too
            # (graph-safe `md`, as a request graph would), and with one unit the step's unpack
            # ahead of it and the request graph's outputs behind it: a decode step of the bucket
            # is then one launch, as under FULL.
            request = RegionRequest(decision.req_key, md)
            if self.unit_graph is not None:
                request.before = lambda: runner.buffers.unpack(bs, rows)
                request.after = lambda hidden: self._outputs(runner, hidden, rows)
            for is_prefill in recorded_phases(runner.model):
                phase_ctx = replace(ctx, is_prefill=is_prefill)
                with set_forward_context(
                    replace(md, graph_safe=False),
                    self.config,
                    phase_ctx,
                    tr_graph="record",
                    tr_request=None if phase_ctx.is_prefill else request,
                    **scope,
                ):
                    hidden = runner.model(ids, pos)
                if not phase_ctx.is_prefill:
                    self._check_step(decision.req_key, rows, (ids, pos), hidden)

    def _check_step(
        self, key: tuple[int, int], rows: int, inputs: tuple, hidden: torch.Tensor
    ) -> None:
        """Count `key` as a whole-step bucket only if the unit's recording is the model's forward:
        fed the static buffers themselves, its output what the model returned."""
        graph = self.unit_graph
        if graph is None or key not in graph.step_keys():
            return
        recorded_inputs, output = graph.recording_io(rows, "decode")
        fed = recorded_inputs == tuple((t.data_ptr(), tuple(t.shape)) for t in inputs)
        same = (
            isinstance(output, torch.Tensor)
            and output.data_ptr() == hidden.data_ptr()
            and output.shape == hidden.shape
        )
        if fed and same:
            self.step_keys.add(key)
        else:
            logger.warning(
                "request bucket %s: the recording unit is not the whole forward (inputs %s, "
                "output %s); its decode steps replay the token graph, then the LM head",
                key,
                "static" if fed else "other",
                "returned" if same else "transformed",
            )

    @staticmethod
    def _outputs(
        runner: ModelRunner, hidden: torch.Tensor, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a request graph ends with: keep the hidden states, every row's logits, argmax."""
        runner.buffers.forward_vars["outputs"][:rows].copy_(hidden)
        logits = runner.model.compute_logits(hidden)
        return logits, runner.greedy_tokens(logits)

    def replay(self, decision: ForwardDecision) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the request graph of the decision's bucket (its TBO graph for a split step; a
        TR_HYBRID decode step's whole-step join): (every row's logits, their argmax), valid until
        the next replay."""
        if decision.kind is ForwardKind.TOKEN_GRAPH:
            assert self.unit_graph is not None and decision.req_key in self.step_keys
            return self.unit_graph.launch_step(decision.running_tokens, "decode", decision.req_key)
        graph = self.req_graph if decision.ubatch_rows is None else self.tbo_graph
        return graph.replay(decision.req_key)

    def captured_buckets(self, model: torch.nn.Module) -> CapturedBuckets:
        """What capture recorded, for the driver's ForwardMode."""
        if not self.enabled:
            return CapturedBuckets()
        return CapturedBuckets(
            req_keys=tuple(self.req_graph.keys()),
            prefill_token_sizes=tuple(captured_token_sizes(model, "prefill")),
            decode_token_sizes=tuple(captured_token_sizes(model, "decode")),
            tbo_req_keys=tuple(self.tbo_graph.keys()),
            token_req_keys=tuple(sorted(self.step_keys)),
        )

# Hot path (worker, split steps only): two-batch overlap. What may live here: cutting a split
# step into its two microbatches (host arrays), their attention metadata, and the interleaved run.
"""Two-batch overlap (TBO) on a worker: a split step's two microbatches and their interleaved run.

Layout. A split step runs `R0 + R1` rows (`ForwardDecision.ubatch_rows`, the same on every DP rank):
microbatch 0 is rows `[0, R0)` of the static buffers, microbatch 1 rows `[R0, R0 + R1)`.
- A TBO graph (FULL decode) is staged as its bucket: the cut at `ubatch_split_bs` requests falls at
  row `R0` whatever the rank scheduled into the bucket. The microbatches' metadata are views of the
  step's buffers; microbatch 1's `cu_seqlens_q` is rebased by one op recorded in the graph
  (`UbatchRunner.forward_bucket`).
- An eager split cuts what the rank scheduled at its own midpoint (graphs/ubatch.py `rank_cut`);
  `split_step` moves microbatch 1's rows to `R0`, padding between, and gives each microbatch its
  own sequences. A request straddling the cut is in both: its first rows (context shortened to end
  at the cut) in microbatch 0, the rest in microbatch 1, whose attention reads the first part's KV,
  written by microbatch 0 in the same layer before. The step's whole-batch metadata is not read.

Overlap. The model's `forward_ubatch` is a generator that pauses before and after each exchange of
rows with the other DP ranks (a MoE layer's all_gather and reduce_scatter). `run_ubatches` drives
the two: microbatch 0 one stage ahead, then alternating, so one's exchange overlaps the other's
attention and experts; every rank runs the same stages in the same order, so the collectives match.
Each stage runs under its microbatch's forward context. On CUDA microbatch 1 runs on a side stream
forked from the current one and joined at the end (inside a TBO graph's capture alike); microbatch
0 records an event at each pause, before control passes, and microbatch 1 waits on it before the
same stage (which orders the straddling request's KV). On CPU the stages run in the same order on
one stream: the same code path, tested in CI.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np
import torch

from atomrt.graphs.ubatch import rank_cut
from atomrt.runtime.decision import ForwardDecision
from atomrt.runtime.forward_context import (
    AttentionMetaData,
    Context,
    DPMetadata,
    ForwardContext,
    get_forward_context,
    use_forward_context,
)
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.step_buffers import write_padded


@dataclass(frozen=True)
class MicrobatchSeqs:
    """One microbatch's sequences as host arrays; rows count from the microbatch's first."""

    cu_seqlens_q: np.ndarray  # int32 [s + 1]
    context_lens: np.ndarray  # int32 [s]: KV length after this microbatch's rows
    block_tables: np.ndarray  # int32 [s, W]

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])


@dataclass(frozen=True)
class SplitStep:
    """One rank's eager split step: the rows to stage and each microbatch's sequences."""

    inputs: StepInputs  # rows reordered: microbatch 0's, padding up to R0, microbatch 1's
    rows: tuple[int, int]  # (R0, R1)
    seqs: tuple[MicrobatchSeqs, MicrobatchSeqs]
    cut: int  # the rank's rows before the cut (microbatch 0's real rows)


def split_step(inputs: StepInputs, decision: ForwardDecision) -> SplitStep:
    """Cut one rank's step at its own midpoint (see the module docstring)."""
    rows = decision.ubatch_rows
    assert rows is not None, "not a split step"
    cu = inputs.cu_seqlens_q.astype(np.int64)
    n = inputs.num_tokens
    cut = rank_cut(inputs.num_seqs, n, cu, decision)
    starts, ends = cu[:-1], cu[1:]
    k0 = int(np.searchsorted(starts, cut, side="left"))  # sequences starting before the cut
    j1 = int(np.searchsorted(ends, cut, side="right"))  # the first sequence ending after it
    ctx = inputs.context_lens.astype(np.int64)
    first = MicrobatchSeqs(
        np.minimum(cu[: k0 + 1], cut).astype(np.int32),
        (ctx[:k0] - np.maximum(ends[:k0] - cut, 0)).astype(np.int32),  # a straddler ends at the cut
        inputs.block_tables[:k0],
    )
    second = MicrobatchSeqs(
        np.maximum(cu[j1:] - cut, 0).astype(np.int32),
        ctx[j1:].astype(np.int32),
        inputs.block_tables[j1:],
    )
    pad = rows[0] - cut
    moved = dict(
        input_ids=_insert(inputs.input_ids, cut, pad, 0),
        positions=_insert(inputs.positions, cut, pad, 0),
        slot_mapping=_insert(inputs.slot_mapping, cut, pad, -1),
        sample_rows=inputs.sample_rows + pad * (inputs.sample_rows >= cut),
    )
    if inputs.prompt_rows is not None:  # prompt logprobs' rows move like the sampled ones
        pr = inputs.prompt_rows
        moved["prompt_rows"] = replace(pr, rows=pr.rows + pad * (pr.rows >= cut))
    if inputs.token_src is not None:  # a row's own staged id moves with it; padding reads its own
        src, own = inputs.token_src, np.arange(n, dtype=np.int64)
        moved["token_src"] = np.concatenate(
            [src[:cut], np.arange(cut, cut + pad), np.where(src == own, own + pad, src)[cut:]]
        )
    return SplitStep(replace(inputs, **moved), rows, (first, second), cut)


def _insert(a: np.ndarray, at: int, count: int, value: int) -> np.ndarray:
    if count == 0:
        return a
    return np.concatenate([a[:at], np.full(count, value, dtype=a.dtype), a[at:]])


class UbatchBuffers:
    """Static device buffers of each microbatch's sequence metadata (eager splits), filled through
    pinned staging on CUDA like the step's own (step_buffers.py). `stage` must run before the step's
    `StepBuffers.staged()`, whose event then also covers these copies."""

    def __init__(self, max_num_seqs: int, max_blocks: int, device: torch.device) -> None:
        s = max_num_seqs
        self.max_num_seqs = s
        self.device = [
            {
                "cu_seqlens_q": torch.zeros(s + 1, dtype=torch.int32, device=device),
                "context_lens": torch.zeros(s, dtype=torch.int32, device=device),
                "block_tables": torch.full((s, max_blocks), -1, dtype=torch.int32, device=device),
            }
            for _ in range(2)
        ]
        pin = device.type == "cuda"
        self.host = [
            {k: v.cpu().pin_memory() if pin else v for k, v in bufs.items()} for bufs in self.device
        ]

    def stage(self, i: int, seqs: MicrobatchSeqs) -> dict[str, torch.Tensor]:
        """Copy microbatch `i`'s sequences in; returns views of the device buffers."""
        s = seqs.num_seqs
        if s > self.max_num_seqs:
            raise RuntimeError(
                f"microbatch {i} holds {s} sequences, more than max_num_seqs={self.max_num_seqs}"
            )
        out = {}
        for name, values, pad in (
            ("cu_seqlens_q", seqs.cu_seqlens_q, int(seqs.cu_seqlens_q[-1])),
            ("context_lens", seqs.context_lens, 0),
            ("block_tables", seqs.block_tables, -1),
        ):
            length = s + 1 if name == "cu_seqlens_q" else s
            host, device = self.host[i][name], self.device[i][name]
            write_padded(host.numpy(), values, length, pad)
            if host is not device:
                device[:length].copy_(host[:length], non_blocking=True)
            out[name] = device[:length]
        return out


class UbatchStreams:
    """CUDA: microbatch 1's side stream and microbatch 0's events, one per stage (see the module
    docstring). Events are reused step after step; a capture gets fresh ones."""

    def __init__(self, device: torch.device) -> None:
        self.side = torch.cuda.Stream(device)
        self.main: Optional[torch.cuda.Stream] = None  # the stream current at `session`
        self._events: list[torch.cuda.Event] = []
        self._active: list[torch.cuda.Event] = []

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Fork the side stream from the current one; join it back at the end."""
        self.main = main = torch.cuda.current_stream()
        self._active = [] if torch.cuda.is_current_stream_capturing() else self._events
        self.side.wait_stream(main)
        try:
            yield
        finally:
            main.wait_stream(self.side)

    @contextlib.contextmanager
    def stage(self, i: int, k: int) -> Iterator[None]:
        """Microbatch `i`'s stage `k`: microbatch 1 waits for microbatch 0's stage `k` first;
        microbatch 0 records that event as the stage pauses, before the other one runs."""
        if i == 0:
            with torch.cuda.stream(self.main):
                yield
                while len(self._active) <= k:
                    self._active.append(torch.cuda.Event())
                self._active[k].record(self.main)
            return
        with torch.cuda.stream(self.side):
            self.side.wait_event(self._active[k])
            yield


def run_ubatches(
    forward_ubatch: Callable[[torch.Tensor, torch.Tensor], Any],
    input_ids: torch.Tensor,
    contexts: tuple[ForwardContext, ForwardContext],
    rows: tuple[int, int],
    streams: Optional[UbatchStreams] = None,
    trace: Optional[list[tuple[int, int]]] = None,
) -> torch.Tensor:
    """Run the two microbatches of a split step, interleaved (see the module docstring); returns
    their hidden states, [R0 + R1, hidden], in row order. `trace` (tests) collects the order of
    the stages run, as (microbatch, stage)."""
    r0, r1 = rows
    bounds = ((0, r0), (r0, r0 + r1))
    gens = [
        forward_ubatch(input_ids[a:b], ctx.context.positions)
        for (a, b), ctx in zip(bounds, contexts)
    ]
    outs: list[Optional[torch.Tensor]] = [None, None]
    stage = [0, 0]

    def advance(i: int) -> None:
        previous = use_forward_context(contexts[i])
        try:
            scope = streams.stage(i, stage[i]) if streams is not None else contextlib.nullcontext()
            with scope:
                try:
                    next(gens[i])
                except StopIteration as stop:
                    outs[i] = stop.value
            if trace is not None:
                trace.append((i, stage[i]))
            stage[i] += 1
        finally:
            use_forward_context(previous)

    session = streams.session() if streams is not None else contextlib.nullcontext()
    with session:
        advance(0)  # microbatch 0 leads by one stage
        while outs[0] is None or outs[1] is None:
            if outs[0] is None:
                advance(0)
            if outs[1] is None:
                advance(1)
    assert stage[0] == stage[1], f"the microbatches ran {stage[0]} and {stage[1]} stages"
    second = outs[1]
    if streams is not None and not torch.cuda.is_current_stream_capturing():
        second.record_stream(streams.main)  # made on the side stream, read on the main one
    return torch.cat([outs[0], second])  # [R0 + R1, hidden]


class UbatchRunner:
    """A model runner's two-batch overlap: the eager split's buffers and the CUDA streams."""

    def __init__(self, max_num_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.buffers = UbatchBuffers(max_num_seqs, max_blocks, device)
        self.streams = UbatchStreams(device) if device.type == "cuda" else None
        self._staged: Optional[tuple[dict, dict]] = None

    def split(self, inputs: StepInputs, decision: ForwardDecision) -> SplitStep:
        return split_step(inputs, decision)

    def stage(self, split: SplitStep) -> None:
        """Copy the microbatches' sequences to the device (before `StepBuffers.staged()`)."""
        self._staged = (self.buffers.stage(0, split.seqs[0]), self.buffers.stage(1, split.seqs[1]))

    def forward(
        self,
        model: Any,
        input_ids: torch.Tensor,
        split: SplitStep,
        forward_vars: dict[str, torch.Tensor],
        decision: ForwardDecision,
    ) -> torch.Tensor:
        """An eager split step's hidden states, [R0 + R1, hidden] (the staged rows' order)."""
        assert self._staged is not None, "stage() the split first"
        r0, r1 = split.rows
        mds = []
        for seqs, bufs, (a, b) in zip(split.seqs, self._staged, ((0, r0), (r0, r0 + r1))):
            cu = seqs.cu_seqlens_q.tolist()
            lens_q = np.diff(seqs.cu_seqlens_q)
            mds.append(
                AttentionMetaData(
                    cu_seqlens_q=bufs["cu_seqlens_q"],
                    context_lens=bufs["context_lens"],
                    block_tables=bufs["block_tables"],
                    slot_mapping=forward_vars["slot_mapping"][a:b],
                    max_seqlen_q=int(lens_q.max(initial=0)),
                    max_seqlen_k=int(seqs.context_lens.max(initial=0)),
                    num_seqs=seqs.num_seqs,
                    num_tokens=cu[-1],
                    cu_seqlens_q_cpu=cu,
                    context_lens_cpu=seqs.context_lens.tolist(),
                )
            )
        self._staged = None
        contexts = _contexts(mds, split.rows, forward_vars, decision.is_prefill)
        return run_ubatches(model.forward_ubatch, input_ids, contexts, split.rows, self.streams)

    def forward_bucket(
        self,
        model: Any,
        input_ids: torch.Tensor,
        forward_vars: dict[str, torch.Tensor],
        decision: ForwardDecision,
    ) -> torch.Tensor:
        """A TBO graph's forward: the bucket's requests cut at `ubatch_split_bs`, each microbatch's
        metadata views of the step's (graph-safe) buffers; no host data. [rows, hidden]."""
        bs, split_bs = decision.running_bs, decision.ubatch_split_bs
        assert split_bs is not None and decision.ubatch_rows is not None
        r0, r1 = decision.ubatch_rows
        q = 1 + decision.draft_num
        fv = forward_vars
        cu = fv["cu_seqlens_q"]
        outer = get_forward_context().attn_metadata
        max_k = outer.max_seqlen_k if outer is not None else 0
        mds = []
        for (s0, s1), (a, b), cu_i in (
            ((0, split_bs), (0, r0), cu[: split_bs + 1]),
            ((split_bs, bs), (r0, r0 + r1), cu[split_bs : bs + 1] - cu[split_bs]),  # rebased
        ):
            mds.append(
                AttentionMetaData(
                    cu_seqlens_q=cu_i,
                    context_lens=fv["context_lens"][s0:s1],
                    block_tables=fv["block_tables"][s0:s1],
                    slot_mapping=fv["slot_mapping"][a:b],
                    max_seqlen_q=q,
                    max_seqlen_k=max_k,
                    num_seqs=s1 - s0,
                    num_tokens=b - a,
                    graph_safe=True,
                )
            )
        contexts = _contexts(mds, (r0, r1), fv, is_prefill=False)
        return run_ubatches(model.forward_ubatch, input_ids, contexts, (r0, r1), self.streams)


def _contexts(
    mds: list[AttentionMetaData],
    rows: tuple[int, int],
    forward_vars: dict[str, torch.Tensor],
    is_prefill: bool,
) -> tuple[ForwardContext, ForwardContext]:
    """Each microbatch's forward context: the step's, with its metadata, shape and DP row count
    (every DP rank runs the same rows in each microbatch)."""
    outer = get_forward_context()
    dp = outer.dp_metadata
    r0, r1 = rows
    out = []
    for i, (md, (a, b)) in enumerate(zip(mds, ((0, r0), (r0, r0 + r1)))):
        context = Context(
            positions=forward_vars["positions"][a:b],
            is_prefill=is_prefill,
            batch_size=md.num_seqs,
            running_bs=md.num_seqs,
            running_tokens=b - a,
        )
        md_dp = (
            DPMetadata.for_capture(len(dp.running_tokens_per_dp_rank), b - a)
            if dp is not None
            else None
        )
        md = replace(md, ubatch=i)
        out.append(replace(outer, attn_metadata=md, context=context, dp_metadata=md_dp))
    return out[0], out[1]

# Hot path (worker, once per speculative step, before the target's forward): the draft model's
# passes. What may live here: laying out each pass's rows, running or replaying it, drawing drafts.
"""`DraftModelWorkerProposer` (method "draft_model" on the worker) and its `DraftModel`: a smaller model with the target's vocabulary that proposes each request's drafts
inside the step that verifies them.

The driver schedules a speculating request as its last token `t` (at position `p`) followed by `k`
`DRAFT_TOKEN` rows; the drafter fills those rows in before the target runs:

- pass 0 runs every row of the step that is not a draft (prompt chunks, decode rows, each `t`), so
  the drafter's KV cache follows the target's token for token; its output at `t` is draft 0;
- pass j (1..k) runs one row per request: draft j - 1 at position `p + j`; its output is draft j.
  Pass k only writes draft k - 1's KV: when every draft is accepted, the next step starts after it.

Every row the drafter writes is one the target writes in the same step (positions `p..p+k`), so the
drafter shares the target's block tables and slots and needs no blocks of its own; its KV cache has
the target's block count. Rows of rejected drafts are rewritten by a later step, as the target's.
Drafts are written into the runner's token pool, where the target's draft rows read them; greedy
requests draft the argmax, others draw from the drafter's own sampling distribution `q` (kept for
the rejection sampler). A seeded request draws draft j with the noise the target's sampler uses for
that output position (`seeded_noise_`): the rejection sampler couples the two draws.

Graphs (`DraftGraph`, graphs/draft_graph.py): with CUDA graphs on, every pass replays a recording
of the drafter's forward at its padded row count, in the shared `graph_pool()`, whichever mode the
target runs in; capture records every capture size. A pass that fits the ladder but finds no
recording runs eagerly and is counted (`DraftRecordings`, workers/spec_decode/recordings.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np
import torch

from atomrt.compile.decorators import compile_model
from atomrt.distributed.communication_op import TPInfo, tp_broadcast
from atomrt.graphs.buckets import capture_order
from atomrt.runtime.config import Config
from atomrt.runtime.forward_context import AttentionMetaData, Context, set_forward_context
from atomrt.workers.layers.attention import collect_attention_layers
from atomrt.workers.loading.loader import load_model
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.kv_cache import (
    CacheEntry,
    LayerSpec,
    allocate_kv_cache,
    kv_bytes_per_block,
    kv_layer_specs,
)
from atomrt.workers.runner.sampler import SamplingTensors, greedy_argmax, seeded_noise_
from atomrt.workers.runner.step_buffers import RunnerShape
from atomrt.workers.spec_decode.proposer import ProposerSetup, StepToDraft, WorkerProposer
from atomrt.workers.spec_decode.recordings import DraftRecordings
from atomrt.workers.spec_decode.rejection_sampler import select_rows, target_probs

logger = logging.getLogger(__name__)


def draft_config(config: Config, max_model_len: Optional[int] = None) -> Config:
    """The engine's config with the draft model in the target's place (so its own compile-cache
    key), no speculation of its own, none of the target's `hf_overrides`, and the engine's context
    length when given."""
    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    max_len = max_model_len or config.model_config.max_model_len
    return replace(
        config,
        model=spec.model,
        speculative_config=None,
        model_config=replace(
            config.model_config, tokenizer=None, max_model_len=max_len, hf_overrides=None
        ),
    )


@dataclass
class _Pass:
    """One drafter pass, laid out on the host: its rows, padded to `rows`, and what it samples."""

    num_rows: int  # real rows
    rows: int  # rows run (a graph bucket, or num_rows eagerly)
    input_ids: np.ndarray  # int64 [rows]: host ids (pass 0), else overwritten on the device
    positions: np.ndarray  # int64 [rows]
    slot_mapping: np.ndarray  # int64 [rows]
    cu_seqlens_q: np.ndarray  # int32 [num_seqs + 1]
    context_lens: np.ndarray  # int32 [num_seqs]
    sample_rows: np.ndarray  # int64 [num_verify]: each proposing request's last row


class DraftModel:
    def __init__(
        self,
        config: Config,
        device: torch.device,
        dtype: torch.dtype,
        shape: RunnerShape,
        graphs_enabled: bool,
    ) -> None:
        """`shape`: the target runner's sizes (the drafter runs the same steps)."""
        # the engine's whole context (the driver checked that the drafter covers it)
        self.config = dcfg = draft_config(config, shape.max_model_len)
        self.k = config.speculative_config.num_speculative_tokens
        self.device, self.dtype = device, dtype
        loaded = load_model(dcfg, device, dtype, TPInfo())
        self.model, self.arch = compile_model(loaded.model, dcfg), loaded.arch
        self.attn_layers = collect_attention_layers(self.model)
        self.kv_cache: dict[str, CacheEntry] = {}
        self.block_size = config.cache_config.block_size
        self.buffers = shape.step_inputs(device)  # its own static step buffers, the target's kind
        self.recordings = DraftRecordings(graphs_enabled)  # one DraftGraph: every pass's
        self._warm_up()

    # ---------------------------------------------------------------- set-up

    def kv_layer_specs(self) -> list[LayerSpec]:
        return kv_layer_specs(self.attn_layers)

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.kv_layer_specs(), self.block_size, self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = allocate_kv_cache(
            self.kv_layer_specs(), num_blocks, self.block_size, self.dtype, self.device
        )

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """A 2-row forward without KV cache: checks the drafter runs, and (levels 2-3) compiles it
        for a dynamic row count (a first call of one row would specialise)."""
        ids = self.buffers["input_ids"][:2]
        md = AttentionMetaData(cu_seqlens_q_cpu=[0, 2], num_seqs=1, num_tokens=2)
        ctx = Context(
            positions=self.buffers["positions"][:2],
            is_prefill=True,
            batch_size=1,
            running_bs=1,
            running_tokens=2,
            is_draft=True,
        )
        with set_forward_context(md, self.config, ctx, no_compile_layers=self.attn_layers):
            self.model(ids, self.buffers["positions"][:2])

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        """Record a DraftGraph of the drafter's forward at each capture size (largest first, into
        the shared pool); every size must be recorded."""
        graph = self.recordings.graphs.get(None)
        if graph is None:
            return
        for bs in capture_order(sizes):
            p = _dummy_pass(bs)
            with self._pass_context(p, bs, block_tables=np.zeros((bs, 1), np.int32)):
                fv = self.buffers
                self.model(fv["input_ids"][:bs], fv["positions"][:bs])  # warm-up
                graph.record(bs, "decode", self.model, fv["input_ids"][:bs], fv["positions"][:bs])
        self.recordings.captured(sizes)
        missing = [s for s in self.recordings.capture_sizes if (s, "decode") not in graph]
        if missing:
            raise RuntimeError(f"draft model: capture left buckets {missing} unrecorded")

    # ---------------------------------------------------------------- one step

    @torch.inference_mode()
    def propose(
        self, inputs: StepInputs, sampling: SamplingTensors, draft_tokens: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """Run the step's passes and write each draft row's token into `draft_tokens` (the token
        pool's draft part, indexed by row). Returns the drafts' distributions `q`, float32
        [sum(k_s), vocab] in request order, when any proposing request samples; else None. A step
        without drafts runs pass 0 alone (the drafter's KV follows every token the target sees)."""
        k_all = inputs.num_draft_tokens
        if k_all is None:
            k_all = np.zeros(inputs.num_seqs, dtype=np.int64)
        verify = np.flatnonzero(k_all > 0)  # the requests that verify drafts
        k_s = k_all[verify]
        tables = inputs.block_tables
        if not verify.size:
            self._run(self._catch_up(inputs, k_all, verify), tables, None)
            return None
        # Their place among the sampled requests (SamplingTensors order): every verifier samples.
        order = np.searchsorted(inputs.sample_seq_idx, verify)
        t = select_rows(sampling, order)
        ends = inputs.cu_seqlens_q[1:].astype(np.int64)
        draft_rows = torch.as_tensor(
            np.stack([ends[verify] - k_s + j for j in range(self.k)], axis=1), device=self.device
        )  # [num_verify, k]: the target rows the drafts fill (clamped below for short ones)
        probs: list[torch.Tensor] = []
        tokens: Optional[torch.Tensor] = None
        for j in range(self.k + 1):
            if j == 0:
                p = self._catch_up(inputs, k_all, verify)
            else:
                p = self._propose_pass(inputs, k_all, verify, j)
            hidden = self._run(p, tables, tokens if j else None)
            if j == self.k:
                break  # the last pass only writes the KV of the last draft
            logits = self.model.compute_logits(
                hidden[torch.as_tensor(p.sample_rows, device=self.device)]
            )
            tokens, q = self._draw(logits, t, j)
            live = j < k_s  # requests with a draft j
            rows = draft_rows[:, j][torch.as_tensor(live, device=self.device)]
            draft_tokens.index_copy_(0, rows, tokens[torch.as_tensor(live, device=self.device)])
            if q is not None:
                probs.append(q)
        if not probs:
            return None
        q_all = torch.stack(probs, dim=1)  # [num_verify, k, vocab]
        keep = torch.as_tensor(np.arange(self.k)[None, :] < k_s[:, None], device=self.device)
        return q_all[keep]  # [sum(k_s), vocab], request by request

    def _catch_up(self, inputs: StepInputs, k_all: np.ndarray, verify: np.ndarray) -> _Pass:
        """Pass 0: the step's rows without its draft rows."""
        q_lens = np.diff(inputs.cu_seqlens_q).astype(np.int64) - k_all
        keep = np.ones(inputs.num_tokens, dtype=bool)
        ends = inputs.cu_seqlens_q[1:].astype(np.int64)
        for s in np.flatnonzero(k_all):
            keep[ends[s] - k_all[s] : ends[s]] = False
        cu = np.zeros(inputs.num_seqs + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        return self._padded(
            inputs.input_ids[keep],
            inputs.positions[keep],
            inputs.slot_mapping[keep],
            cu,
            (inputs.context_lens - k_all).astype(np.int32),
            cu[1:][verify].astype(np.int64) - 1,
        )

    def _propose_pass(
        self, inputs: StepInputs, k_all: np.ndarray, verify: np.ndarray, j: int
    ) -> _Pass:
        """Pass j >= 1: one row per request of the step; a verifier with a draft j - 1 runs it at
        position p + j, every other row is a no-op (position 0, no KV write, a 1-token context)."""
        bs = inputs.num_seqs
        live = np.zeros(bs, dtype=bool)
        live[verify] = k_all[verify] >= j
        first = inputs.context_lens.astype(np.int64) - k_all - 1  # position of each request's t
        positions = np.where(live, first + j, 0)
        blocks = inputs.block_tables[np.arange(bs), positions // self.block_size].astype(np.int64)
        slots = np.where(live, blocks * self.block_size + positions % self.block_size, -1)
        return self._padded(
            np.zeros(bs, dtype=np.int64),
            positions,
            slots,
            np.arange(bs + 1, dtype=np.int32),
            np.where(live, positions + 1, 1).astype(np.int32),
            verify.astype(np.int64),
        )

    def _padded(self, ids, positions, slots, cu, context_lens, sample_rows) -> _Pass:
        num_rows = int(ids.shape[0])
        rows = self.recordings.padded(num_rows)
        pad = rows - num_rows
        return _Pass(
            num_rows=num_rows,
            rows=rows,
            input_ids=np.concatenate([ids, np.zeros(pad, np.int64)]),
            positions=np.concatenate([positions, np.zeros(pad, np.int64)]),
            slot_mapping=np.concatenate([slots, np.full(pad, -1, np.int64)]),
            cu_seqlens_q=cu,
            context_lens=context_lens,
            sample_rows=sample_rows,
        )

    def _run(
        self, p: _Pass, block_tables: np.ndarray, prev_tokens: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """Stage the pass, then replay its DraftGraph (or run it eagerly); [rows, hidden]. With
        `prev_tokens`, every request's row takes its token (the previous pass's draft)."""
        fv, rows = self.buffers, p.rows
        with self._pass_context(p, len(p.context_lens), block_tables):
            if prev_tokens is not None:
                fv["input_ids"][torch.as_tensor(p.sample_rows, device=self.device)] = prev_tokens
            if self._replays(p):
                return self.recordings.graphs[None].replay(rows, "decode")
            return self.model(fv["input_ids"][:rows], fv["positions"][:rows])

    def _replays(self, p: _Pass) -> bool:
        """Whether the pass replays a recording. With graphs on, a pass that runs eagerly although
        the ladder holds its rows (a bucket, or the whole drafter, never recorded) is counted."""
        if not self.recordings.enabled:
            return False
        if self.recordings.beyond_ladder(p.num_rows):
            return False  # eager, as the target's steps
        return self.recordings.replays(None, p.rows)

    def _pass_context(self, p: _Pass, num_seqs: int, block_tables: np.ndarray) -> Any:
        """Copy the pass into the static buffers (one host-to-device copy each) and enter its
        forward context (attention planned from the host lengths: every pass is an eager region
        in its recording)."""
        fv, rows = self.buffers, p.rows
        for name, values in (
            ("input_ids", p.input_ids),
            ("positions", p.positions),
            ("slot_mapping", p.slot_mapping),
            ("cu_seqlens_q", p.cu_seqlens_q),
            ("context_lens", p.context_lens),
        ):
            fv[name][: values.shape[0]].copy_(torch.from_numpy(values), non_blocking=True)
        width = block_tables.shape[1]
        fv["block_tables"][:num_seqs, :width].copy_(
            torch.from_numpy(block_tables), non_blocking=True
        )
        md = AttentionMetaData(
            cu_seqlens_q=fv["cu_seqlens_q"][: num_seqs + 1],
            context_lens=fv["context_lens"][:num_seqs],
            block_tables=fv["block_tables"][:num_seqs, :width],
            slot_mapping=fv["slot_mapping"][:rows],
            max_seqlen_q=int(np.diff(p.cu_seqlens_q).max(initial=0)),
            max_seqlen_k=int(p.context_lens.max(initial=0)),
            num_seqs=num_seqs,
            num_tokens=p.num_rows,
            cu_seqlens_q_cpu=p.cu_seqlens_q.tolist(),
            context_lens_cpu=p.context_lens.tolist(),
        )
        ctx = Context(
            positions=fv["positions"][:rows],
            is_prefill=False,
            batch_size=num_seqs,
            running_bs=num_seqs,
            running_tokens=rows,
            is_draft=True,
        )
        return set_forward_context(
            md,
            self.config,
            ctx,
            no_compile_layers=self.attn_layers,
            kv_cache_data=self.kv_cache,
        )

    def _draw(
        self, logits: torch.Tensor, t: SamplingTensors, j: int
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Each proposing request's draft j from its row's logits [num_verify, vocab]: the argmax
        for greedy requests, else a draw from q (returned) with the request's own sampling
        settings (its logit additions too: a draft the target masks would only be rejected); a
        seeded request's with the noise of its output position j."""
        if t.additions is not None:
            logits = t.additions.apply(logits.float())
        greedy = greedy_argmax(logits)
        if t.all_greedy:
            return greedy, None
        q = target_probs(logits, t)
        noise = torch.empty_like(q).exponential_()
        for s, seed in enumerate(t.seeds):
            if seed is not None:
                seeded_noise_(noise[s], seed, t.num_output_tokens[s] + j)
        drawn = (q / noise.clamp_min_(1e-30)).argmax(dim=-1)
        return torch.where(t.temperatures == 0, greedy, drawn), q


def _dummy_pass(bs: int) -> _Pass:
    """`bs` one-row sequences at position 0 that write no KV: what capture records."""
    return _Pass(
        num_rows=bs,
        rows=bs,
        input_ids=np.zeros(bs, np.int64),
        positions=np.zeros(bs, np.int64),
        slot_mapping=np.full(bs, -1, np.int64),
        cu_seqlens_q=np.arange(bs + 1, dtype=np.int32),
        context_lens=np.ones(bs, np.int32),
        sample_rows=np.arange(bs, dtype=np.int64),
    )


class DraftModelWorkerProposer(WorkerProposer):
    """Method "draft_model" on the worker: the `DraftModel` on each DP rank's TP rank 0 fills the
    step's draft rows before the target's forward (every step: its KV cache follows the target's
    tokens); TP rank 0 broadcasts them to the other TP ranks, since every rank feeds the target the
    same rows."""

    method = "draft_model"
    drafts_in_pool = True

    def __init__(self, setup: ProposerSetup) -> None:
        super().__init__(setup)
        self.drafter: Optional[DraftModel] = None
        if setup.tp.tp_rank == 0:
            self.drafter = DraftModel(
                setup.config, setup.device, setup.dtype, setup.shape, setup.graphs_enabled
            )

    def kv_bytes_per_block(self) -> int:
        return self.drafter.kv_bytes_per_block() if self.drafter is not None else 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)

    def capture(self, runner: Any, sizes: list[int]) -> None:
        if self.drafter is not None:
            self.drafter.capture(sizes)

    def take_eager_passes(self) -> int:
        return self.drafter.recordings.take_eager_passes() if self.drafter is not None else 0

    def prepare(self, step: StepToDraft) -> Optional[torch.Tensor]:
        draft_probs = None
        pool = step.tokens.draft_tokens
        if self.drafter is not None:
            self.timer.start()
            draft_probs = self.drafter.propose(step.inputs, step.sampling, pool)
            self.timer.stop()
        if step.inputs.num_draft_tokens is not None:
            tp_broadcast(pool[: step.inputs.num_tokens], self.tp)
        return draft_probs

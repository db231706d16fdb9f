# Hot path (worker, once per step with MTP speculation): staging the drafter's host data before the
# target's forward, and the MTP layers' passes after its tokens are sampled. What may live here:
# laying out each pass's rows on the device from the sampled tokens, running or replaying a pass,
# drawing drafts. No host synchronisation: the accepted counts stay on the device.
"""`MTPWorkerProposer` (method "mtp" on the worker) and its `MTPDrafter`: the checkpoint's own
multi-token-prediction layers (workers/models/deepseek_mtp.py), which the drafter builds and loads
itself beside the target (`load_mtp_layers`), propose each sampled request's k drafts for its
next step, right after the step's tokens are sampled; the step's result carries them to the
driver, which schedules them as that request's draft rows in its next step.

For a sampled request whose step ran rows `t` (its last token, at position p) then `k_s` drafts,
of which the target accepted `m` (emitting the accepted drafts and one token `c` after them):

- pass 0 runs every row of the step, with the target's positions and metadata: row r takes the
  target's final hidden state at r (DeepSeek-V4's: its last streams [hc_mult, hidden], which the
  target writes into the drafter's buffer itself) and the id of row r + 1 (the input ids shifted by one); the
  request's row `t + m` takes `c` instead, and the last row of a prompt chunk that samples nothing
  the prompt's next token (`StepInputs.next_token_ids`). This writes the MTP layer's KV for every
  row (rows past `t + m` are rewritten by a later step, as the target's are); its output at row
  `t + m` is draft 0;
- pass j (1..k-1) runs one row per sampled request, at position p + m + j, taking draft j - 1 and
  pass j - 1's output (before `shared_head.norm`); its output is draft j. Its KV slot lies past
  the step's rows: the scheduler allocates those (`SpeculativeConfig.num_lookahead_tokens`).
  A position past max_model_len (or a padding row) is a no-op: position 0, no KV write, a 1-token
  context.

Drafts are greedy (the argmax of the shared LM head): the rejection sampler judges a sampled
request's drafts as one-hot proposals, as n-gram ones. Pass j runs MTP layer j, the last one again
for passes beyond the layers present. With several MTP layers (none of the published DeepSeek-V3,
R1 or GLM-4.7-Flash checkpoints has more than one), a layer j >= 1 holds KV only at the rows its
own passes ran, where the formula would have it run every position: its drafts are then worse
than they could be, never wrong tokens.

Every rank runs the passes (the MTP layer is split over TP ranks as the target's layers are; its
experts gather across DP ranks), each pass the same rows on every DP rank: pass 0 the target's
`running_tokens`, pass j `running_bs` padded to a capture size. An idle DP rank runs them on its
dummy batch, with no request live.

Graphs (`DraftGraph`): pass 0 replays a recording at the target's rows when the target replayed a
graph (the step's metadata is the target's: its static buffers), later passes a recording at their
padded rows (their metadata computed inside it from the accepted counts). A pass that finds no
recording while its target step, or its row count, is on the ladder runs eagerly and is counted
(`DraftRecordings`, workers/spec_decode/recordings.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Optional

import numpy as np
import torch

from atomrt.distributed.communication_op import tp_broadcast
from atomrt.graphs.buckets import capture_order
from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.runtime.forward_context import (
    AttentionMetaData,
    Context,
    DPMetadata,
    set_forward_context,
)
from atomrt.workers.layers.attention import collect_attention_layers
from atomrt.workers.loading.loader import load_mtp_layers
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.sampler import SamplingTensors, greedy_argmax
from atomrt.workers.runner.step_buffers import write_padded
from atomrt.workers.spec_decode.proposer import (
    ProposerSetup,
    StepToDraft,
    TargetStep,
    WorkerProposer,
)
from atomrt.workers.spec_decode.recordings import DraftRecordings


class _Staging:
    """1-D host arrays copied to device buffers; through pinned memory on CUDA, which a step
    rewrites only once the previous step's copies ran (`begin`, `end`)."""

    def __init__(self, device: torch.device, size: int, **dtypes: torch.dtype) -> None:
        self.device = {k: torch.zeros(size, dtype=d, device=device) for k, d in dtypes.items()}
        self.copies = device.type == "cuda"
        self.host = {
            k: (v.cpu().pin_memory() if self.copies else v) for k, v in self.device.items()
        }
        self._read = torch.cuda.Event() if self.copies else None

    def begin(self) -> None:
        if self._read is not None:
            self._read.synchronize()

    def end(self) -> None:
        if self._read is not None:
            self._read.record()

    def put(self, name: str, values: np.ndarray, length: int, pad: Any) -> torch.Tensor:
        """device[name][:length] = values, then `pad`; returns that slice."""
        host = self.host[name]
        write_padded(host.numpy(), values, length, pad)
        dev = self.device[name][:length]
        if self.copies:
            dev.copy_(host[:length], non_blocking=True)
        return dev


class MTPDrafter:
    def __init__(self, setup: ProposerSetup) -> None:
        """`setup.model`: the target (a DeepSeek-family model), whose MTP layers the drafter
        builds and loads from the same checkpoint (`load_mtp_layers`)."""
        model, config, device, shape = setup.model, setup.config, setup.device, setup.shape
        graphs_enabled, self.dp = setup.graphs_enabled, setup.dp
        self.mtp = load_mtp_layers(model, config, device, setup.dtype, setup.tp, setup.dp).mtp
        self.config = config
        self.k = config.speculative_config.num_speculative_tokens
        self.block_size, self.max_model_len = shape.block_size, shape.max_model_len
        n, s = shape.max_num_tokens, shape.max_num_seqs
        # a row's hidden state: [hidden], or DeepSeek-V4's streams [hc_mult, hidden]
        hidden, dtype = self.mtp.hidden_shape, next(model.parameters()).dtype
        i64, i32 = torch.int64, torch.int32
        self.ids = torch.zeros(n, dtype=i64, device=device)  # pass 0's shifted ids
        self.hidden = torch.zeros(n, *hidden, dtype=dtype, device=device)  # pass 0's h
        self.mtp.bind(self.hidden)  # a target that writes pass 0's h itself is pointed here
        # later passes: row i is the step's i-th sampled request (then padding rows)
        self.row_ids = torch.zeros(s, dtype=i64, device=device)
        self.row_hidden = torch.zeros(s, *hidden, dtype=dtype, device=device)
        self.last_pos = torch.zeros(s, dtype=i64, device=device)
        self.positions = torch.zeros(s, dtype=i64, device=device)
        self.slot_mapping = torch.full((s,), -1, dtype=i64, device=device)
        self.context_lens = torch.ones(s, dtype=i32, device=device)
        self.cu_seqlens_q = torch.arange(s + 1, dtype=i32, device=device)
        self.drafts = torch.zeros(s, max(self.k, 1), dtype=i64, device=device)
        # the sampled requests' block tables (gathered from the step's on the device)
        self.block_tables = torch.zeros(s, shape.max_blocks_per_seq, dtype=i32, device=device)
        self.staging = _Staging(
            device,
            s,
            seq_idx=i64,  # the sampled requests, among the step's
            t_rows=i64,  # each one's row t
            t_pos=i64,  # its position
            live=torch.bool,  # rows of the later passes that are a request's
            fix_rows=i64,  # last rows of prompt chunks that sample nothing
            fix_ids=i64,  # the prompt's next token there
        )
        # the layers the later passes run; a DraftGraph each, and "step" pass 0's
        self.row_layers = sorted({self.mtp.layer_for(j) for j in range(1, self.k)})
        self.recordings = DraftRecordings(graphs_enabled, ["step", *self.row_layers])
        self._step: Optional[_Staged] = None

    # ---------------------------------------------------------------- capture

    @torch.inference_mode()
    def capture(self, runner: Any, sizes: list[int]) -> None:
        """Record pass 0 at every row count the target's graphs run (each capture size x the
        decode buckets' query rows, on the target's staged bucket) and each later pass's layer at
        every capture size; largest first, into the shared pool, after the target's recordings.
        Every bucket must be recorded."""
        graphs = self.recordings.graphs
        if not graphs:
            return
        config = runner.config
        for bs in capture_order(sizes):
            for q in config.capture_q_lens:
                b = runner.graphs.stage_bucket(runner, bs, q)
                with set_forward_context(b.md, config, replace(b.ctx, is_draft=True), **b.scope):
                    runner.buffers.unpack(bs, b.rows)
                    args = (self.ids[: b.rows], b.pos, self.hidden[: b.rows])
                    self.mtp(*args, layer=0)  # warm-up: kernels' workspaces outside the capture
                    graphs["step"].record(b.rows, "decode", partial(self.mtp, layer=0), *args)
            self.staging.device["live"][:bs] = False  # dummy rows: no request, no KV write
            self.block_tables[:bs, 0] = 0
            for layer in self.row_layers:
                with self._row_context(bs, runner.attn_layers, runner.kv_cache):
                    args = self._row_args(bs)
                    self._row_pass(layer, *args)  # warm-up
                    graphs[layer].record(bs, "decode", partial(self._row_pass, layer), *args)
        self.recordings.captured(sizes)
        sizes = self.recordings.capture_sizes
        steps = [bs * q for bs in sizes for q in config.capture_q_lens]
        missing = [("pass 0", r) for r in steps if (r, "decode") not in graphs["step"]] + [
            (f"layer {layer}", bs)
            for layer in self.row_layers
            for bs in sizes
            if (bs, "decode") not in graphs[layer]
        ]
        if missing:
            raise RuntimeError(f"MTP drafter: capture left buckets {missing} unrecorded")

    # ---------------------------------------------------------------- before the forward

    def stage(self, inputs: StepInputs, decision: ForwardDecision) -> None:
        """Copy what the passes need from the host, before the target's forward is launched (an
        asynchronous copy then waits for nothing)."""
        st = self.staging
        idx = inputs.sample_seq_idx
        n = int(idx.shape[0])
        k_all = inputs.num_draft_tokens
        ends = inputs.cu_seqlens_q[1:].astype(np.int64)
        t_rows = ends[idx] - 1 - (k_all[idx] if k_all is not None else 0)
        row_bs = self._row_bucket(decision.running_bs) if self.k > 1 else 0
        fix = np.zeros(0, dtype=np.int64)
        if inputs.next_token_ids is not None:
            fix = np.flatnonzero(inputs.next_token_ids >= 0)
        fix_ids = inputs.next_token_ids[fix] if fix.size else fix
        st.begin()
        self._step = _Staged(
            n=n,
            row_bs=row_bs,
            seq_idx=st.put("seq_idx", idx, n, 0),
            t_rows=st.put("t_rows", t_rows, n, 0),
            t_pos=st.put("t_pos", inputs.positions[t_rows], n, 0),
            fix_rows=st.put("fix_rows", ends[fix] - 1, fix.shape[0], 0),
            fix_ids=st.put("fix_ids", fix_ids, fix.shape[0], 0),
            live=st.put("live", np.ones(n, dtype=np.bool_), max(row_bs, n), False),
        )
        st.end()

    def _row_bucket(self, running_bs: int) -> int:
        """The rows of a later pass: `running_bs` (the same on every DP rank), padded to a capture
        size when on the ladder."""
        return self.recordings.padded(running_bs)

    # ---------------------------------------------------------------- after sampling

    @torch.inference_mode()
    def propose(self, step: TargetStep, packed: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Run the passes; returns each sampled request's drafts, int64 [n, k] (None without
        sampled requests). `packed`: the step's tokens, [n, k + 2] `[m, token 0, ..., token m, -1
        ...]` (workers/spec_decode/speculator.py)."""
        staged, self._step = self._step, None
        assert staged is not None, "MTPDrafter.stage was not called for this step"
        n = staged.n
        rows = step.hidden_states.shape[0]
        ids = self.ids
        ids[: rows - 1].copy_(step.input_ids[1:rows])  # row r takes row r + 1's token
        ids[rows - 1 : rows].zero_()
        if staged.fix_rows.shape[0]:
            ids[staged.fix_rows] = staged.fix_ids
        sel = last_pos = None
        if n:
            m = packed[:, 0]  # [n]: drafts accepted
            sel = staged.t_rows + m  # each request's last accepted row
            ids[sel] = packed.gather(1, (1 + m).unsqueeze(1)).squeeze(1)  # the token after it
            last_pos = staged.t_pos + m
        if not self.mtp.target_writes_hidden:
            self.hidden[:rows].copy_(step.hidden_states)
        with set_forward_context(
            step.md,
            self.config,
            replace(step.context, is_draft=True),
            no_compile_layers=step.layers,
            kv_cache_data=step.kv_cache,
            dp_metadata=step.dp,
        ):
            out = self._step_pass(rows, step.decision, step.context.positions)
            h = out[sel] if n else None  # [n, hidden]: consumed before any other replay
        if n:
            self.drafts[:n, 0] = greedy_argmax(self.mtp.compute_logits(h, 0))
        if self.k > 1 and staged.row_bs and (n or self.dp.dp_size > 1):
            self._row_passes(step, staged, h, last_pos)
        return self.drafts[:n, : self.k] if n else None

    def _step_pass(
        self, rows: int, decision: ForwardDecision, positions: torch.Tensor
    ) -> torch.Tensor:
        """Pass 0 over the step's rows: its recording when the target replayed one."""
        if self._replays_step(rows, decision):
            return self.recordings.graphs["step"].replay(rows, "decode")
        return self.mtp(self.ids[:rows], positions[:rows], self.hidden[:rows], layer=0)

    def _replays_step(self, rows: int, decision: ForwardDecision) -> bool:
        """Whether pass 0 replays a recording: when the target replayed one (else it runs eagerly
        as the target did). One that finds none is counted."""
        if not self.recordings.enabled or decision.kind is ForwardKind.EAGER:
            return False
        return self.recordings.replays("step", rows)

    def _replays_rows(self, rows: int, layer: int) -> bool:
        """Whether a later pass replays a recording: when its rows are on the ladder (else eagerly,
        as the target's steps beyond it). One that finds none is counted."""
        r = self.recordings
        if not r.enabled or not r.capture_sizes or r.beyond_ladder(rows):
            return False
        return r.replays(layer, rows)

    def _row_passes(
        self,
        step: TargetStep,
        staged: _Staged,
        h: Optional[torch.Tensor],
        last_pos: Optional[torch.Tensor],
    ) -> None:
        """Passes 1..k-1, one row per sampled request (`staged.row_bs` rows)."""
        n, rows = staged.n, staged.row_bs
        for buf in (self.row_ids, self.row_hidden, self.last_pos):
            buf[:rows].zero_()
        self.block_tables[:rows, 0] = 0  # a padding row reads block 0 (its one-token context)
        if n:
            self.row_ids[:n] = self.drafts[:n, 0]
            self.row_hidden[:n] = h
            self.last_pos[:n] = last_pos
            torch.index_select(step.md.block_tables, 0, staged.seq_idx, out=self.block_tables[:n])
        with self._row_context(rows, step.layers, step.kv_cache):
            for j in range(1, self.k):
                layer = self.mtp.layer_for(j)
                if self._replays_rows(rows, layer):
                    tokens = self.recordings.graphs[layer].replay(rows, "decode")
                else:
                    tokens = self._row_pass(layer, *self._row_args(rows))
                if n:
                    self.drafts[:n, j] = tokens[:n]

    def _row_args(self, rows: int) -> tuple[torch.Tensor, ...]:
        return (
            self.row_ids[:rows],
            self.row_hidden[:rows],
            self.last_pos[:rows],
            self.staging.device["live"][:rows],
            self.positions[:rows],
            self.slot_mapping[:rows],
            self.context_lens[:rows],
            self.block_tables[:rows],
        )

    def _row_pass(
        self,
        layer: int,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        last_pos: torch.Tensor,
        live: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """One later pass on static buffers (what a row recording holds): each row one position on
        from its last, its metadata from that position, the layer, its drafts; the drafts and the
        output become the next pass's input. Returns the drafts [rows]."""
        bs = self.block_size
        pos = last_pos + 1
        last_pos.copy_(pos)
        entry = (pos // bs).clamp(0, block_tables.shape[1] - 1)
        block = block_tables.gather(1, entry.unsqueeze(1)).squeeze(1).to(torch.int64)
        ok = live & (pos < self.max_model_len) & (block >= 0)
        positions.copy_(torch.where(ok, pos, 0))
        slot_mapping.copy_(torch.where(ok, block * bs + pos % bs, -1))
        context_lens.copy_(torch.where(ok, pos + 1, 1))
        out = self.mtp(ids, positions, hidden, layer=layer)
        tokens = greedy_argmax(self.mtp.compute_logits(out, layer))
        ids.copy_(tokens)
        hidden.copy_(out)
        return tokens

    def _row_context(self, rows: int, layers: dict[int, Any], kv_cache: dict[str, Any]) -> Any:
        """The forward context of a later pass: `rows` one-row sequences, every length on the
        device (computed inside the pass)."""
        md = AttentionMetaData(
            cu_seqlens_q=self.cu_seqlens_q[: rows + 1],
            context_lens=self.context_lens[:rows],
            block_tables=self.block_tables[:rows],
            slot_mapping=self.slot_mapping[:rows],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
            num_seqs=rows,
            num_tokens=rows,
            cu_seqlens_q_cpu=list(range(rows + 1)),
            graph_safe=True,
        )
        ctx = Context(
            positions=self.positions[:rows],
            is_prefill=False,
            batch_size=rows,
            running_bs=rows,
            running_tokens=rows,
            is_draft=True,
        )
        dp = DPMetadata.for_capture(self.dp.dp_size, rows) if self.dp.dp_size > 1 else None
        return set_forward_context(
            md,
            self.config,
            ctx,
            no_compile_layers=layers,
            kv_cache_data=kv_cache,
            dp_metadata=dp,
        )


@dataclass
class _Staged:
    """One step's staged data (device views)."""

    n: int  # sampled requests
    row_bs: int  # rows of the later passes (0: none)
    seq_idx: torch.Tensor
    t_rows: torch.Tensor
    t_pos: torch.Tensor
    fix_rows: torch.Tensor
    fix_ids: torch.Tensor
    live: torch.Tensor


class MTPWorkerProposer(WorkerProposer):
    """Method "mtp" on the worker, on every rank: the `MTPDrafter` stages its passes before the
    target's forward and drafts each sampled request's next k tokens after the step's sampling."""

    method = "mtp"

    def __init__(self, setup: ProposerSetup) -> None:
        super().__init__(setup)
        self.drafter = MTPDrafter(setup)

    @property
    def next_drafts(self) -> int:
        return self.k

    def attention_layers(self) -> dict[int, Any]:
        """The MTP layers' attention: layers `num_hidden_layers + i` of the KV cache."""
        return collect_attention_layers(self.drafter.mtp)

    def capture(self, runner: Any, sizes: list[int]) -> None:
        """`runner` stages pass 0's recordings as the target's steps."""
        self.drafter.capture(runner, sizes)

    def take_eager_passes(self) -> int:
        return self.drafter.recordings.take_eager_passes()

    def prepare(self, step: StepToDraft) -> None:
        self.drafter.stage(step.inputs, step.decision)

    def after_sample(
        self, step: TargetStep, packed: Optional[torch.Tensor], sampling: SamplingTensors
    ) -> Optional[torch.Tensor]:
        # every rank drafts from TP rank 0's tokens, unless each rank sampled them alike (a
        # grammar masks rank 0's rows only: its greedy tokens differ from the other ranks')
        if packed is not None and self.tp.tp_size > 1 and not sampling.same_on_every_rank:
            tp_broadcast(packed, self.tp)
        self.timer.start()
        drafts = self.drafter.propose(step, packed)
        self.timer.stop()
        return drafts

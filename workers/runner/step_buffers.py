# Hot path (worker, once per step): copying a step's host arrays into the static device buffers.
# What may live here: the buffers, their pinned staging, and filling them by slicing.
"""`StepBuffers`: the static device buffers a forward reads (`forward_vars`: the addresses every
graph was recorded at) and how a step gets into them.

On CUDA each buffer has a pinned host mirror, filled with numpy and copied asynchronously (one copy
per buffer, padding included); on CPU the buffers are filled in place. A request-graph step on CUDA
travels packed instead (`PackedStep`): one copy, unpacked by the graph's first kernel.

Why packed: a FULL decode step fills six static buffers (`forward_vars`); each host-to-device copy costs host
time (a launch, and an event on the pinned staging buffer) before the graph can start. Instead the
step's rows are laid out back to back in one pinned buffer, copied in one transfer to a device
buffer at a fixed address, and unpacked into the static buffers by one kernel recorded at the head
of every request graph (`unpack`, kernels/unpack_step.py).

Layout for a bucket of `seqs` sequences and `rows` token rows, in the order of the buffer:
- int64 [rows] each: the input ids (async scheduling: the staged ids, then `token_src`), positions,
  slot_mapping;
- int32: the block tables' live width W (the widest table of the step), cu_seqlens_q [seqs + 1],
  context_lens [seqs], block_tables [seqs, W].
Only W columns travel: with a long max_model_len a full-width table would cost a copy of up to
max_blocks entries per sequence every step (1 MiB for 32 sequences at 131072 tokens). The static
table's columns past W keep stale entries, which no kernel reads: attention loads a table entry
only for keys inside the sequence's context, and those lie within W.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch

from atomrt.runtime.decision import ForwardDecision
from atomrt.runtime.forward_context import AttentionMetaData, Context
from atomrt.workers.kernels.launch import launch
from atomrt.workers.kernels.unpack_step import unpack_step_kernel
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.token_pool import TokenPool

UNPACK_BLOCK = 1024  # entries a program moves per loop step


def write_padded(host: np.ndarray, values: np.ndarray, length: int, pad: Any) -> None:
    """host[:length] = values, then `pad` (rows of a 2-D array alike: columns past values' width too)."""
    n = values.shape[0]
    if host.ndim == 2:
        width = values.shape[1] if n else 0
        host[:n, :width] = values
        host[:n, width:] = pad
    else:
        host[:n] = values
    host[n:length] = pad


@dataclass(frozen=True)
class _Layout:
    """Word offsets of one bucket's fields: int64 words for the row fields, int32 words for the rest."""

    ids_at: int
    src_at: int  # async scheduling only (else equal to ids_at and unused)
    positions_at: int
    slots_at: int
    width_at: int
    cu_at: int
    context_at: int
    table_at: int


class PackedStep:
    def __init__(
        self,
        max_seqs: int,
        max_rows: int,
        max_blocks: int,
        device: torch.device,
        prev_token_base: Optional[int] = None,
    ) -> None:
        """`prev_token_base` (async scheduling): `token_src` values from it on name the previous
        step's samples (`forward_vars["prev_tokens"]`), values below it the step's own staged ids."""
        self.max_seqs, self.max_rows, self.max_blocks = max_seqs, max_rows, max_blocks
        self.prev_token_base = prev_token_base
        self._layouts: dict[tuple[int, int], _Layout] = {}
        last = self._layout(max_seqs, max_rows)
        nbytes = 8 * -(-(last.table_at + max_seqs * max_blocks) // 2)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._host64, self._host32 = (
            self.host.numpy().view(np.int64),
            self.host.numpy().view(np.int32),
        )
        self._device64, self._device32 = (
            self.device.view(torch.int64),
            self.device.view(torch.int32),
        )

    def _layout(self, seqs: int, rows: int) -> _Layout:
        layout = self._layouts.get((seqs, rows))
        if layout is None:
            ids_at = 0
            src_at = (
                rows if self.prev_token_base is not None else ids_at
            )  # token_src follows the ids
            positions_at = src_at + rows
            slots_at = positions_at + rows
            width_at = 2 * (slots_at + rows)  # the int32 words start where the int64 ones end
            cu_at = width_at + 1
            context_at = cu_at + seqs + 1
            table_at = context_at + seqs
            layout = _Layout(
                ids_at, src_at, positions_at, slots_at, width_at, cu_at, context_at, table_at
            )
            self._layouts[(seqs, rows)] = layout
        return layout

    def stage(self, inputs: Any, seqs: int, rows: int) -> None:
        """Write a step's `StepInputs`, padded to (seqs, rows), and start its one copy to the device."""
        if seqs > self.max_seqs or rows > self.max_rows:
            raise ValueError(
                f"PackedStep: a step of {seqs} sequences x {rows} rows exceeds the buffer "
                f"({self.max_seqs} x {self.max_rows})"
            )
        table = inputs.block_tables  # int32 [num_seqs, W]
        width = table.shape[1]
        if width > self.max_blocks:
            raise ValueError(
                f"PackedStep: block tables of {width} blocks exceed max_blocks {self.max_blocks}"
            )
        lay, h64, h32, n = self._layout(seqs, rows), self._host64, self._host32, inputs.num_tokens
        write_padded(h64[lay.ids_at : lay.ids_at + rows], inputs.input_ids, rows, 0)
        if self.prev_token_base is not None:
            write_padded(h64[lay.src_at : lay.src_at + rows], inputs.token_src, rows, 0)
        write_padded(h64[lay.positions_at : lay.positions_at + rows], inputs.positions, rows, 0)
        write_padded(h64[lay.slots_at : lay.slots_at + rows], inputs.slot_mapping, rows, -1)
        h32[lay.width_at] = width
        write_padded(h32[lay.cu_at : lay.cu_at + seqs + 1], inputs.cu_seqlens_q, seqs + 1, n)
        write_padded(h32[lay.context_at : lay.context_at + seqs], inputs.context_lens, seqs, 0)
        write_padded(
            h32[lay.table_at : lay.table_at + seqs * width].reshape(seqs, width), table, seqs, -1
        )
        nbytes = 4 * (lay.table_at + seqs * width)
        self.device[:nbytes].copy_(self.host[:nbytes], non_blocking=True)

    def unpack(self, forward_vars: dict[str, torch.Tensor], seqs: int, rows: int) -> None:
        """Unpack the staged step into the static buffers, and (async scheduling) gather the rows'
        input ids: one launch whose grid depends only on the bucket (recorded in request graphs)."""
        lay, fv = self._layout(seqs, rows), forward_vars
        is_async = self.prev_token_base is not None
        tables = fv["block_tables"]
        launch(  # kept per bucket; under compile_ahead its compile joins the pool
            unpack_step_kernel,
            (seqs + 1,),
            self._device64,
            self._device32,
            fv["input_ids"],
            fv["positions"],
            fv["slot_mapping"],
            fv["cu_seqlens_q"],
            fv["context_lens"],
            tables,
            fv["prev_tokens"] if is_async else fv["input_ids"],
            rows,
            seqs,
            tables.stride(0),
            lay.ids_at,
            lay.src_at,
            lay.positions_at,
            lay.slots_at,
            lay.width_at,
            lay.cu_at,
            lay.context_at,
            lay.table_at,
            self.prev_token_base or 0,
            ASYNC=is_async,
            BLOCK=UNPACK_BLOCK,
            num_warps=4,
        )


@dataclass(frozen=True)
class RunnerShape:
    """The sizes a runner's static buffers are allocated for."""

    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_tokens: int  # rows: the larger of the token budget and the largest capture bucket

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def step_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The static buffers of a step's token rows and attention metadata, sized for this
        shape: input ids, positions, slot_mapping, cu_seqlens_q, context_lens, block tables."""
        n, s = self.max_num_tokens, self.max_num_seqs
        return {
            "input_ids": torch.zeros(n, dtype=torch.int64, device=device),
            "positions": torch.zeros(n, dtype=torch.int64, device=device),
            "slot_mapping": torch.full((n,), -1, dtype=torch.int64, device=device),
            "cu_seqlens_q": torch.zeros(s + 1, dtype=torch.int32, device=device),
            "context_lens": torch.zeros(s, dtype=torch.int32, device=device),
            "block_tables": torch.full(
                (s, self.max_blocks_per_seq), -1, dtype=torch.int32, device=device
            ),
        }


class StepBuffers:
    def __init__(
        self,
        shape: RunnerShape,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tokens: Optional[TokenPool],
        packed_bucket: int,
        max_q_len: int = 1,
    ) -> None:
        """`tokens`: the token pool (async scheduling, a draft model: rows gather their ids from
        it); `packed_bucket`: the largest request-graph bucket that steps are staged packed for (0:
        none), each sequence running `max_q_len` rows."""
        n = shape.max_num_tokens
        self.tokens = tokens
        self.forward_vars: dict[str, torch.Tensor] = {
            **shape.step_inputs(device),
            "logits_indices": torch.zeros(n, dtype=torch.int64, device=device),
            "outputs": torch.zeros(n, hidden_size, dtype=dtype, device=device),
        }
        if tokens is not None:
            self.forward_vars["staged_ids"] = tokens.staged_ids
            self.forward_vars["prev_tokens"] = tokens.prev_tokens
            self.forward_vars["token_src"] = torch.zeros(n, dtype=torch.int64, device=device)
        self._staging = {
            k: v.cpu().pin_memory() if device.type == "cuda" else v
            for k, v in self.forward_vars.items()
            if k not in ("outputs", "prev_tokens")
        }
        # The pinned staging buffers are rewritten every step. Under async scheduling the host may
        # stage step N+1 before step N's copies ran, so it first waits for this event (recorded once
        # a step's copies are queued). Synchronously it has already waited for step N's tokens.
        self._staging_read = (
            torch.cuda.Event() if device.type == "cuda" and tokens is not None else None
        )
        self.packed: Optional[PackedStep] = None
        if device.type == "cuda" and packed_bucket:
            prev_base = tokens.prev_base if tokens is not None else None
            self.packed = PackedStep(
                packed_bucket,
                packed_bucket * max_q_len,
                shape.max_blocks_per_seq,
                device,
                prev_base,
            )
        self._staged: Optional[tuple[int, int]] = (
            None  # (seqs, rows) of the step last staged packed
        )

    def fill(self, name: str, values: np.ndarray, length: int, pad: Any) -> None:
        """forward_vars[name][:length] = values, then `pad` (rows of a 2-D buffer alike)."""
        staging = self._staging[name]
        write_padded(staging.numpy(), values, length, pad)
        if staging is not self.forward_vars[name]:
            self.forward_vars[name][:length].copy_(staging[:length], non_blocking=True)

    def prepare(
        self, inputs: StepInputs, decision: ForwardDecision
    ) -> tuple[AttentionMetaData, Context]:
        """Copy the step into the static buffers (padding rows zeroed, padded slots -1) and return
        its attention metadata and context, views of those buffers sized by the decision."""
        n, bs = inputs.num_tokens, inputs.num_seqs
        rows = max(decision.running_tokens, n)
        # a request bucket (a request graph, or a token graph replaying its region graphs): the
        # bucket's sequences, graph-safe; else the step's own
        seqs = decision.running_bs if decision.req_key is not None else bs
        if self.tokens is not None and inputs.token_src is None:  # every row's token is staged
            inputs.token_src = self.tokens.own_rows[:n]
        if self._staging_read is not None:
            self._staging_read.synchronize()
        if self.packed is not None and decision.req_key is not None:
            self.packed.stage(inputs, seqs, rows)
            self._staged = (seqs, rows)
        else:
            self._fill_each(inputs, seqs, rows)
        return self._metadata(inputs, decision, seqs, rows), self._context(decision, bs, rows)

    def _fill_each(self, inputs: StepInputs, seqs: int, rows: int) -> None:
        if self.tokens is not None:
            self.fill("staged_ids", inputs.input_ids, rows, 0)
            self.fill("token_src", inputs.token_src, rows, 0)
        else:
            self.fill("input_ids", inputs.input_ids, rows, 0)
        self.fill("positions", inputs.positions, rows, 0)
        self.fill("slot_mapping", inputs.slot_mapping, rows, -1)
        self.fill("cu_seqlens_q", inputs.cu_seqlens_q, seqs + 1, inputs.num_tokens)
        self.fill("context_lens", inputs.context_lens, seqs, 0)
        self.fill("block_tables", inputs.block_tables, seqs, -1)

    def _metadata(
        self, inputs: StepInputs, decision: ForwardDecision, seqs: int, rows: int
    ) -> AttentionMetaData:
        fv = self.forward_vars
        return AttentionMetaData(
            cu_seqlens_q=fv["cu_seqlens_q"][: seqs + 1],
            context_lens=fv["context_lens"][:seqs],
            block_tables=fv["block_tables"][:seqs],
            slot_mapping=fv["slot_mapping"][:rows],
            max_seqlen_q=max(
                inputs.max_seqlen_q, 1 + decision.draft_num if not decision.is_prefill else 0
            ),
            max_seqlen_k=inputs.max_seqlen_k,
            num_seqs=seqs,
            num_tokens=inputs.num_tokens,
            cu_seqlens_q_cpu=inputs.cu_seqlens_q.tolist(),
            context_lens_cpu=inputs.context_lens.tolist(),
            graph_safe=decision.req_key is not None,
        )

    def _context(self, decision: ForwardDecision, bs: int, rows: int) -> Context:
        return Context(
            positions=self.forward_vars["positions"][:rows],
            is_prefill=decision.is_prefill,
            batch_size=bs,
            running_bs=decision.running_bs,
            running_tokens=rows,
        )

    def logits_indices(self, inputs: StepInputs) -> Union[torch.Tensor, slice]:
        """The rows whose logits the step samples (with drafts: their rows too): a slice when every
        row samples (decode)."""
        rows = inputs.sample_rows if inputs.logits_rows is None else inputs.logits_rows
        num_sampled = int(rows.shape[0])
        if num_sampled == inputs.num_tokens:
            return slice(0, num_sampled)
        self.fill("logits_indices", rows, num_sampled, 0)
        return self.forward_vars["logits_indices"][:num_sampled]

    def staged(self) -> None:
        """The step's copies are queued: the next step may rewrite the staging once they ran."""
        if self._staging_read is not None:
            self._staging_read.record()

    def check_staged(self, decision: ForwardDecision, rows: int) -> None:
        """A request graph unpacks the packed step: it must be this bucket's."""
        if self.packed is not None and self._staged != (decision.running_bs, rows):
            raise RuntimeError(
                f"request graph {decision.req_key} replayed without its step staged by prepare() "
                f"(staged: {self._staged}); it would unpack another bucket's layout"
            )

    def unpack(self, seqs: int, rows: int) -> None:
        """The device half of staging, recorded at the head of request graphs: unpack the packed
        step (which gathers the rows' tokens too, under async scheduling), else only the gather."""
        if self.packed is not None:
            self.packed.unpack(self.forward_vars, seqs, rows)
        else:
            self.gather_input_ids(rows)

    def gather_input_ids(self, rows: int) -> None:
        """input_ids[:rows] = token pool[token_src[:rows]] (async scheduling; else a no-op)."""
        if self.tokens is not None:
            fv = self.forward_vars
            torch.index_select(
                self.tokens.pool, 0, fv["token_src"][:rows], out=fv["input_ids"][:rows]
            )

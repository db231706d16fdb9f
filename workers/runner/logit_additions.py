# Hot path (worker, steps whose rows ask for it): sparse per-row changes to the logits before
# penalties and temperature. What may live here: building them from the rows' sampling parameters
# and applying them; nothing runs for a step whose rows ask for none.
"""`LogitAdditions`: what a step's rows add to their logits before anything else in sampling.

- `logit_bias` (OpenAI's and vLLM's): a value added to each listed token's logit.
- `allowed_token_ids` (vLLM's): every token outside the list is masked (-inf).
- bad words (vLLM's `bad_words`, tokenized by the driver): a word of one token is always masked; the
  last token of a longer word is masked where the output so far ends with the word's other tokens.

They are built on the host from each row's parameters (a bias and a ban are one sparse (row, token,
value) list; the allowed lists a second one) and applied with one `index_put_` and, for rows with an
allowed list, one masked fill of those rows alone. They are kept per row so that a subset of the
step's rows (`select`), or each row repeated over its verify rows (`repeat`, speculative decoding),
gets the same changes.

A structured-output row's grammar mask (`apply_grammar_bitmask`) is one more: packed int32 rows
filled by the driver, applied on the sampling worker to the step's logits rows that a grammar
constrains before anything else in sampling, outside the recorded graphs.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Optional

import torch

from atomrt.workers.kernels.grammar_mask import apply_grammar_mask
from atomrt.workers.kernels.launch import triton_runs_on


@dataclass(frozen=True)
class RowAdditions:
    """One row's changes: `values` added at `token_ids` (-inf masks), and an allowed list."""

    token_ids: tuple[int, ...] = ()
    values: tuple[float, ...] = ()
    allowed: Optional[tuple[int, ...]] = None


def row_additions(params: Any, output_token_ids: Seq[int]) -> Optional[RowAdditions]:
    """The changes a row's `WorkerSamplingParams` ask for, given its output so far (bad words of
    several tokens read its end); None when it asks for none."""
    if not params.changes_logits:
        return None
    ids: list[int] = []
    values: list[float] = []
    for token_id, value in (params.logit_bias or {}).items():
        ids.append(int(token_id))
        values.append(float(value))
    for word in params.bad_words_token_ids or ():
        head = list(word[:-1])
        if not head or list(output_token_ids[len(output_token_ids) - len(head) :]) == head:
            ids.append(int(word[-1]))
            values.append(float("-inf"))
    allowed = params.allowed_token_ids
    return RowAdditions(tuple(ids), tuple(values), tuple(allowed) if allowed else None)


class LogitAdditions:
    """A step's rows' changes (None for a row without any), applied by `apply`."""

    def __init__(self, rows: list[Optional[RowAdditions]]) -> None:
        self.rows = rows
        self._tensors: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    @classmethod
    def build(cls, params: Seq[Any], output_token_ids: Seq[Seq[int]]) -> Optional[LogitAdditions]:
        """None when no row asks for any (the common step: nothing is built)."""
        if not any(p.changes_logits for p in params):
            return None
        return cls([row_additions(p, out) for p, out in zip(params, output_token_ids)])

    def select(self, idx: Seq[int]) -> LogitAdditions:
        """Rows `idx` of the step, in that order."""
        return LogitAdditions([self.rows[int(i)] for i in idx])

    def repeat(self, counts: Seq[int]) -> LogitAdditions:
        """Row i repeated counts[i] times (a request's verify rows share its changes)."""
        return LogitAdditions([r for r, c in zip(self.rows, counts) for _ in range(int(c))])

    def _device_tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        cached = self._tensors.get(device)
        if cached is not None:
            return cached
        rows, ids, values = [], [], []
        allowed_rows, allowed_at, allowed_ids = [], [], []
        for i, r in enumerate(self.rows):
            if r is None:
                continue
            rows += [i] * len(r.token_ids)
            ids += r.token_ids
            values += r.values
            if r.allowed is not None:
                allowed_at += [len(allowed_rows)] * len(r.allowed)
                allowed_rows.append(i)
                allowed_ids += r.allowed
        long = dict(dtype=torch.int64, device=device)
        tensors = (
            torch.tensor(rows, **long),
            torch.tensor(ids, **long),
            torch.tensor(values, dtype=torch.float32, device=device),
            torch.tensor(allowed_rows, **long),
            torch.tensor(allowed_at, **long),
            torch.tensor(allowed_ids, **long),
        )
        self._tensors[device] = tensors
        return tensors

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """In place on float32 logits [len(rows), vocab]; returns them."""
        rows, ids, values, allowed_rows, allowed_at, allowed_ids = self._device_tensors(
            logits.device
        )
        if allowed_rows.numel():
            keep = torch.zeros(
                allowed_rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device
            )
            keep[allowed_at, allowed_ids] = True  # [rows with a list, vocab]
            logits[allowed_rows] = logits[allowed_rows].masked_fill(~keep, float("-inf"))
        if rows.numel():
            logits.index_put_((rows, ids), values, accumulate=True)
        return logits


# the device logits' grammar masks by one Triton kernel (workers/kernels/grammar_mask.py) rather
# than the torch arithmetic (`apply_bits`; benchmarks/bench_grammar_apply.py times both): with
# structured_outputs.FILL_ON_THREAD, on an H100 host it took constrained serving from 0.469 to
# 0.560 of unconstrained at c=64
GRAMMAR_MASK_KERNEL = True


def apply_grammar_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """Logits [n, vocab] in float32 (in place when they are float32 already: a step's logits are
    read once) whose rows `rows` (int64 [m]) keep only the tokens their packed mask allows:
    bitmask int32 [m, words], bit `t % 32` of word `t // 32` set for an allowed token `t`;
    tokens past the mask's words are masked. On CPU, xgrammar's kernel (a fraction of the torch
    arithmetic's time at decode sizes)."""
    out = logits if logits.dtype == torch.float32 else logits.float()
    width = min(out.shape[1], bitmask.shape[1] * 32)
    if out.device.type == "cpu" and out.is_contiguous():
        import xgrammar  # the driver's grammar library: only a step with masks comes here

        full = bitmask  # xgrammar reads the mask of row i from row i
        if bitmask.shape[0] != out.shape[0]:
            full = torch.full((out.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
            full[rows] = bitmask
        xgrammar.apply_token_bitmask_inplace(
            out, full.contiguous(), vocab_size=width, indices=rows.tolist()
        )
    elif GRAMMAR_MASK_KERNEL and out.stride(1) == 1 and triton_runs_on(out):
        apply_grammar_mask(out, rows, bitmask)
        return out  # the tokens past the mask's words too
    else:
        apply_bits(out, rows, bitmask)
    if width < out.shape[1]:
        out[rows, width:] = float("-inf")
    return out


def apply_bits(out: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """`apply_grammar_bitmask` in torch arithmetic, in place on float32 `out`."""
    width = min(out.shape[1], bitmask.shape[1] * 32)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [m, words, 32]
    masked = bits.reshape(bits.shape[0], -1)[:, :width] == 0  # [m, width]
    sub = out.index_select(0, rows)
    sub[:, :width].masked_fill_(masked, float("-inf"))
    out.index_copy_(0, rows, sub)


def greedy_under_grammar(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """Plain greedy tokens of logits [n, vocab] whose rows `rows` follow packed masks: a row whose
    argmax its mask allows keeps it (the masked argmax is the same token), the others take the
    argmax of their masked logits. Masks only the rows that need it; reads which ones on the
    host, so it is for CPU steps."""
    tokens = logits.argmax(dim=-1)
    words = bitmask.shape[1]
    t = tokens[rows]
    word = bitmask.gather(1, (t // 32).clamp_max(words - 1).unsqueeze(1)).squeeze(1)
    allowed = (((word >> (t % 32).to(torch.int32)) & 1) == 1) & (t < 32 * words)
    bad = torch.nonzero(~allowed).flatten()
    if bad.numel():
        sub = logits.index_select(0, rows[bad]).to(torch.float32)
        apply_grammar_bitmask(sub, torch.arange(bad.numel()), bitmask[bad])
        tokens[rows[bad]] = sub.argmax(dim=-1)
    return tokens

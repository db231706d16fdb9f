# Hot path (worker, once per step with speculative decoding): the two calls the model runner makes,
# `prepare` before the target's forward and `sample` after it. What may live here: routing a step's
# rows to the draft model, the sampler and the rejection sampler, and packing what they emit.
"""`Speculator`: one rank's side of speculative decoding (`speculative_config`). The method's own
work is its worker proposer's (`WorkerProposer`, workers/spec_decode/proposer.py; one class per
method, `WORKER_PROPOSERS`); what every method shares is here.

- `prepare`: the proposer's `prepare` runs first (a draft model fills the step's draft rows in
  the runner's token pool; an MTP drafter stages what its passes need; n-gram drafts come in the
  plan). Returns the step's `SpecDecodeMetadata` (None when no row verifies drafts), which the
  target's forward context holds.
- `sample`: requests without drafts sample their row with the sampler (penalties, logprobs and
  all); requests with drafts are verified by the rejection sampler against the target's logits of
  their rows. The step's tokens leave packed, `width = k + 2` int64 per sampled request:
  `[drafts accepted m, token 0, ..., token m, -1 ...]`; `unpack` turns them into token lists.
  A plain greedy step (every request greedy, no penalties, no logprobs) verifies on a layout
  staged before the forward: a handful of kernels and no wait on the host after it.
- `draft_next`: a method that drafts after sampling (MTP: the target's own MTP layers, on every
  rank) drafts each sampled request's next `next_drafts` tokens from the step's hidden states and
  tokens; the drafts ride after the request's tokens (`readback_width = width + next_drafts`),
  and `unpack_drafts` takes them.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from atomrt.distributed.communication_op import DPInfo, TPInfo
from atomrt.runtime.config import Config
from atomrt.runtime.forward_context import SpecDecodeMetadata
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingTensors,
    greedy_argmax,
)
from atomrt.workers.runner.step_buffers import RunnerShape
from atomrt.workers.runner.token_pool import TokenPool
from atomrt.workers.spec_decode.draft_model import DraftModelWorkerProposer
from atomrt.workers.spec_decode.mtp import MTPWorkerProposer
from atomrt.workers.spec_decode.ngram import NgramWorkerProposer
from atomrt.workers.spec_decode.proposer import (
    ProposerSetup,
    StepToDraft,
    TargetStep,
    WorkerProposer,
)
from atomrt.workers.spec_decode.rejection_sampler import rejection_sample, select_rows

WORKER_PROPOSERS: dict[str, type[WorkerProposer]] = {
    cls.method: cls for cls in (NgramWorkerProposer, DraftModelWorkerProposer, MTPWorkerProposer)
}


def make_worker_proposer(setup: ProposerSetup) -> WorkerProposer:
    """The worker half of `speculative_config.method` (validated by SpeculativeConfig)."""
    return WORKER_PROPOSERS[setup.config.speculative_config.method](setup)


class Speculator:
    def __init__(
        self,
        config: Config,
        device: torch.device,
        dtype: torch.dtype,
        tp: TPInfo,
        shape: RunnerShape,
        graphs_enabled: bool,
        model: Optional[torch.nn.Module] = None,
        dp: DPInfo = DPInfo(),
    ) -> None:
        """`shape`: the runner's RunnerShape (buffer sizes); `model`: the target. The method's
        worker half (`proposer`) is built from these."""
        spec = config.speculative_config
        assert spec is not None
        self.k = spec.num_speculative_tokens
        self.width = self.k + 2
        self.device = device
        self.proposer = make_worker_proposer(
            ProposerSetup(config, device, dtype, tp, dp, shape, graphs_enabled, model)
        )

    @property
    def readback_width(self) -> int:
        """int64 values a sampled request reads back: its packed tokens, then its next drafts."""
        return self.width + self.proposer.next_drafts

    @property
    def drafts_in_pool(self) -> bool:
        """Whether the step's draft rows read their ids from the token pool (which must exist)."""
        return self.proposer.drafts_in_pool

    @property
    def drafts_after_sample(self) -> bool:
        """Whether the method drafts after sampling (`draft_next`, from the step's `TargetStep`)."""
        return self.proposer.next_drafts > 0

    # ---------------------------------------------------------------- set-up

    def attention_layers(self) -> dict:
        """The method's own layers' attention, which run with the target's (`WorkerProposer`)."""
        return self.proposer.attention_layers()

    def kv_bytes_per_block(self) -> int:
        return self.proposer.kv_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.proposer.allocate_kv_cache(num_blocks)

    def capture(self, runner: object, sizes: list[int]) -> None:
        """Record the method's DraftGraphs (after the target's: `runner` stages an MTP drafter's
        first pass as the target's steps)."""
        self.proposer.capture(runner, sizes)

    def take_eager_passes(self) -> int:
        """Draft passes that ran eagerly with graphs on since the last call."""
        return self.proposer.take_eager_passes()

    def take_draft_seconds(self) -> float:
        """Seconds of draft passes since the last call (steps whose tokens are back)."""
        return self.proposer.timer.take()

    # ---------------------------------------------------------------- one step

    def prepare(
        self,
        inputs: StepInputs,
        sampling: SamplingTensors,
        tokens: TokenPool | None,
        logits_indices: object,
        decision: object = None,
    ) -> SpecDecodeMetadata | None:
        """The proposer's `prepare` (a draft model fills the draft rows, which read
        `tokens.draft_tokens` at their row; an MTP drafter stages its passes' host data), then
        the step's drafts described; None when no row verifies any. `decision`: the step's
        ForwardDecision."""
        draft_probs = self.proposer.prepare(StepToDraft(inputs, sampling, tokens, decision))
        if inputs.num_draft_tokens is None:
            return None
        k_s = inputs.num_draft_tokens[inputs.sample_seq_idx]
        ends = inputs.cu_seqlens_q[1:][inputs.sample_seq_idx].astype(np.int64)
        draft_rows = np.repeat(ends - k_s, k_s) + (
            np.arange(int(k_s.sum())) - np.repeat(np.cumsum(k_s) - k_s, k_s)
        )
        if sampling.is_plain_greedy:
            return self._greedy_layout(inputs, tokens, k_s, draft_rows, logits_indices)
        if self.proposer.drafts_in_pool:
            draft_token_ids = tokens.draft_tokens[self._index(draft_rows)]
        else:
            draft_token_ids = self._index(inputs.input_ids[draft_rows])
        return SpecDecodeMetadata(
            draft_token_ids=draft_token_ids,
            num_draft_tokens=k_s.tolist(),
            logits_indices=logits_indices,
            draft_probs=draft_probs,
        )

    def _greedy_layout(
        self,
        inputs: StepInputs,
        tokens: TokenPool | None,
        k_s: np.ndarray,
        draft_rows: np.ndarray,
        logits_indices: object,
    ) -> SpecDecodeMetadata:
        """A plain greedy step's metadata: the verify layout (`SpecDecodeMetadata.greedy_rows`,
        `greedy_drafts`) built here and copied once, so `sample` launches a few kernels on
        device tensors and waits for nothing. Draft-model drafts are read on the device."""
        n, k = k_s.shape[0], self.k
        pos = np.arange(k + 1)
        starts = np.cumsum(k_s + 1) - (k_s + 1)  # each sequence's first logits row
        layout = np.empty((n, 2 * k + 1), dtype=np.int64)
        layout[:, : k + 1] = starts[:, None] + np.minimum(pos[None, :], k_s[:, None])
        has = pos[None, :k] < k_s[:, None]  # [n, k]: position i holds a draft
        drafts = layout[:, k + 1 :]
        drafts.fill(-1)
        # a draft's row in the step, or (n-gram) the draft token itself
        in_pool = self.proposer.drafts_in_pool
        drafts[has] = draft_rows if in_pool else inputs.input_ids[draft_rows]
        staged = torch.from_numpy(layout).to(self.device, non_blocking=True)
        rows, drafts_t = staged[:, : k + 1], staged[:, k + 1 :]
        if in_pool:
            at = drafts_t.clamp_min(0)
            drafts_t = torch.where(drafts_t >= 0, tokens.draft_tokens[at], -1)
        return SpecDecodeMetadata(
            num_draft_tokens=k_s.tolist(),
            logits_indices=logits_indices,
            greedy_rows=rows,
            greedy_drafts=drafts_t,
        )

    def _sample_greedy(
        self, logits: torch.Tensor, argmax: torch.Tensor | None, spec: SpecDecodeMetadata
    ) -> SamplerOutput:
        """Greedy verification on the staged layout: a sequence accepts its drafts up to the
        first that differs from the target's argmax and emits the argmax of every row up to it
        (the accepted drafts, then the correction or the bonus token): the tokens greedy decoding
        without drafts gives."""
        k = self.k
        target = argmax if argmax is not None else greedy_argmax(logits)
        am = target[spec.greedy_rows]  # [n, k + 1]
        matched = (am[:, :k] == spec.greedy_drafts).to(torch.int64)  # a -1 never matches
        m = matched.cumprod(dim=1).sum(dim=1, keepdim=True)  # [n, 1]: drafts accepted
        pos = torch.arange(k + 1, device=am.device)
        emitted = torch.where(pos <= m, am, -1)
        return SamplerOutput(torch.cat([m, emitted], dim=1).flatten(), None)

    def sample(
        self,
        logits: torch.Tensor,
        argmax: torch.Tensor | None,
        sampling: SamplingTensors,
        sampler: Sampler,
        spec: SpecDecodeMetadata | None,
    ) -> SamplerOutput:
        """The step's tokens, packed (see the module docstring). `logits`: the sampled rows (each
        sampled request's drafts' rows and the row before: `spec.logits_indices`), `argmax` their
        argmax when a request graph recorded it; `spec`: `prepare`'s metadata."""
        if spec is None:
            return self._sample_plain(logits, argmax, sampling, sampler)
        if spec.greedy_rows is not None:
            return self._sample_greedy(logits, argmax, spec)
        n = len(sampling.seeds)
        packed = torch.full((n, self.width), -1, dtype=torch.int64, device=logits.device)
        packed[:, 0] = 0
        k_s = np.asarray(spec.num_draft_tokens, dtype=np.int64)
        counts = k_s + 1
        starts = np.cumsum(counts) - counts  # each request's first logits row
        plain, verify = np.flatnonzero(k_s == 0), np.flatnonzero(k_s > 0)
        logprobs = None
        if plain.size:
            sub = sampling if plain.size == n else select_rows(sampling, plain)
            rows = logits if plain.size == logits.shape[0] else logits[self._index(starts[plain])]
            out = sampler(rows, sub)
            packed[self._index(plain), 1] = out.sampled_token_ids
            if out.logprobs is not None:
                logprobs = _spread(out.logprobs, plain, n, self.device)
        if verify.size:
            rows = np.concatenate(
                [np.arange(s, s + c) for s, c in zip(starts[verify], counts[verify])]
            )
            idx = self._index(rows)
            sub = select_rows(sampling, verify) if verify.size < n else sampling
            target, target_argmax = logits[idx], argmax[idx] if argmax is not None else None
            if sub.additions is not None:  # logit_bias and kin: on every verify row too
                target = sub.additions.repeat(counts[verify]).apply(target.float())
                target_argmax = None
            res = rejection_sample(
                target,
                spec.draft_token_ids,
                k_s[verify].tolist(),
                sub,
                draft_probs=spec.draft_probs,
                target_argmax=target_argmax,
            )
            v = self._index(verify)
            packed[v, 0] = res.num_accepted
            packed[v, 1 : res.tokens.shape[1] + 1] = res.tokens
        return SamplerOutput(packed.flatten(), logprobs)

    def _sample_plain(
        self,
        logits: torch.Tensor,
        argmax: torch.Tensor | None,
        sampling: SamplingTensors,
        sampler: Sampler,
    ) -> SamplerOutput:
        """A step without drafts: each request's one row sampled as without speculation (the
        request graph's argmax for a plain greedy step), packed with 0 drafts accepted. No index
        tensor is copied from the host, which would wait for the forward: the next step may be
        launched while this one runs, as async scheduling does without speculation."""
        n = len(sampling.seeds)
        if argmax is not None and sampling.is_plain_greedy:
            out = SamplerOutput(argmax[:n])
        else:
            out = sampler(logits[:n], sampling)
        packed = torch.full((n, self.width), -1, dtype=torch.int64, device=logits.device)
        packed[:, 0] = 0
        packed[:, 1] = out.sampled_token_ids
        return SamplerOutput(packed.flatten(), out.logprobs)

    def draft_next(
        self, step: TargetStep, sampled: Optional[SamplerOutput], sampling: SamplingTensors
    ) -> Optional[SamplerOutput]:
        """A method that drafts after sampling (MTP): draft each sampled request's next tokens and
        append them to its packed tokens (`readback_width` each). `sampled`: `sample`'s output
        (None on an idle DP rank, which runs the passes all the same). Otherwise `sampled` as it
        is."""
        if not self.drafts_after_sample:
            return sampled
        packed = None
        if sampled is not None:
            packed = sampled.sampled_token_ids.view(-1, self.width)
        drafts = self.proposer.after_sample(step, packed, sampling)
        if sampled is None:
            return None
        return SamplerOutput(torch.cat([packed, drafts], dim=1).flatten(), sampled.logprobs)

    def unpack(self, flat: list[int]) -> list[list[int]]:
        """Per sampled request, the tokens it emitted (from `sample`'s packing)."""
        w = self.readback_width
        return [flat[i + 1 : i + 2 + flat[i]] for i in range(0, len(flat), w)]

    def unpack_drafts(self, flat: list[int]) -> list[int]:
        """Every sampled request's drafts for its next step, in turn ([] for a method that drafts
        none after sampling)."""
        w, k = self.readback_width, self.proposer.next_drafts
        if not k:
            return []
        return [x for i in range(0, len(flat), w) for x in flat[i + self.width : i + w]]

    def _index(self, a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.int64, device=self.device)


def _spread(lp: LogprobsTensors, rows: np.ndarray, n: int, device: torch.device) -> LogprobsTensors:
    """Logprobs of some requests, placed at their rows of the step's `n` (zeros elsewhere)."""
    at = torch.as_tensor(rows, dtype=torch.int64, device=device)

    def place(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
        out[at] = x
        return out

    return LogprobsTensors(
        place(lp.sampled_logprobs), place(lp.top_token_ids), place(lp.top_logprobs)
    )

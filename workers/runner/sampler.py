"""`Sampler`: one batched pass from logits [num_seqs, vocab] float32 to sampled token ids.

Hot path. Order per row: the row's logit additions (logit_bias, allowed_token_ids, bad words:
logit_additions.py) -> penalties (repetition over prompt + output, Hugging Face semantics;
presence/frequency over output, OpenAI semantics) -> temperature -> top-k -> top-p (on the
top-k-renormalized distribution) -> min-p -> sample. Greedy rows (temperature 0) take the argmax of
the penalized logits. Sampling is an exponential race, argmax(probs / q) with q ~ Exp(1), which
draws from probs exactly; a seeded row draws its q from its own torch.Generator seeded with
(seed, number of output tokens so far), so its tokens do not depend on the batch it is in and
are the same on every TP rank.

Logprobs (rows with `logprobs` set) are the log-softmax of the logits after additions, penalties
and temperature (temperature 1 for greedy rows), BEFORE top-k/top-p/min-p truncation: a filtered
alternative keeps a finite logprob.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Optional

import torch

from atomrt.workers.kernels.argmax import argmax_rows
from atomrt.workers.runner.logit_additions import LogitAdditions
from atomrt.workers.runner.prompt_logprobs import PromptLogprobsTensors

_MASK64 = (1 << 64) - 1
_F32_MAX = torch.finfo(torch.float32).max


def _mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): a well-spread 63-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _pad_2d(rows: Seq[Seq[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.int64)
    return out.to(device)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, as tensors on the sampling device."""

    temperatures: torch.Tensor  # [num_seqs] float32; 0 for greedy rows
    top_ps: torch.Tensor  # [num_seqs] float32
    top_ks: torch.Tensor  # [num_seqs] int64; vocab_size where disabled
    min_ps: torch.Tensor  # [num_seqs] float32
    repetition_penalties: torch.Tensor  # [num_seqs] float32
    presence_penalties: torch.Tensor  # [num_seqs] float32
    frequency_penalties: torch.Tensor  # [num_seqs] float32
    prompt_token_ids: torch.Tensor  # [num_seqs, max_prompt_len] int64, padded with vocab_size
    output_token_ids: torch.Tensor  # [num_seqs, max_output_len] int64, padded with vocab_size
    seeds: list[Optional[int]]  # per row; None: the default generator
    num_output_tokens: list[int]  # per row, for the seeded generators
    num_logprobs: list[Optional[int]]  # per row: how many top logprobs to return
    all_greedy: bool
    do_penalties: bool
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    additions: Optional[LogitAdditions] = None  # None: no row changes its logits
    # structured outputs: a grammar constrains some rows, whose masks only the sampling worker
    # applies (so the other TP ranks' tokens differ, and rank 0's are broadcast)
    constrained: bool = False

    @classmethod
    def from_params(
        cls,
        sampling_params: Seq[Any],
        prompt_token_ids: Seq[Seq[int]],
        output_token_ids: Seq[Seq[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        may_change_logits: bool = True,
    ) -> SamplingTensors:
        """Build from per-row SamplingParams and token histories (plain lists).
        `may_change_logits=False`: no row has logit additions (the worker knows it without
        looking at each row)."""
        device = torch.device(device)
        ps = list(sampling_params)
        greedy = [p.temperature < 1e-5 for p in ps]
        do_penalties = any(
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            for p in ps
        )
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in ps]
        additions = LogitAdditions.build(ps, output_token_ids) if may_change_logits else None
        if (
            all(greedy)
            and not do_penalties
            and additions is None
            and all(p.logprobs is None for p in ps)
        ):
            return cls.plain_greedy(len(ps), device)

        # One host tensor, one copy to the device: 6 float rows + top_k, viewed per parameter.
        host = torch.tensor(
            [
                [0.0 if g else p.temperature for p, g in zip(ps, greedy)],
                [p.top_p for p in ps],
                [p.min_p for p in ps],
                [p.repetition_penalty for p in ps],
                [p.presence_penalty for p in ps],
                [p.frequency_penalty for p in ps],
                [float(k) for k in top_ks],
            ],
            dtype=torch.float32,
        ).reshape(7, len(ps))
        dev = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        no_history: list[list[int]] = [[] for _ in ps]
        return cls(
            temperatures=dev[0],
            top_ps=dev[1],
            top_ks=dev[6].to(torch.int64),
            min_ps=dev[2],
            repetition_penalties=dev[3],
            presence_penalties=dev[4],
            frequency_penalties=dev[5],
            prompt_token_ids=_pad_2d(
                prompt_token_ids if do_penalties else no_history, vocab_size, device
            ),
            output_token_ids=_pad_2d(
                output_token_ids if do_penalties else no_history, vocab_size, device
            ),
            seeds=[p.seed for p in ps],
            num_output_tokens=[len(o) for o in output_token_ids],
            num_logprobs=[p.logprobs for p in ps],
            all_greedy=all(greedy),
            do_penalties=do_penalties,
            do_top_k=any(k < vocab_size for k, g in zip(top_ks, greedy) if not g),
            do_top_p=any(p.top_p < 1.0 for p, g in zip(ps, greedy) if not g),
            do_min_p=any(p.min_p > 0.0 for p, g in zip(ps, greedy) if not g),
            additions=additions,
        )

    @property
    def same_on_every_rank(self) -> bool:
        """Whether every TP rank samples the same tokens from the same logits (plain greedy
        arithmetic, no grammar mask): then no rank's tokens need to be broadcast."""
        return self.all_greedy and not self.do_penalties and not self.constrained

    @property
    def is_plain_greedy(self) -> bool:
        """Every row greedy, no penalties, no additions, no logprobs: the tokens are the logits'
        argmax."""
        return (
            self.all_greedy
            and not self.do_penalties
            and self.additions is None
            and all(k is None for k in self.num_logprobs)
        )

    @classmethod
    def plain_greedy(cls, num_seqs: int, device: torch.device) -> SamplingTensors:
        """Every row greedy, no penalties, no logprobs: the sampler takes the argmax and reads no
        per-row tensor, so none is built or copied (the common decode step). The empty tensors are
        made once per device (a CUDA tensor costs the host microseconds every step)."""
        empty, empty_long, no_ids = _empty_tensors(torch.device(device))
        return cls(
            temperatures=empty,
            top_ps=empty,
            top_ks=empty_long,
            min_ps=empty,
            repetition_penalties=empty,
            presence_penalties=empty,
            frequency_penalties=empty,
            prompt_token_ids=no_ids,
            output_token_ids=no_ids,
            seeds=[None] * num_seqs,
            num_output_tokens=[0] * num_seqs,
            num_logprobs=[None] * num_seqs,
            all_greedy=True,
            do_penalties=False,
            do_top_k=False,
            do_top_p=False,
            do_min_p=False,
        )

    @classmethod
    def from_sequences(
        cls, seqs: Seq[Any], vocab_size: int, device: torch.device | str = "cpu"
    ) -> SamplingTensors:
        """Build from objects with .sampling_params, .prompt_token_ids, .output_token_ids
        (runtime.sequence.Sequence)."""
        return cls.from_params(
            [s.sampling_params for s in seqs],
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            vocab_size,
            device,
        )


@dataclass
class LogprobsTensors:
    sampled_logprobs: torch.Tensor  # [num_seqs] float32: logprob of the sampled token
    top_token_ids: torch.Tensor  # [num_seqs, max_num_logprobs] int64, best first
    top_logprobs: torch.Tensor  # [num_seqs, max_num_logprobs] float32

    def to_dicts(
        self, num_logprobs: Seq[Optional[int]], sampled_token_ids: Seq[int]
    ) -> list[Optional[dict[int, float]]]:
        """Per row {token id: logprob}: the sampled token plus the row's top-`logprobs`
        alternatives; None for rows that asked for none. (One host copy.)"""
        sampled = self.sampled_logprobs.tolist()
        top_ids = self.top_token_ids.tolist()
        top_lps = self.top_logprobs.tolist()
        out: list[Optional[dict[int, float]]] = []
        for i, k in enumerate(num_logprobs):
            if k is None:
                out.append(None)
                continue
            row = {int(t): float(lp) for t, lp in zip(top_ids[i][:k], top_lps[i][:k])}
            row[int(sampled_token_ids[i])] = float(sampled[i])
            out.append(row)
        return out


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_seqs] int64
    logprobs: Optional[LogprobsTensors] = None  # when any row asked for logprobs
    # the step's prompt logprobs (prompt_logprobs.py), when a row with prompt rows asked for them
    prompt_logprobs: Optional[PromptLogprobsTensors] = None


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """In place on logits [num_seqs, vocab]; returns it."""
    num_seqs, vocab = logits.shape
    # Token occurrence tables with one spare column for the padding id (vocab).
    out_counts = torch.zeros(num_seqs, vocab + 1, dtype=logits.dtype, device=logits.device)
    out_counts.scatter_add_(
        1, t.output_token_ids, torch.ones_like(t.output_token_ids, dtype=logits.dtype)
    )
    out_counts = out_counts[:, :vocab]
    seen = torch.zeros(num_seqs, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, t.prompt_token_ids, True)
    seen = seen[:, :vocab] | (out_counts > 0)
    rep = t.repetition_penalties.unsqueeze(1).expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits -= t.frequency_penalties.unsqueeze(1) * out_counts
    logits -= t.presence_penalties.unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask (-inf) the tokens each row's top-k, then top-p, then min-p filter removes."""
    if t.do_top_k or t.do_top_p:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [num_seqs, vocab]
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        if t.do_top_k:
            sorted_logits = sorted_logits.masked_fill(ranks >= t.top_ks.unsqueeze(1), float("-inf"))
        if t.do_top_p:
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            top_ps = t.top_ps.unsqueeze(1)
            # Keep the best token always; rows with top_p 1 keep everything (cumsum may round past 1).
            drop = (mass_before > top_ps) & (ranks > 0) & (top_ps < 1.0)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    if t.do_min_p:
        probs = logits.softmax(dim=-1)
        threshold = t.min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def seeded_noise_(out: torch.Tensor, seed: int, position: int) -> torch.Tensor:
    """Fill `out` (one row, [vocab]) with the Exp(1) noise of a seeded request's output token at
    `position` (output tokens before it), from a generator seeded with (seed, position) alone:
    every place that draws that token (this sampler, the rejection sampler, a draft model) draws
    the same noise, whatever the batch and whether the step verifies drafts."""
    # One small generator per seeded row and token: seeded requests are rare, determinism is the point.
    g = torch.Generator(device=out.device)
    g.manual_seed(_mix_seed(seed, position))
    return out.exponential_(generator=g)


def _exponential_noise(
    probs: torch.Tensor, t: SamplingTensors, generator: Optional[torch.Generator]
) -> torch.Tensor:
    """q ~ Exp(1) of probs' shape; seeded rows from their own (seed, position) generator."""
    q = torch.empty_like(probs).exponential_(generator=generator)
    for i, seed in enumerate(t.seeds):
        if seed is not None:
            seeded_noise_(q[i], seed, t.num_output_tokens[i])
    return q.clamp_min_(1e-30)  # a zero draw would turn a masked token's 0 / 0 into NaN


_EMPTY: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _empty_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float32 [0], int64 [0], int64 [0, 0]) on `device`, shared: nothing ever writes them."""
    tensors = _EMPTY.get(device)
    if tensors is None:
        tensors = (
            torch.empty(0, device=device),
            torch.empty(0, dtype=torch.int64, device=device),
            torch.empty(0, 0, dtype=torch.int64, device=device),
        )
        _EMPTY[device] = tensors
    return tensors


class Sampler:
    def __call__(
        self, logits: torch.Tensor, t: SamplingTensors, generator: Optional[torch.Generator] = None
    ) -> SamplerOutput:
        return self.sample(logits, t, generator)

    def sample(
        self, logits: torch.Tensor, t: SamplingTensors, generator: Optional[torch.Generator] = None
    ) -> SamplerOutput:
        """logits [num_seqs, vocab] in float32 or the model's dtype (not modified); everything but
        the plain greedy argmax computes on a float32 copy. `generator` drives unseeded rows."""
        if t.is_plain_greedy:
            return SamplerOutput(sampled_token_ids=greedy_argmax(logits))  # the common greedy step
        logits = logits.to(torch.float32, copy=True)
        if t.additions is not None:
            t.additions.apply(logits)
        if t.do_penalties:
            logits = apply_penalties(logits, t)
        greedy_tokens = logits.argmax(dim=-1)
        greedy_rows = t.temperatures == 0
        scaled = logits / torch.where(
            greedy_rows, torch.ones_like(t.temperatures), t.temperatures
        ).unsqueeze(1)
        # a penalty or a low temperature may overflow float32: +inf would make the row's
        # softmax NaN (and the race pick token 0, allowed or not); the largest float keeps it
        scaled.clamp_(max=_F32_MAX)
        if t.all_greedy:
            tokens = greedy_tokens
        else:
            filtered = apply_top_k_top_p_min_p(scaled, t)
            probs = filtered.softmax(dim=-1)
            sampled = (probs / _exponential_noise(probs, t, generator)).argmax(dim=-1)
            tokens = torch.where(greedy_rows, greedy_tokens, sampled)
        logprobs = None
        wanted = [k for k in t.num_logprobs if k is not None]
        if wanted:
            lp = scaled.log_softmax(dim=-1)
            k = min(max(wanted), lp.shape[1])
            top = lp.topk(k, dim=-1)
            logprobs = LogprobsTensors(
                sampled_logprobs=lp.gather(1, tokens.unsqueeze(1)).squeeze(1),
                top_token_ids=top.indices,
                top_logprobs=top.values,
            )
        return SamplerOutput(sampled_token_ids=tokens, logprobs=logprobs)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The plain greedy step's tokens: torch.argmax's answer; on CUDA a Triton kernel that splits
    short batches' rows over several programs (kernels/argmax.py): a fraction of torch's GPU time
    at decode shapes for about twice its host time per launch (docs/perf.md, argmax)."""
    if logits.is_cuda and logits.dim() == 2 and logits.shape[1] > 0:
        return argmax_rows(logits)
    return logits.argmax(dim=-1)

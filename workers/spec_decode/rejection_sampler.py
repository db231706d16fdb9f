# Hot path (worker, once per verify step): turning the target's logits over a step's draft rows into
# the tokens each request emits. What may live here: the accept / reject arithmetic, batched.
"""The rejection sampler: verify each request's drafts against the target model's distribution.

A request that verifies `k` drafts `d_0..d_{k-1}` ran `k + 1` query rows (its last token, then the
drafts); row `i`'s logits give the target's distribution `p_i` of the token after row `i`'s input,
so draft `d_i` is judged by `p_i` and row `k` gives the bonus token.

- Greedy requests accept the longest prefix of drafts equal to the target's argmax, then emit the
  argmax at the first mismatch (or the bonus row's argmax): exactly the tokens greedy decoding
  without drafts would give.
- Sampled requests use rejection sampling (Leviathan et al., Chen et al.), which emits tokens
  distributed exactly as the target's: draft `d_i` drawn from `q_i` is accepted with probability
  `min(1, p_i(d_i) / q_i(d_i))`; at the first rejection the token is drawn from the residual
  `max(0, p_i - q_i)` renormalised; with every draft accepted, the bonus token is drawn from `p_k`.
  `q` is the draft model's distribution, or one-hot at the draft for proposers that draw no
  distribution (n-gram): then a draft is accepted with probability `p_i(d_i)` and a rejection
  draws from `p_i` without `d_i`.
- `p` is the request's own sampling distribution: its logit additions (applied to the rows by the
  caller), temperature, then top-k / top-p / min-p, as the sampler applies them
  (runner/sampler.py). Requests with penalties or logprobs do not speculate.
- A seeded sampled request is verified by coupling instead: its token at each position is the
  target's own draw `argmax(p_i / e_i)`, with the noise `e_i` the sampler would use for that
  output position (runner/sampler.py, `seeded_noise_`: seeded with (seed, position) alone), and
  a draft is accepted iff it equals that draw; at the first that does not, the draw is emitted.
  The tokens are distributed as `p` (a one-hot draft is accepted with probability `p_i(d_i)`, as
  above) and are exactly those the request samples without speculation: they depend on neither
  its batch, nor its own draft count, nor which of its steps verify drafts. A draft model draws
  a seeded request's drafts from `q` with the same noise (`argmax(q_i / e_i)`): a draft is then
  accepted with probability at least `(1 - TV) / (1 + TV)` (TV: the total variation distance of
  p and q), where rejection sampling reaches `1 - TV`; always when `q == p`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from atomrt.workers.runner.sampler import SamplingTensors, apply_top_k_top_p_min_p, seeded_noise_


@dataclass
class VerifyOutput:
    """What a verify step emits: `tokens[s, :num_accepted[s] + 1]` for request `s`."""

    tokens: torch.Tensor  # int64 [num_seqs, max_drafts + 1], -1 past each request's tokens
    num_accepted: torch.Tensor  # int64 [num_seqs]: drafts accepted (tokens emitted - 1)


def rows_sampling(t: SamplingTensors, repeats: torch.Tensor) -> SamplingTensors:
    """Per-row copies of the per-request parameters the distribution needs (temperature, top-k,
    top-p, min-p), request `s` repeated `repeats[s]` times."""
    rep = lambda x: x.repeat_interleave(repeats)  # noqa: E731
    return replace(
        t,
        temperatures=rep(t.temperatures),
        top_ps=rep(t.top_ps),
        top_ks=rep(t.top_ks),
        min_ps=rep(t.min_ps),
    )


def select_rows(t: SamplingTensors, idx: Any) -> SamplingTensors:
    """Requests `idx` (an int array) of a step's sampling tensors. The batch's flags are kept: a
    superset's are safe (a filter that removes nothing, a penalty of 0)."""
    if t.is_plain_greedy:
        return SamplingTensors.plain_greedy(len(idx), t.temperatures.device)
    i = torch.as_tensor(idx, dtype=torch.int64, device=t.temperatures.device)
    pick = lambda x: x[i] if x.numel() else x  # noqa: E731
    return replace(
        t,
        temperatures=pick(t.temperatures),
        top_ps=pick(t.top_ps),
        top_ks=pick(t.top_ks),
        min_ps=pick(t.min_ps),
        repetition_penalties=pick(t.repetition_penalties),
        presence_penalties=pick(t.presence_penalties),
        frequency_penalties=pick(t.frequency_penalties),
        prompt_token_ids=pick(t.prompt_token_ids),
        output_token_ids=pick(t.output_token_ids),
        seeds=[t.seeds[j] for j in idx],
        num_output_tokens=[t.num_output_tokens[j] for j in idx],
        num_logprobs=[t.num_logprobs[j] for j in idx],
        additions=t.additions.select(idx) if t.additions is not None else None,
    )


def target_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """float32 [rows, vocab]: each row's sampling distribution (rows of greedy requests: their
    temperature-1 softmax, which only a greedy comparison reads)."""
    temps = torch.where(t.temperatures == 0, torch.ones_like(t.temperatures), t.temperatures)
    scaled = logits.to(torch.float32) / temps.unsqueeze(1)
    return apply_top_k_top_p_min_p(scaled, t).softmax(dim=-1)


def _draws(
    shape_u: tuple[int, int],
    shape_e: tuple[int, int, int],
    sampling: SamplingTensors,
    num_draft_tokens: list[int],
    generator: Optional[torch.Generator],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [n, K] and Exp(1) noise [n, K + 1, vocab] from `generator`; a seeded request's
    noise at its `k_s + 1` positions is its own per output position (its uniforms go unused)."""
    u = torch.rand(shape_u, generator=generator, device=device)
    e = torch.empty(shape_e, device=device).exponential_(generator=generator)
    for s, seed in enumerate(sampling.seeds):
        if seed is not None:
            for i in range(num_draft_tokens[s] + 1):
                seeded_noise_(e[s, i], seed, sampling.num_output_tokens[s] + i)
    return u, e.clamp_min_(1e-30)


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    sampling: SamplingTensors,
    draft_probs: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    target_argmax: Optional[torch.Tensor] = None,
) -> VerifyOutput:
    """Verify a step's drafts (see the module docstring).

    target_logits: [sum(k_s + 1), vocab], request `s`'s `k_s + 1` rows in order, requests in
    `sampling`'s order; draft_token_ids: int64 [sum(k_s)]; num_draft_tokens: `k_s` per request
    (0: plain sampling of its one row); draft_probs: float [sum(k_s), vocab], the distribution each
    draft was drawn from, or None for one-hot drafts; target_argmax: int64 [sum(k_s + 1)], the
    logits' argmax when it is at hand (a request graph records it).
    """
    device = target_logits.device
    n = len(num_draft_tokens)
    K = max(num_draft_tokens, default=0)
    k = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)
    pos = torch.arange(K + 1, device=device)
    starts = torch.cumsum(k + 1, 0) - (k + 1)
    rows = starts.unsqueeze(1) + torch.minimum(pos.unsqueeze(0), k.unsqueeze(1))  # [n, K + 1]
    is_draft = pos[:K].unsqueeze(0) < k.unsqueeze(1)  # [n, K]
    if K:
        d_starts = torch.cumsum(k, 0) - k
        d_rows = d_starts.unsqueeze(1) + torch.minimum(
            pos[:K].unsqueeze(0), (k - 1).clamp_min(0).unsqueeze(1)
        )
        d_rows = d_rows.clamp_max(draft_token_ids.shape[0] - 1)  # a last request without drafts
        drafts = torch.where(is_draft, draft_token_ids[d_rows], -1)  # [n, K]
    else:
        d_rows = torch.zeros(n, 0, dtype=torch.int64, device=device)
        drafts = d_rows
    if target_argmax is None:
        target_argmax = target_logits.argmax(dim=-1)
    argmax = target_argmax[rows]  # [n, K + 1]
    accept = (argmax[:, :K] == drafts) & is_draft  # greedy
    emitted = argmax
    if not sampling.all_greedy:
        row_params = rows_sampling(sampling, k + 1)
        probs = target_probs(target_logits, row_params)[rows]  # [n, K + 1, vocab]
        safe = drafts.clamp_min(0).unsqueeze(-1)
        if draft_probs is None:  # one-hot at the draft
            q = torch.zeros_like(probs[:, :K]).scatter_(-1, safe, 1.0)
        else:
            q = draft_probs.to(torch.float32)[d_rows]
        q = q * is_draft.unsqueeze(-1)
        p_d = probs[:, :K].gather(-1, safe).squeeze(-1)
        q_d = q.gather(-1, safe).squeeze(-1)
        u, noise = _draws(
            (n, K), (n, K + 1, probs.shape[-1]), sampling, num_draft_tokens, generator, device
        )
        accept_sampled = (u * q_d < p_d) & is_draft
        residual = (probs[:, :K] - q).clamp_min(0.0)
        # p == q leaves no residual (and then no draft is ever rejected): fall back to p
        empty = residual.sum(-1, keepdim=True) <= 1e-12
        dist = torch.cat([torch.where(empty, probs[:, :K], residual), probs[:, K:]], dim=1)
        drawn = (dist / noise).argmax(
            dim=-1
        )  # [n, K + 1]: the residual's draw at each draft, then p_K's
        seeded = [seed is not None for seed in sampling.seeds]
        if any(seeded):  # coupled: the target's own draw at every position decides
            coupled = torch.tensor(seeded, device=device).unsqueeze(1)
            own = (probs / noise).argmax(dim=-1)  # [n, K + 1]
            accept_sampled = torch.where(coupled, (own[:, :K] == drafts) & is_draft, accept_sampled)
            drawn = torch.where(coupled, own, drawn)
        greedy = (sampling.temperatures == 0).unsqueeze(1)
        accept = torch.where(greedy, accept, accept_sampled)
        emitted = torch.where(greedy, argmax, drawn)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [n]
    m = num_accepted.unsqueeze(1)
    tokens = torch.where(pos.unsqueeze(0) == m, emitted, torch.full_like(emitted, -1))
    if K:
        tokens[:, :K] = torch.where(pos[:K].unsqueeze(0) < m, drafts, tokens[:, :K])
    return VerifyOutput(tokens=tokens, num_accepted=num_accepted)

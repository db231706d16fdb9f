"""The rejection sampler (workers/spec_decode/rejection_sampler.py) and the n-gram proposer.

- Exact cases: a perfect match accepts every draft and adds the bonus token; an early mismatch and
  several mismatches stop at the first one, emitting the target's token there; certain and
  impossible drafts under sampling.
- Seeded requests are verified by coupling: their tokens are the sampler's own for their seed and
  output position, whatever their drafts, draft count and batch; they follow the target's
  distribution, and a draft model's coupled drafts are accepted within the coupling's bounds.
- Statistics: over many draws with a 5-token vocabulary, the emitted tokens follow the target's
  distribution (a chi-square test that emitting the drafts unverified fails by a wide margin), for
  draft-model drafts (drawn from q) and for one-hot (n-gram) drafts.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from atomrt.runtime.sampling_params import SamplingParams
from atomrt.workers.runner.sampler import SamplingTensors
from atomrt.workers.spec_decode.ngram import ngram_propose
from atomrt.workers.spec_decode.rejection_sampler import rejection_sample

V = 5
CHI2_4_DOF_P9999 = 23.51  # the 0.9999 quantile of chi-square with 4 degrees of freedom


def _tensors(params: list[SamplingParams], outputs=None) -> SamplingTensors:
    outputs = outputs or [[] for _ in params]
    return SamplingTensors.from_params(params, [[1]] * len(params), outputs, V)


def _one_hot_logits(token_rows: list[int]) -> torch.Tensor:
    logits = torch.full((len(token_rows), V), -10.0)
    logits[torch.arange(len(token_rows)), torch.tensor(token_rows)] = 10.0
    return logits


GREEDY = SamplingParams(temperature=0.0)


def test_greedy_perfect_match_accepts_all_and_adds_the_bonus():
    # target argmax per row: 2, 3, 4, 1 (the last row is the bonus row)
    out = rejection_sample(
        _one_hot_logits([2, 3, 4, 1]), torch.tensor([2, 3, 4]), [3], _tensors([GREEDY])
    )
    assert out.num_accepted.tolist() == [3]
    assert out.tokens.tolist() == [[2, 3, 4, 1]]


def test_greedy_early_and_multiple_mismatches():
    logits = _one_hot_logits([2, 3, 4, 1] * 3)
    drafts = torch.tensor([0, 3, 4] + [2, 0, 0] + [2, 3, 0])  # mismatch at 0 / at 1 and 2 / at 2
    out = rejection_sample(logits, drafts, [3, 3, 3], _tensors([GREEDY] * 3))
    assert out.num_accepted.tolist() == [0, 1, 2]
    assert out.tokens.tolist() == [[2, -1, -1, -1], [2, 3, -1, -1], [2, 3, 4, -1]]


def test_ragged_requests_and_plain_rows():
    # request 0 verifies 2 drafts, request 1 none (one plain row), request 2 one draft
    logits = _one_hot_logits([1, 2, 3] + [4] + [0, 1])
    out = rejection_sample(logits, torch.tensor([1, 2, 3]), [2, 0, 1], _tensors([GREEDY] * 3))
    assert out.num_accepted.tolist() == [2, 0, 0]
    assert out.tokens.tolist() == [[1, 2, 3], [4, -1, -1], [0, -1, -1]]


def test_sampled_certain_and_impossible_drafts():
    hot = SamplingParams(temperature=1.0)
    # a target certain of its tokens accepts matching drafts whatever q says
    out = rejection_sample(
        _one_hot_logits([2, 3, 4]),
        torch.tensor([2, 3]),
        [2],
        _tensors([hot]),
        draft_probs=torch.full((2, V), 1.0 / V),
    )
    assert out.num_accepted.tolist() == [2] and out.tokens.tolist() == [[2, 3, 4]]
    # a draft the target gives probability ~0 is rejected, and the residual never emits it
    for seed in range(20):
        out = rejection_sample(
            _one_hot_logits([2, 3, 4]),
            torch.tensor([0, 3]),
            [2],
            _tensors([SamplingParams(temperature=1.0, seed=seed)]),
        )
        assert out.num_accepted.tolist() == [0] and out.tokens[0, 0].item() == 2


def _sampler_tokens(logits: torch.Tensor, params: SamplingParams, num_out: int) -> list[int]:
    """What the sampler draws, without speculation, at each of `logits`' rows for a request with
    `num_out` output tokens before the first row (one output token per row)."""
    from atomrt.workers.runner.sampler import Sampler

    return [
        int(
            Sampler()(
                logits[i : i + 1], _tensors([params], [[7] * (num_out + i)])
            ).sampled_token_ids
        )
        for i in range(logits.shape[0])
    ]


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_seeded_tokens_are_the_samplers_whatever_the_drafts_and_the_batch(proposer):
    """A seeded request's tokens under verification are the tokens the sampler draws for it without
    speculation, position by position: up to the first draft that differs from them, then that
    position's own. So they depend on neither its draft count, nor its drafts, nor its place in
    the batch, nor its neighbours' draft counts (the batch's largest K)."""
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    for trial in range(60):
        params = SamplingParams(
            temperature=rng.choice([0.6, 1.0, 1.5]), top_k=rng.choice([-1, 3]), seed=trial
        )
        num_out, k_s = rng.randrange(0, 9), rng.randrange(1, 5)
        logits = torch.randn(k_s + 1, V, generator=gen) * 2
        want = _sampler_tokens(logits, params, num_out)
        cut = rng.randrange(0, k_s + 1)  # drafts agree with the sampler's tokens before `cut`
        drafts = want[:k_s]
        if cut < k_s:
            drafts[cut] = (drafts[cut] + rng.randrange(1, V)) % V
        drafts = torch.tensor(drafts)
        others = [rng.randrange(0, 6) for _ in range(rng.randrange(0, 3))]  # neighbours' k
        place = rng.randrange(len(others) + 1)
        ks = others[:place] + [k_s] + others[place:]
        parts = [torch.randn(k + 1, V, generator=gen) for k in others]
        parts.insert(place, logits)
        other_drafts = [torch.randint(0, V, (k,), generator=gen) for k in others]
        other_drafts.insert(place, drafts)
        rows = [SamplingParams(temperature=1.0)] * len(others)
        rows.insert(place, params)
        outputs = [[] for _ in others]
        outputs.insert(place, [7] * num_out)
        draft_probs = None
        if proposer == "draft_model":
            draft_probs = torch.softmax(torch.randn(sum(ks), V, generator=gen), dim=-1)
        out = rejection_sample(
            torch.cat(parts),
            torch.cat(other_drafts),
            ks,
            _tensors(rows, outputs),
            draft_probs=draft_probs,
            generator=gen,
        )
        m = int(out.num_accepted[place])
        assert m == cut, (trial, m, cut)
        assert out.tokens[place, : m + 1].tolist() == want[: m + 1], trial


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("proposer", ["draft_model", "ngram"])
def test_emitted_tokens_follow_the_target_distribution(proposer):
    n = 40_000
    g = torch.Generator().manual_seed(1234)
    p0 = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])
    p1 = torch.tensor([0.05, 0.15, 0.30, 0.20, 0.30])
    bonus = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    q0 = torch.tensor([0.10, 0.10, 0.20, 0.30, 0.30])  # a poor drafter: far from p0
    q1 = torch.tensor([0.30, 0.30, 0.20, 0.10, 0.10])
    if proposer == "draft_model":
        d0 = torch.multinomial(q0, n, replacement=True, generator=g)
        d1 = torch.multinomial(q1, n, replacement=True, generator=g)
        draft_probs = torch.stack([q0, q1]).repeat(n, 1)  # [2n, V]
    else:  # n-gram drafts: one fixed guess each, no distribution
        d0, d1 = torch.full((n,), 3), torch.full((n,), 2)
        draft_probs = None
    logits = torch.stack([p0.log(), p1.log(), bonus.log()]).repeat(n, 1)  # [3n, V]
    drafts = torch.stack([d0, d1], dim=1).flatten()
    out = rejection_sample(
        logits,
        drafts,
        [2] * n,
        _tensors([SamplingParams(temperature=1.0)] * n),
        draft_probs=draft_probs,
        generator=g,
    )
    first = torch.bincount(out.tokens[:, 0], minlength=V).float()
    assert _chi2(first, p0) < CHI2_4_DOF_P9999, first
    accepted = out.num_accepted >= 1  # the first token was d0: the second follows p1
    second = torch.bincount(out.tokens[accepted, 1], minlength=V).float()
    assert second.sum() > 3000
    assert _chi2(second, p1) < CHI2_4_DOF_P9999, second
    # the test has power: emitting the drafts unverified fails it by far, and so does the common
    # bug of drawing a rejected position's token from p instead of the residual max(0, p - q)
    assert _chi2(torch.bincount(d0, minlength=V).float(), p0) > 100 * CHI2_4_DOF_P9999
    from_p = torch.multinomial(p0, n, replacement=True, generator=g)
    biased = torch.where(accepted, d0, from_p)
    assert _chi2(torch.bincount(biased, minlength=V).float(), p0) > 10 * CHI2_4_DOF_P9999


@pytest.mark.parametrize("proposer", ["draft_model", "ngram"])
def test_seeded_tokens_follow_the_target_distribution(proposer):
    """Coupled verification of seeded requests (one seed each): the emitted tokens follow p; a
    draft model's drafts drawn with the same noise (`argmax(q / e)`) are accepted as often as the
    Gumbel coupling promises, between (1 - TV) / (1 + TV) and the optimum 1 - TV (Daliri et al.,
    "Coupling without communication and drafter-invariant speculative decoding", 2024); a one-hot
    draft d with probability p(d), as rejection sampling accepts it."""
    from atomrt.workers.runner.sampler import seeded_noise_

    n = 10_000
    p0 = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])
    p1 = torch.tensor([0.05, 0.15, 0.30, 0.20, 0.30])
    q0 = torch.tensor([0.10, 0.10, 0.20, 0.30, 0.30])
    q1 = torch.tensor([0.30, 0.30, 0.20, 0.10, 0.10])
    params = [SamplingParams(temperature=1.0, seed=1000 + s) for s in range(n)]
    if proposer == "draft_model":
        drafts = torch.empty(n, 2, dtype=torch.int64)
        for s in range(n):
            for i, q in enumerate((q0, q1)):
                drafts[s, i] = (q / seeded_noise_(torch.empty(V), 1000 + s, i)).argmax()
        draft_probs = torch.stack([q0, q1]).repeat(n, 1)
    else:
        drafts, draft_probs = torch.tensor([[3, 2]]).repeat(n, 1), None
    logits = torch.stack([p0.log(), p1.log(), torch.zeros(V)]).repeat(n, 1)
    out = rejection_sample(logits, drafts.flatten(), [2] * n, _tensors(params), draft_probs)
    first = torch.bincount(out.tokens[:, 0], minlength=V).float()
    assert _chi2(first, p0) < CHI2_4_DOF_P9999, first
    accepted = out.num_accepted >= 1
    second = torch.bincount(out.tokens[accepted, 1], minlength=V).float()
    assert _chi2(second, p1) < CHI2_4_DOF_P9999, second
    rate = accepted.double().mean().item()
    if proposer == "draft_model":
        tv = 0.5 * (p0 - q0).abs().sum().item()
        assert (1 - tv) / (1 + tv) - 0.02 < rate < 1 - tv + 0.02, rate
    else:
        assert abs(rate - p0[3].item()) < 0.02, rate


def test_ngram_proposer():
    # the suffix [7, 8] recurs: the most recent earlier occurrence's continuation is proposed
    assert ngram_propose([7, 8, 1, 2, 7, 8, 3, 4, 5, 7, 8], k=3, min_n=1, max_n=4) == [3, 4, 5]
    # the longest recurring suffix wins over a shorter, more recent one
    assert ngram_propose([1, 2, 3, 9, 9, 5, 3, 6, 2, 3], k=2, min_n=1, max_n=3) == [9, 9]
    # fewer than k tokens follow the match; no recurrence gives nothing
    assert ngram_propose([4, 5, 6, 4, 5], k=4, min_n=2, max_n=2) == [6, 4, 5]
    assert ngram_propose([1, 2, 3, 4], k=3, min_n=1, max_n=4) == []
    assert ngram_propose([5], k=3, min_n=1, max_n=4) == []
    # min_n bounds the match: a single repeated token is not enough for min_n=2
    assert ngram_propose([1, 2, 3, 1], k=2, min_n=2, max_n=4) == []
    assert ngram_propose([1, 2, 3, 1], k=2, min_n=1, max_n=4) == [2, 3]


def _ngram_reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by its definition, in plain Python: for n from the longest down, the most
    recent earlier window equal to the last n tokens, and what followed it."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        for start in range(num - 1 - n, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_proposer_matches_its_definition_on_random_histories():
    rng = random.Random(7)
    for trial in range(3000):
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies repeat, large ones rarely do
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        if trial % 4 == 0:  # a periodic tail, as generation loops make
            period = tokens[-rng.randrange(1, 6) :]
            tokens += period * rng.randrange(1, 4)
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 4)
        want = _ngram_reference(tokens, k, lo, hi)
        assert ngram_propose(tokens, k, lo, hi) == want, (tokens, k, lo, hi)
        assert ngram_propose(np.asarray(tokens), k, lo, hi) == want


def test_greedy_verify_layout_matches_the_rejection_sampler():
    """A plain greedy step verifies on the layout staged before the forward (Speculator's fast
    path); the tokens and accepted counts must be the rejection sampler's, ragged drafts included
    (sequences with none, with fewer than k, a prompt chunk's rows that sample nothing)."""
    from types import SimpleNamespace

    from atomrt.workers.spec_decode.ngram import NgramWorkerProposer
    from atomrt.workers.spec_decode.speculator import Speculator

    rng = np.random.default_rng(3)
    k, vocab = 4, 11
    spec = Speculator.__new__(Speculator)
    spec.k, spec.width, spec.device = k, k + 2, torch.device("cpu")
    spec.proposer = NgramWorkerProposer.__new__(NgramWorkerProposer)  # drafts in the plan
    for _ in range(200):
        n = int(rng.integers(1, 7))
        k_seq = rng.integers(0, k + 1, size=n + 1)  # one extra sequence samples nothing
        q_lens = k_seq + 1
        q_lens[-1] = int(rng.integers(2, 6))
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        input_ids = rng.integers(0, vocab, size=int(cu[-1]))
        sample_idx = np.arange(n)
        inputs = SimpleNamespace(
            num_draft_tokens=np.where(np.arange(n + 1) < n, k_seq, 0),
            sample_seq_idx=sample_idx,
            cu_seqlens_q=cu,
            input_ids=input_ids,
        )
        sampling = SamplingTensors.plain_greedy(n, torch.device("cpu"))
        md = spec.prepare(inputs, sampling, None, None)
        k_s = k_seq[:n]
        if not k_s.any():
            assert md is None or md.greedy_rows is not None
        num_rows = int((k_s + 1).sum())
        logits = torch.randn(num_rows, vocab)
        # make drafts agree with the target often, so acceptances of every length occur
        draft_at = np.concatenate([np.arange(c - ks, c) for c, ks in zip(cu[1 : n + 1], k_s)])
        starts = np.cumsum(k_s + 1) - (k_s + 1)
        rows_of_drafts = np.concatenate([np.arange(s, s + ks) for s, ks in zip(starts, k_s)])
        for at, row in zip(draft_at.astype(int), rows_of_drafts.astype(int)):
            if rng.random() < 0.7:
                input_ids[at] = int(logits[row].argmax())
        md = spec.prepare(inputs, sampling, None, None)
        if md is None:
            continue
        got = spec.unpack(spec.sample(logits, None, sampling, None, md).sampled_token_ids.tolist())
        drafts = torch.as_tensor(input_ids[draft_at.astype(int)], dtype=torch.int64)
        ref = rejection_sample(logits, drafts, k_s.tolist(), sampling)
        want = [ref.tokens[s, : int(ref.num_accepted[s]) + 1].tolist() for s in range(n)]
        assert got == want


def test_a_step_without_drafts_samples_as_without_speculation_and_copies_nothing_in():
    """A step without drafts (the adaptive policy's plain steps) samples each request's row as a
    step without speculation does, packed with no draft accepted, and builds no index tensor from
    host arrays: on a GPU that copy waits for the forward, and the next step could not be launched
    while this one runs."""
    from atomrt.workers.runner.sampler import Sampler
    from atomrt.workers.spec_decode.ngram import NgramWorkerProposer
    from atomrt.workers.spec_decode.speculator import Speculator

    def no_host_index(a):
        raise AssertionError(f"an index tensor copied in from the host: {a}")

    k, vocab = 3, 13
    spec = Speculator.__new__(Speculator)
    spec.k, spec.width, spec.device = k, k + 2, torch.device("cpu")
    spec.proposer = NgramWorkerProposer.__new__(NgramWorkerProposer)  # drafts in the plan
    spec._index = no_host_index
    gen = torch.Generator().manual_seed(5)
    for n in (1, 4):
        logits = torch.randn(n + 2, vocab, generator=gen)  # a bucket's padding rows after n
        want = logits[:n].argmax(dim=-1).tolist()
        greedy = SamplingTensors.plain_greedy(n, torch.device("cpu"))
        in_graph = logits.argmax(dim=-1)  # a request graph's argmax of every row
        for argmax in (in_graph, None):
            out = spec.sample(logits, argmax, greedy, Sampler(), None)
            assert spec.unpack(out.sampled_token_ids.tolist()) == [[t] for t in want]
        params = [SamplingParams(temperature=0.0, logprobs=2)] * n  # not plain: the sampler's path
        sampling = SamplingTensors.from_params(params, [[1]] * n, [[]] * n, vocab)
        out = spec.sample(logits, in_graph, sampling, Sampler(), None)
        assert spec.unpack(out.sampled_token_ids.tolist()) == [[t] for t in want]
        assert out.logprobs is not None

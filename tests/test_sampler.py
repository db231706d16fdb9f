"""Sampler: greedy, top-k/top-p/min-p masks against a direct computation, penalties against a
hand computation, seeded rows independent of the batch, logprobs."""

import math

import pytest
import torch

from atomrt.runtime.driver.sequence import Sequence
from atomrt.runtime.sampling_params import SamplingParams
from atomrt.workers.runner.sampler import (
    Sampler,
    SamplingTensors,
    apply_penalties,
    apply_top_k_top_p_min_p,
)

VOCAB = 32


def tensors(params: list[SamplingParams], prompts=None, outputs=None) -> SamplingTensors:
    prompts = prompts or [[1] for _ in params]
    outputs = outputs or [[] for _ in params]
    return SamplingTensors.from_params(params, prompts, outputs, VOCAB)


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = random_logits(5)
    out = Sampler()(logits, tensors([SamplingParams(temperature=0)] * 5))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1)) and out.logprobs is None


def direct_keep(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens a row keeps, computed the obvious way, one filter at a time."""
    logits = row / p.temperature
    keep = set(range(VOCAB))
    if p.top_k > 0:
        keep = set(logits.topk(p.top_k).indices.tolist())
    if p.top_p < 1:
        probs = torch.full_like(logits, float("-inf"))
        probs[list(keep)] = logits[list(keep)]
        probs = probs.softmax(-1)
        order = probs.argsort(descending=True).tolist()
        kept, mass = [], 0.0
        for t in order:
            kept.append(t)
            mass += probs[t].item()
            if mass >= p.top_p:
                break
        keep = set(kept)
    if p.min_p > 0:
        masked = torch.full_like(logits, float("-inf"))
        masked[list(keep)] = logits[list(keep)]
        probs = masked.softmax(-1)
        keep = {t for t in keep if probs[t] >= p.min_p * probs.max()}
    return keep


FILTERS = [
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.2),
    SamplingParams(top_k=8, top_p=0.7, temperature=0.7),
    SamplingParams(top_k=10, top_p=0.9, min_p=0.1, temperature=1.3),
    SamplingParams(),
    SamplingParams(top_k=1),
]


def test_top_k_top_p_min_p_masks_match_a_direct_computation() -> None:
    logits = random_logits(len(FILTERS), seed=3)
    t = tensors(FILTERS)
    masked = apply_top_k_top_p_min_p(logits / t.temperatures.unsqueeze(1), t)
    for i, p in enumerate(FILTERS):
        got = set(torch.nonzero(masked[i] > float("-inf")).flatten().tolist())
        assert got == direct_keep(logits[i], p), p


def test_sampled_tokens_stay_inside_the_kept_set() -> None:
    logits = random_logits(1, seed=4).expand(len(FILTERS) * 50, VOCAB).contiguous()
    params = [p for p in FILTERS for _ in range(50)]
    tokens = Sampler()(logits, tensors(params)).sampled_token_ids.tolist()
    for token, p in zip(tokens, params):
        assert token in direct_keep(logits[0], p)


def test_sampling_follows_the_distribution() -> None:
    row = torch.tensor([[0.0, 1.0, 2.0, -1.0] + [-1e9] * (VOCAB - 4)])
    n = 20000
    tokens = Sampler()(
        row.expand(n, VOCAB).contiguous(), tensors([SamplingParams()] * n)
    ).sampled_token_ids
    freq = torch.bincount(tokens, minlength=VOCAB)[:4].float() / n
    assert torch.allclose(freq, row[0, :4].softmax(-1), atol=0.02), freq


def test_penalties_match_a_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0] + [0.0] * (VOCAB - 5)])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    t = tensors([p], prompts=[[0, 1]], outputs=[[2, 2, 4]])
    got = apply_penalties(logits.clone(), t)[0]
    expect = logits[0].clone()
    expect[0] = 2.0 / 2  # prompt token, positive: divided
    expect[1] = -1.0 * 2  # prompt token, negative: multiplied
    expect[2] = 0.5 / 2 - 0.5 - 0.25 * 2  # output twice: repetition, presence once, frequency twice
    expect[4] = -2.0 * 2 - 0.5 - 0.25 * 1
    assert torch.allclose(got, expect), (got[:5], expect[:5])
    # Penalties apply to greedy rows too: the penalized prompt token 3 loses the argmax to token 0.
    greedy = Sampler()(
        logits, tensors([SamplingParams(temperature=0, repetition_penalty=10.0)], [[3]], [[]])
    )
    assert greedy.sampled_token_ids.item() == 0


def test_penalties_leave_unpenalized_rows_alone() -> None:
    logits = random_logits(2, seed=5)
    t = tensors(
        [SamplingParams(), SamplingParams(frequency_penalty=1.0)], [[1, 2], [1]], [[3], [3]]
    )
    got = apply_penalties(logits.clone(), t)
    assert torch.equal(got[0], logits[0]) and got[1, 3] == logits[1, 3] - 1.0


def test_seeded_rows_are_the_same_alone_and_in_any_batch() -> None:
    seeded = SamplingParams(seed=1234, top_p=0.9, top_k=20, temperature=1.5)
    row = random_logits(1, seed=7)
    alone = []
    for step in range(8):
        out = Sampler()(row, tensors([seeded], outputs=[[0] * step]))
        alone.append(out.sampled_token_ids.item())
    assert len(set(alone)) > 1, "the seed is mixed with the step: draws differ from step to step"
    for batch_seed in range(3):
        others = random_logits(5, seed=100 + batch_seed)
        params = [
            SamplingParams(),
            SamplingParams(temperature=0),
            SamplingParams(top_k=3, seed=9),
            SamplingParams(min_p=0.3),
        ]
        for pos in range(5):
            logits = torch.cat([others[:pos], row, others[pos:4]])
            batch_params = params[:pos] + [seeded] + params[pos:]
            for step in range(8):
                outs = (
                    [[0] * (step + k) for k in range(pos)]
                    + [[0] * step]
                    + [[0] * (step + k) for k in range(pos, 4)]
                )
                got = (
                    Sampler()(logits, tensors(batch_params, outputs=outs))
                    .sampled_token_ids[pos]
                    .item()
                )
                assert got == alone[step], (batch_seed, pos, step)


def test_logprobs_of_the_sampled_token_and_the_top_alternatives() -> None:
    logits = random_logits(3, seed=8)
    params = [
        SamplingParams(logprobs=3, temperature=0.5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(),
    ]
    t = tensors(params)
    out = Sampler()(logits, t)
    assert out.logprobs is not None
    scaled = logits / torch.tensor([0.5, 1.0, 1.0]).unsqueeze(1)
    lp = scaled.log_softmax(-1)
    tokens = out.sampled_token_ids
    assert torch.allclose(
        out.logprobs.sampled_logprobs, lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    )
    dicts = out.logprobs.to_dicts(t.num_logprobs, tokens.tolist())
    top3 = lp[0].topk(3)
    assert set(top3.indices.tolist()) <= set(dicts[0]) and len(dicts[0]) in (3, 4)
    assert math.isclose(dicts[0][top3.indices[0].item()], top3.values[0].item(), rel_tol=1e-6)
    assert dicts[1] == {tokens[1].item(): pytest.approx(lp[1, tokens[1]].item())}
    assert dicts[2] is None


def test_from_sequences() -> None:
    seqs = [
        Sequence("a", [1, 2, 3], SamplingParams(frequency_penalty=1.0)),
        Sequence("b", [4], SamplingParams(temperature=0)),
    ]
    seqs[0].append_token(5)
    t = SamplingTensors.from_sequences(seqs, VOCAB)
    assert t.prompt_token_ids.tolist() == [[1, 2, 3], [4, VOCAB, VOCAB]]
    assert t.output_token_ids.tolist() == [[5], [VOCAB]] and t.num_output_tokens == [1, 0]
    assert t.do_penalties and not t.all_greedy and t.temperatures.tolist() == [1.0, 0.0]


def test_plain_greedy_batch_builds_no_row_tensors_and_takes_the_argmax():
    from types import SimpleNamespace

    rows = [
        SimpleNamespace(
            temperature=0.0,
            top_p=1.0,
            top_k=-1,
            min_p=0.0,
            seed=None,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            logprobs=None,
            changes_logits=False,
        )
        for _ in range(3)
    ]
    t = SamplingTensors.from_params(rows, [[1, 2]] * 3, [[3]] * 3, vocab_size=10)
    assert t.all_greedy and t.temperatures.numel() == 0
    logits = torch.randn(3, 10)
    assert Sampler()(logits, t).sampled_token_ids.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_sample_as_their_float32_values(dtype) -> None:
    """The LM head hands over logits in the model's dtype: greedy (ties included: the first maximal
    index), penalties and logprobs give what the same values in float32 give."""
    logits = random_logits(6).to(dtype)
    logits[0, 3] = logits[0, 9] = logits[0].max() + 1  # a tie: index 3 wins
    greedy = Sampler()(logits, tensors([SamplingParams(temperature=0)] * 6))
    assert greedy.sampled_token_ids[0].item() == 3
    assert torch.equal(greedy.sampled_token_ids, logits.float().argmax(-1))
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=2)] * 6
    t = tensors(params, outputs=[[1, 2]] * 6)
    got, want = Sampler()(logits, t), Sampler()(logits.float(), t)
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    torch.testing.assert_close(
        got.logprobs.sampled_logprobs, want.logprobs.sampled_logprobs, rtol=0, atol=0
    )
    assert logits.dtype == dtype, "the sampler does not modify its input"


def test_lm_head_hands_over_logits_in_the_model_dtype() -> None:
    """No float32 copy of [rows, vocab] per step: the logits are the head's product, unpadded."""
    from atomrt.workers.layers.vocab import ParallelLMHead

    head = ParallelLMHead(VOCAB, 16)
    head.weight.data = torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(1)).to(
        torch.bfloat16
    )
    hidden = torch.randn(3, 16, dtype=torch.bfloat16)
    logits = head.compute_logits(hidden)
    assert logits.dtype == torch.bfloat16 and logits.shape == (3, VOCAB)
    assert torch.equal(logits, torch.nn.functional.linear(hidden, head.weight))


def _worker(**kw):
    from atomrt.runtime.driver.planner import worker_sampling_params

    return worker_sampling_params(SamplingParams(**kw))


@pytest.mark.parametrize("bias,temperature", [(1e39, 1.0), (1e38, 0.05), (-1e39, 0.05)])
def test_huge_logit_bias_never_leaves_the_allowed_tokens(bias: float, temperature: float) -> None:
    """A bias past float32's range is clamped to the API's [-100, 100] when the parameters are
    made; the row stays finite and samples only its allowed tokens (never token 0 of a NaN row)."""
    p = SamplingParams(logit_bias={7: bias, 9: 1.0}, allowed_token_ids=[7, 9, 12])
    assert p.logit_bias == {7: math.copysign(100.0, bias), 9: 1.0}
    params = [_worker(logit_bias={7: bias}, allowed_token_ids=[7, 9, 12], temperature=temperature)]
    logits = random_logits(1, seed=3)
    for step in range(20):
        t = SamplingTensors.from_params(params, [[1]], [[2] * step], VOCAB)
        token = Sampler()(logits, t).sampled_token_ids.item()
        assert token in (7, 9, 12)
        if bias > 0:
            assert token == 7


def test_penalty_overflow_keeps_the_row_finite() -> None:
    """A repetition penalty near 0 divides a seen token's positive logit past float32's range: the
    row still samples that token (the largest), never a NaN row's token 0."""
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, 5] = 4.0
    params = [_worker(repetition_penalty=1e-38, temperature=0.05, allowed_token_ids=[3, 5, 8])]
    t = SamplingTensors.from_params(params, [[5]], [[]], VOCAB)
    out = Sampler()(logits, t)
    assert out.sampled_token_ids.item() == 5

"""logit_bias, allowed_token_ids and bad_words: the sampler's additions against a reference written
from their definitions, and the engine's greedy outputs forced and forbidden as asked while the other
requests of the batch keep their tokens, in process, through mp (TP=2) and Ray (DP=2), with n-gram
speculation and async scheduling; a prompt-logprobs request in the same batches crosses the step
channel and gives the in-process values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from executor_harness import COMMON, WORDS, build_tiny_llama, save_word_tokenizer

from atomrt import SamplingParams
from atomrt.distributed.messages import WorkerSamplingParams
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.workers.runner.sampler import Sampler, SamplingTensors

VOCAB = 32


def _reference(logits: torch.Tensor, p: WorkerSamplingParams, output: list[int]) -> torch.Tensor:
    """The definitions, in float64, one token at a time."""
    out = logits.double().clone()
    for t, v in (p.logit_bias or {}).items():
        out[t] += v
    if p.allowed_token_ids:
        for t in range(out.shape[0]):
            if t not in p.allowed_token_ids:
                out[t] = float("-inf")
    for word in p.bad_words_token_ids or ():
        if len(word) == 1 or output[-(len(word) - 1) :] == word[:-1]:
            out[word[-1]] = float("-inf")
    return out


def test_additions_match_their_definitions_and_leave_other_rows_alone() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=g) * 3
    params = [
        WorkerSamplingParams(temperature=0.0, logit_bias={3: 7.5, 9: -100.0, 30: 0.25}),
        WorkerSamplingParams(temperature=0.0),
        WorkerSamplingParams(temperature=0.0, allowed_token_ids=[4, 11, 20], logit_bias={11: 2.0}),
        WorkerSamplingParams(temperature=0.0, bad_words_token_ids=[[5], [6, 7], [8, 9, 10]]),
        WorkerSamplingParams(temperature=0.0, bad_words_token_ids=[[6, 7], [8, 9, 10]]),
    ]
    outputs = [[1], [2], [3], [1, 6], [8, 9]]
    t = SamplingTensors.from_params(params, [[0]] * 5, outputs, VOCAB)
    assert not t.is_plain_greedy and t.additions is not None
    got = t.additions.apply(logits.clone())
    for i, (p, out) in enumerate(zip(params, outputs)):
        want = _reference(logits[i], p, out)
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got[i]), finite), i
        assert torch.allclose(got[i][finite].double(), want[finite], atol=1e-5), i
    tokens = Sampler()(logits, t).sampled_token_ids.tolist()
    assert tokens[0] == 3 and tokens[2] in (4, 11, 20) and tokens[1] == logits[1].argmax().item()
    assert tokens[3] not in (5, 7) and tokens[4] != 10
    # a subset of rows, and each row repeated over verify rows, keep their own additions
    sub = t.additions.select([2, 0]).repeat([2, 1]).apply(logits[[2, 2, 0]].clone())
    assert (
        torch.equal(sub[0], got[2]) and torch.equal(sub[1], got[2]) and torch.equal(sub[2], got[0])
    )


def test_a_batch_without_additions_builds_none() -> None:
    t = SamplingTensors.from_params(
        [WorkerSamplingParams(temperature=0.0)] * 3, [[0]] * 3, [[]] * 3, VOCAB
    )
    assert t.additions is None and t.is_plain_greedy


def test_the_worker_looks_for_additions_only_while_a_sequence_has_some() -> None:
    import numpy as np

    from atomrt.distributed.messages import NewRequest, RankBatch
    from atomrt.workers.runner.input_batch import SeqMirrors

    mirrors = SeqMirrors(block_size=4)
    biased = WorkerSamplingParams(logit_bias={3: 1.0})
    new = [
        NewRequest(1, sampling_params=biased),
        NewRequest(2),
        NewRequest(1, sampling_params=biased),
    ]
    mirrors.apply(RankBatch(new_requests=new))  # seq 1 sent again replaces its mirror
    assert mirrors.num_changing_logits == 1
    mirrors.apply(RankBatch(finished_seq_ids=np.asarray([1], np.int64)))
    assert mirrors.num_changing_logits == 0
    mirrors.apply(RankBatch(new_requests=[NewRequest(3, sampling_params=biased)]))
    mirrors.clear()
    assert mirrors.num_changing_logits == 0


def test_sampling_params_check_the_fields() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"3": 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: float("inf")})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


# ------------------------------------------------------------------------------- the engine

PROMPT = [3, 17, 42, 99, 5, 8, 61]
OTHER = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a word-level tokenizer of two-letter words (bad words are text)."""
    return save_word_tokenizer(build_tiny_llama(tmp_path_factory.mktemp("additions") / "model"))


def _greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)


def _requests(base: list[int]) -> list[SamplingParams]:
    """One request of each kind, built from the plain greedy output `base` of PROMPT."""
    unseen = next(t for t in range(2, 128) if t not in base)
    i = next(i for i in range(1, len(base)) if base[i] != base[i - 1])  # a pair to forbid
    return [
        _greedy(logit_bias={unseen: 100.0}),
        _greedy(allowed_token_ids=[unseen, base[0] + 1]),
        _greedy(bad_words=[WORDS[base[0]]]),
        _greedy(bad_words=[f"{WORDS[base[i - 1]]} {WORDS[base[i]]}"]),
        _greedy(),
    ]


def _check(base: list[int], other: list[int], outs: list[list[int]]) -> None:
    unseen = next(t for t in range(2, 128) if t not in base)
    i = next(i for i in range(1, len(base)) if base[i] != base[i - 1])
    forced, allowed, no_word, no_pair, plain, other_out = outs
    assert forced == [unseen] * MAX_TOKENS
    assert set(allowed) <= {unseen, base[0] + 1}
    assert base[0] not in no_word
    pairs = set(zip(no_pair, no_pair[1:]))
    assert (base[i - 1], base[i]) not in pairs and no_pair[:i] == base[:i] and no_pair[i] != base[i]
    assert plain == base and other_out == other  # the rest of the batch keeps its tokens


def _prompt_logprobs(out) -> list[tuple[int, float, int]]:
    """(token, logprob, rank) of every scored prompt token, and of each top alternative."""
    return [(t, lp.logprob, lp.rank) for row in out.prompt_logprobs[1:] for t, lp in row.items()]


def _run(model: Path, base: list[int], **kwargs) -> tuple[list[list[int]], list]:
    llm = LLM(str(model), **{**COMMON, **kwargs})
    try:
        params = _requests(base) + [_greedy(prompt_logprobs=2)]
        outs = llm.generate([PROMPT] * 5 + [OTHER], params, use_tqdm=False)
        spec = llm.engine.stats.spec_decode
        if spec is not None:  # the forced request's drafts verify with its bias
            assert spec.num_accepted_tokens > 0
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], _prompt_logprobs(outs[-1])


@pytest.fixture(scope="module")
def plain(tiny: Path) -> tuple[list[int], list[int], list]:
    llm = LLM(str(tiny), **COMMON)
    try:
        params = [_greedy(), _greedy(prompt_logprobs=2)]
        outs = llm.generate([PROMPT, OTHER], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return outs[0].outputs[0].token_ids, outs[1].outputs[0].token_ids, _prompt_logprobs(outs[1])


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


@pytest.mark.parametrize(
    "settings",
    [
        dict(executor="inproc"),
        dict(
            executor="mp", tensor_parallel_size=2, speculative_config=NGRAM, async_scheduling=True
        ),
        dict(executor="ray", data_parallel_size=2, speculative_config=NGRAM, async_scheduling=True),
    ],
    ids=["inproc", "mp-tp2-ngram-async", "ray-dp2-ngram-async"],
)
def test_outputs_forced_and_forbidden_and_prompt_logprobs_on_each_executor(
    tiny, plain, settings
) -> None:
    base, other, prompt_logprobs = plain
    tokens, got = _run(tiny, base, **settings)
    _check(base, other, tokens)
    assert len(got) == len(prompt_logprobs) >= 2 * (len(OTHER) - 1)
    for (t, lp, rank), (t_ref, lp_ref, rank_ref) in zip(got, prompt_logprobs):
        assert (t, rank) == (t_ref, rank_ref) and abs(lp - lp_ref) < 1e-5

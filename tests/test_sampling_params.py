"""SamplingParams validation: every bad value raises ValueError naming its field."""

import pytest

from atomrt.runtime.sampling_params import SamplingParams

BAD = [
    ({"n": 129}, "n"),
    ({"n": 0}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
    ({"seed": "x"}, "seed"),
    ({"ignore_eos": 1}, "ignore_eos"),
]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f"{f}={list(k.values())}" for k, f in BAD])
def test_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**kwargs)


def test_defaults_and_normalization() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, -1, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.is_greedy and not p.has_penalties
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(frequency_penalty=-2.0).has_penalties
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3

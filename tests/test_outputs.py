"""make_request_output: every field of the user's RequestOutput comes from its own Sequence field
(the outputs are built with positional arguments, so a reordered dataclass must fail here)."""

from __future__ import annotations

import time

import pytest

from atomrt.runtime.driver.outputs import make_request_output
from atomrt.runtime.driver.prompt_logprobs import Logprob
from atomrt.runtime.driver.sequence import Sequence
from atomrt.runtime.sampling_params import SamplingParams


def _finished_sequence() -> Sequence:
    seq = Sequence("req-7", [1, 2, 3], SamplingParams(logprobs=1, max_tokens=5), arrival_time=10.0)
    seq.first_scheduled_time = 11.0
    seq.append_token(4, {4: -0.5, 9: -1.0})
    seq.append_token(5, {5: -0.25})
    seq.num_preemptions = 2
    seq.stop_reason = 5
    seq.finish("stop")
    seq.first_token_time, seq.finished_time = 12.0, 13.0
    return seq


def test_every_output_field_comes_from_its_sequence_field() -> None:
    seq = _finished_sequence()
    out = make_request_output(seq, "the prompt")
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.finished) == (
        "req-7",
        "the prompt",
        [1, 2, 3],
        True,
    )
    (c,) = out.outputs
    assert (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) == (
        0,
        "",
        [4, 5],
        "stop",
        5,
    )
    # vLLM's {token id: Logprob}: the top alternatives ranked in order (here logprobs=1), the
    # sampled token after them unranked when it is not one of them
    assert c.logprobs == [
        {4: Logprob(-0.5, 1), 9: Logprob(-1.0, None)},
        {5: Logprob(-0.25, 1)},
    ]
    assert c.logprobs[0][4].logprob == -0.5 and c.cumulative_logprob == -0.75
    m = out.metrics  # wall-clock times, as vLLM's: the sequence's monotonic ones moved over
    wall = time.time() - time.monotonic()
    assert m.arrival_time - 10.0 == pytest.approx(wall, abs=0.5)
    assert (
        m.first_scheduled_time - m.arrival_time,
        m.first_token_time - m.arrival_time,
        m.finished_time - m.arrival_time,
        m.num_preemptions,
    ) == pytest.approx((1.0, 2.0, 3.0, 2))


def test_delta_outputs_return_each_token_once() -> None:
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=5))
    seq.append_token(3)
    seq.append_token(4)
    assert make_request_output(seq, delta=True).outputs[0].token_ids == [3, 4]
    assert make_request_output(seq, delta=True).outputs[0].token_ids == []
    seq.append_token(5)
    assert make_request_output(seq, delta=True).outputs[0].token_ids == [5]
    assert make_request_output(seq).outputs[0].token_ids == [3, 4, 5]
    assert make_request_output(seq).outputs[0].logprobs is None


def test_outputs_share_one_prompt_list() -> None:
    """A streamed row does not copy its prompt every step: every output of a request holds the
    sequence's one prompt list, which output tokens never reach."""
    seq = Sequence("r", list(range(1, 2001)), SamplingParams(max_tokens=5))
    first = make_request_output(seq, delta=True)
    seq.append_token(7)
    second = make_request_output(seq, delta=True)
    assert first.prompt_token_ids is second.prompt_token_ids is seq.prompt_token_ids
    assert seq.prompt_token_ids == list(range(1, 2001)) and seq.token_ids[-1] == 7


def test_the_engine_core_sends_one_output_per_sample_finished_by_its_own_end() -> None:
    """A step's output of an n=2 request whose sample 1 ended while sample 0 runs: the request is
    not finished, and the server, which counts finished samples to n, sees sample 1's end only."""
    from atomrt.runtime.driver.outputs import merge_request_outputs
    from atomrt.runtime.entrypoints.engine_core import core_outputs

    running = Sequence("r", [1, 2], SamplingParams(max_tokens=5), index=0)
    ended = Sequence("r", [1, 2], SamplingParams(max_tokens=5), index=1)
    for seq, token in ((running, 3), (ended, 4)):
        seq.append_token(token)
    ended.finish("length")
    out = merge_request_outputs(
        [make_request_output(s, delta=True) for s in (ended, running)], finished=False
    )
    assert [c.index for c in out.outputs] == [0, 1] and not out.finished
    sent = core_outputs(out)
    assert [(c.index, c.token_ids, c.finished, c.finish_reason) for c in sent] == [
        (0, [3], False, None),
        (1, [4], True, "length"),
    ]
    assert all(c.request_id == "r" and c.num_prompt_tokens == 2 for c in sent)

"""Parallel sampling (`n` > 1) in the engine: one request, n sequences sharing the prompt's KV.

- Greedy: every sample equals the request run with n=1, with and without the prefix cache.
- Seeded: sample i equals an n=1 request seeded `seed + i`; the samples differ; repeats agree.
- With the prefix cache the n samples hold the prompt's full blocks once, under async scheduling
  too.
- A parent sample that finishes while preempted (its token in flight) holds no sample back.
- A request gets at most one output a step and exactly one `finished` output: streamed, its
  samples' deltas under their indices, together; an abort ends every sample in one output; samples
  that finish in the same step end their request once.
- Under a small KV pool with preemption and async scheduling, every greedy sample is right.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from executor_harness import COMMON, PROMPTS, build_tiny_llama

from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_n") / "model")


@pytest.fixture(scope="module")
def llm(tiny):
    engine = LLM(str(tiny), **{**COMMON, "block_size": 4}, enable_prefix_caching=True)
    yield engine
    engine.shutdown()


def _texts(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_samples_equal_the_single_request(tiny, prefix_caching):
    llm = LLM(str(tiny), **COMMON, enable_prefix_caching=prefix_caching)
    try:
        one = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        three = llm.generate(
            PROMPTS, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
        )
    finally:
        llm.shutdown()
    for single, multi in zip(one, three):
        assert [c.index for c in multi.outputs] == [0, 1, 2]
        assert _texts(multi) == [single.outputs[0].token_ids] * 3
        assert multi.finished and all(c.finish_reason == "length" for c in multi.outputs)


def test_seeded_samples_are_the_seeds_one_by_one(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = PROMPTS[0]
    first = _texts(llm.generate([prompt], params)[0])
    again = _texts(llm.generate([prompt], params)[0])
    assert first == again, "a seeded request reproduces"
    assert len({tuple(t) for t in first}) == 4, "the n samples differ"
    for i, tokens in enumerate(first):
        single = SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=12, ignore_eos=True)
        assert llm.generate([prompt], single)[0].outputs[0].token_ids == tokens


@pytest.fixture(scope="module")
def async_llm(tiny):
    engine = LLM(
        str(tiny), **{**COMMON, "block_size": 4}, enable_prefix_caching=True, async_scheduling=True
    )
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_samples_share_the_prompt_blocks(llm, async_llm, scheduling):
    """Under async scheduling too: samples 1..n-1 are admitted once sample 0 has put the prompt's
    blocks in the prefix cache (its step's results are back), not as soon as it was submitted."""
    engine = (llm if scheduling == "sync" else async_llm).engine
    bm = engine.schedulers[0].block_manager
    prompt = list(range(3, 3 + 16))  # four full blocks of 4
    params = SamplingParams(n=4, temperature=0, max_tokens=4, ignore_eos=True)
    before = bm.num_used_blocks
    rid = engine.add_request(prompt, params)
    used = 0
    while engine.has_unfinished():
        engine.step()
        if len(engine.schedulers[0].running) == 4:
            used = max(used, bm.num_used_blocks - before)
    assert rid not in engine._requests
    # alone, 4 samples of 16 + 3 tokens would hold 4 * 5 blocks; shared: 4 prompt blocks (the last
    # prompt block is recomputed by samples 1..3 once they append) + one block per sample
    assert 0 < used <= 4 + 4 + 3, used
    assert bm.num_free_blocks == bm.num_blocks


def test_a_parent_that_finishes_while_preempted_holds_no_sample_back(tiny):
    """Async scheduling, a pool of 8 blocks: sample 0 of the first request is preempted while its
    last token is in flight, and that token finishes it in the waiting queue. Its samples, queued
    behind it for its prompt, must run anyway (they waited for ever, and every request behind
    them with them, while `step()` returned nothing)."""
    llm = LLM(
        str(tiny),
        **{**COMMON, "num_kv_blocks": 8, "max_num_seqs": 4},
        block_size=4,
        max_num_batched_tokens=16,
        async_scheduling=True,
        enable_prefix_caching=True,
    )
    engine = llm.engine
    first = [89, 108, 103, 107, 96, 115]
    second = [117, 114, 35, 56, 96]
    try:
        ids = [
            engine.add_request(
                first, SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True)
            ),
            engine.add_request(
                second, SamplingParams(n=3, temperature=0, max_tokens=1, ignore_eos=True)
            ),
        ]
        final = {}
        for _ in range(200):
            for out in engine.step():
                assert out.finished and out.request_id not in final
                final[out.request_id] = out
            if not engine.has_unfinished():
                break
        else:
            stuck = [(s.request_id, s.index) for s in engine.schedulers[0].waiting]
            raise AssertionError(
                f"not finished after 200 steps; waiting (request, sample): {stuck}"
            )
        preempted = engine.schedulers[0].num_preemptions
    finally:
        llm.shutdown()
    assert preempted > 0
    assert set(final) == set(ids)
    assert [len(c.token_ids) for c in final[ids[0]].outputs] == [10] * 3
    assert [len(c.token_ids) for c in final[ids[1]].outputs] == [1] * 3


def test_streamed_samples_and_abort(llm):
    engine = llm.engine
    params = SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True)
    rid = engine.add_request(PROMPTS[1], params, stream=True)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for _ in range(3):
        outs = engine.step()
        assert len(outs) <= 1, "one output per request and step"
        for out in outs:
            assert out.request_id == rid and not out.finished
            indices = [c.index for c in out.outputs]
            assert indices == sorted(set(indices))
            for c in out.outputs:
                seen[c.index] += c.token_ids
    engine.abort(rid)
    finals = []
    while engine.has_unfinished():
        finals += engine.step()
    assert len(finals) == 1 and finals[0].finished
    assert [c.index for c in finals[0].outputs] == [0, 1, 2]
    assert all(c.finish_reason == "abort" for c in finals[0].outputs)
    # samples 1..n-1 start once sample 0 has its prompt cached: they may be a step behind
    assert len(seen[0]) >= 1 and all(seen[0][: len(seen[i])] == seen[i] for i in (1, 2))


@pytest.mark.parametrize("stream", [False, True])
def test_samples_that_finish_together_end_their_request_once(tiny, stream):
    """Without the prefix cache the samples run in lockstep and finish in one step: the request
    still gets exactly one `finished` output (each finishing sample gave one), streamed or not."""
    llm = LLM(str(tiny), **COMMON, enable_prefix_caching=False)
    engine = llm.engine
    try:
        rid = engine.add_request(
            PROMPTS[0],
            SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True),
            stream=stream,
        )
        outs = []
        for _ in range(50):
            step = engine.step()
            assert len(step) <= 1, "one output per request and step"
            outs += step
            if not engine.has_unfinished():
                break
    finally:
        llm.shutdown()
    finals = [o for o in outs if o.finished]
    assert len(finals) == 1 and finals[0] is outs[-1] and finals[0].request_id == rid
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for out in outs if stream else finals:
        for c in out.outputs:
            tokens[c.index] += c.token_ids
    assert all(len(t) == 4 for t in tokens.values()) and tokens[0] == tokens[1] == tokens[2]
    assert [c.finish_reason for c in finals[0].outputs] == ["length"] * 3


def test_samples_under_preemption_and_async(tiny):
    single = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    roomy = LLM(str(tiny), **COMMON, block_size=4)
    try:
        want = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, single)]
    finally:
        roomy.shutdown()
    tight = LLM(
        str(tiny),
        **{**COMMON, "num_kv_blocks": 12, "max_num_seqs": 6},
        block_size=4,
        max_num_batched_tokens=16,
        async_scheduling=True,
        enable_prefix_caching=True,
    )
    try:
        params = SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True)
        outs = tight.generate(PROMPTS, params)
        preemptions = tight.engine.schedulers[0].num_preemptions
    finally:
        tight.shutdown()
    for expected, out in zip(want, outs):
        assert _texts(out) == [expected] * 3
    assert preemptions > 0, "the pool was meant to be too small for every sample at once"

"""Async scheduling: step N+1 is scheduled and submitted before step N's tokens are back.

- Scheduler: under random traffic (chunked prefill, prefix caching, preemption, EOS and length
  stops), running one step ahead gives every request exactly the tokens and finish reason of the
  synchronous schedule, and never leaks or double-owns a KV block.
- Engine, embedded SmolLM2-135M on CPU: async equals sync for a mixed batch with EOS stops, stop
  strings, logprobs, seeded sampling and penalties; under preemption; and a streamed request's
  deltas join to its final text with no output repeated.
- Executors: through `mp` and Ray with TP=2 and `mp` with DP=2 (real ZeroMQ, pipelined plans and
  flushes), the greedy tokens equal the in-process ones; with penalised and seeded rows every TP rank feeds rank 0's
  samples; an abort while its step is in flight; a killed worker still errors within 10 s.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest
from executor_harness import COMMON, GREEDY, PROMPTS, build_tiny_llama, greedy_tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from test_block_manager import check_invariants
from test_engine import stream_beside_a_quiet_request
from test_scheduler import fake_model, make

from atomrt import SamplingParams
from atomrt.runtime.config import DEFAULT_MODEL
from atomrt.runtime.driver.scheduler import RequestRejectedError, Scheduler, SchedulerOutput
from atomrt.runtime.driver.sequence import Sequence
from atomrt.runtime.entrypoints.llm import LLM

EOS = 3


def _sample(out: SchedulerOutput, truth: dict[int, list[int]]) -> dict[int, int]:
    """The 'workers': each sampled row's token from the true history, which (unlike the driver's
    token_ids) already holds the tokens still in flight."""
    sampled = {}
    for row in out.scheduled:
        seq = row.seq
        hist = truth.setdefault(seq.seq_id, list(seq.prompt_token_ids))
        assert seq.token_ids == hist[: seq.num_tokens], (
            "the driver's tokens disagree with what was sampled"
        )
        assert row.context_len <= len(hist), "a row computes a token that was never sampled"
        if row.is_sampled:
            token = fake_model(hist[: row.context_len])
            if row.context_len == len(hist):
                hist.append(token)
            sampled[seq.seq_id] = token
    return sampled


def _run(
    sched: Scheduler, seqs: list[Sequence], pipelined: bool
) -> dict[str, tuple[list[int], str]]:
    truth: dict[int, list[int]] = {}
    inflight: deque[tuple[SchedulerOutput, dict[int, int]]] = deque()
    for _ in range(5000):
        if not sched.has_unfinished() and not inflight:
            break
        out = sched.schedule()
        if not out.is_empty:
            sampled = _sample(out, truth)
            sched.advance(out)
            inflight.append((out, sampled))
        else:
            assert inflight, "nothing scheduled and nothing in flight, yet requests are unfinished"
        if inflight and (not pipelined or len(inflight) == 2 or out.is_empty):
            sched.postprocess(*inflight.popleft())
        assert len(inflight) <= 1
        assert all(s.num_pending <= 1 for s in sched.running)
        check_invariants(sched.block_manager, sched.running)
    else:
        raise AssertionError("did not finish")
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return {s.request_id: (s.output_token_ids, s.finish_reason) for s in seqs}


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(6, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(4, 24),
    max_seqs=st.integers(1, 4),
    chunked=st.booleans(),
    prefix=st.booleans(),
)
def test_one_step_ahead_gives_the_synchronous_tokens(
    data, num_blocks, block_size, budget, max_seqs, chunked, prefix
):
    requests = data.draw(
        st.lists(
            st.tuples(
                st.lists(st.integers(0, 5), min_size=1, max_size=20),
                st.integers(1, 8),
                st.booleans(),
            ),
            min_size=1,
            max_size=6,
        ),
        label="requests",
    )
    results = []
    for pipelined in (False, True):
        sched = make(num_blocks, block_size, budget, max_seqs, chunked, prefix)
        seqs = []
        for i, (prompt, max_tokens, ignore_eos) in enumerate(requests):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
            s = Sequence(f"r{i}", prompt, params, eos_token_ids={EOS})
            try:
                sched.add(s)
                seqs.append(s)
            except RequestRejectedError:
                pass
        results.append(_run(sched, seqs, pipelined))
    assert results[0] == results[1]


def test_a_request_at_its_length_limit_is_not_scheduled_while_its_last_token_is_in_flight():
    sched = make()
    s = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(s)
    out = sched.schedule()  # prefill: samples output token 1
    sched.advance(out)
    out2 = sched.schedule()  # decode of the pending token: samples output token 2 (the last)
    assert [r.num_new_tokens for r in out2.scheduled] == [1] and s.num_pending == 1
    sched.advance(out2)
    assert sched.schedule().is_empty  # both tokens in flight reach max_tokens: nothing to compute
    sched.postprocess(out, {s.seq_id: 7})
    assert sched.postprocess(out2, {s.seq_id: 8}) == [s]
    assert s.output_token_ids == [7, 8] and s.finish_reason == "length"


# --------------------------------------------------------------------------------- the engine (CPU)


def _prompts(tokenizer) -> list:
    """Six story prompts (they run to their length limit) and six chat questions (they stop at EOS)."""
    words = (
        "the a of GPU graph token kernel cache scheduler block prefill decode bucket pool".split()
    )
    stories = [
        " ".join(words[(i * 3) % len(words) :] + words[: (i * 5) % 7 + 1]) + f" story {i}:"
        for i in range(6)
    ]
    questions = [
        "What is the capital of France?",
        "Say hi.",
        "Name a color.",
        "What is 2+2?",
        "Name a fruit.",
        "Say yes.",
    ]
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in questions
    ]
    return stories + chats


def _params() -> list[SamplingParams]:
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=24),  # stops at EOS or length
        SamplingParams(temperature=0.0, max_tokens=16, stop=[" here", "."]),
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10),
        SamplingParams(
            temperature=0.0, max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5
        ),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    return [kinds[i % len(kinds)] for i in range(12)]


def _summary(outs) -> list[tuple]:
    rows = []
    for o in outs:
        c = o.outputs[0]
        lps = (
            [sorted((t, lp.logprob) for t, lp in row.items()) for row in c.logprobs]
            if c.logprobs
            else None
        )
        rows.append((c.token_ids, c.text, c.finish_reason, lps))
    return rows


def _assert_same(got: list[tuple], want: list[tuple]) -> None:
    """Tokens, text and finish reasons equal; each logprob within 1e-3 (a recompute after preemption
    runs prefill where the reference ran decode steps, so the floats differ in their last bits)."""
    assert [r[:3] for r in got] == [r[:3] for r in want]
    for g, w in zip(got, want):
        assert (g[3] is None) == (w[3] is None)
        for g_row, w_row in zip(g[3] or [], w[3] or []):
            assert [t for t, _ in g_row] == [t for t, _ in w_row]
            assert [v for _, v in g_row] == pytest.approx([v for _, v in w_row], abs=1e-3)


@pytest.fixture(scope="module")
def sync_reference() -> list[tuple]:
    llm = LLM(DEFAULT_MODEL)
    try:
        return _summary(llm.generate(_prompts(llm.tokenizer), _params()))
    finally:
        llm.shutdown()


def test_engine_async_equals_sync_on_the_embedded_model(sync_reference):
    llm = LLM(DEFAULT_MODEL, async_scheduling=True)
    try:
        assert (
            _summary(llm.generate(_prompts(llm.tokenizer), _params())) == sync_reference
        )  # bit for bit
        assert {r[2] for r in sync_reference} >= {"stop", "length"}
        assert any(r[1] and r[2] == "stop" and len(r[0]) < 16 for r in sync_reference[6:])
        params = SamplingParams(temperature=0.0, max_tokens=12)
        final, pieces, tokens, seen_quiet = stream_beside_a_quiet_request(llm, params)
        assert "".join(pieces) == final.text and tokens == final.token_ids
        assert seen_quiet == [True]
    finally:
        llm.shutdown()


def test_engine_async_under_preemption_equals_sync(sync_reference):
    # 12 blocks of 16 tokens cannot hold 12 requests of ~20-40 tokens at once: preemption recomputes.
    llm = LLM(DEFAULT_MODEL, async_scheduling=True, num_kv_blocks=12, enable_prefix_caching=False)
    try:
        outs = llm.generate(_prompts(llm.tokenizer), _params())
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        _assert_same(_summary(outs), sync_reference)
    finally:
        llm.shutdown()


# ------------------------------------------------------------------------------------- executors


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.mark.parametrize(
    "executor,layout",
    [
        ("mp", dict(tensor_parallel_size=2)),
        pytest.param("ray", dict(tensor_parallel_size=2), marks=pytest.mark.slow),
        ("mp", dict(data_parallel_size=2)),
    ],
    ids=["mp-tp2", "ray-tp2", "mp-dp2"],
)
def test_pipelined_plans_give_the_inproc_tokens(
    tiny_model: Path, executor: str, layout: dict
) -> None:
    """With 3 requests the DP=2 ranks get uneven batches (2 and 1 sequences)."""
    for prompts in (PROMPTS, PROMPTS[:3]):
        reference, _ = greedy_tokens(tiny_model, prompts, executor="inproc")
        tokens, _ = greedy_tokens(
            tiny_model, prompts, executor=executor, async_scheduling=True, **layout
        )
        assert tokens == reference


def test_tp2_ranks_feed_rank0s_samples_when_sampling_is_not_plain_greedy(tiny_model: Path) -> None:
    """Penalised and seeded rows sample from a history only TP rank 0 keeps; under async scheduling
    every rank's next input must still be rank 0's token (else the TP ranks compute different rows
    and the tokens drift from the synchronous run's)."""
    params = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            repetition_penalty=1.5,
            presence_penalty=0.7,
            ignore_eos=True,
        ),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(
            str(tiny_model),
            **{
                **COMMON,
                "executor": "mp",
                "tensor_parallel_size": 2,
                "async_scheduling": async_scheduling,
            },
        )
        try:
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]


def test_abort_while_its_step_is_in_flight_leaves_the_others_exact(tiny_model: Path) -> None:
    """A request aborted between submit and collect: its in-flight result is dropped, the others
    still get the synchronous tokens, and every KV block comes back."""
    reference, _ = greedy_tokens(tiny_model, executor="inproc")
    llm = LLM(str(tiny_model), **{**COMMON, "executor": "inproc", "async_scheduling": True})
    try:
        engine = llm.engine
        ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
        victim = ids[1]
        done: dict[str, list[int]] = {}
        steps = 0
        finals: dict[str, str] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    assert out.request_id not in finals, "a request produced two final outputs"
                    finals[out.request_id] = out.outputs[0].finish_reason
                    done[out.request_id] = out.outputs[0].token_ids
            steps += 1
            if steps == 3:
                assert engine._inflight, "the abort should land while a step is in flight"
                engine.abort(victim)
        assert finals[victim] == "abort"  # the aborted request's one final output
        assert all(reason == "length" for rid, reason in finals.items() if rid != victim)
        assert [done[i] for i in ids if i != victim] == [
            t for i, t in zip(ids, reference) if i != victim
        ]
        bm = engine.schedulers[0].block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.shutdown()


def test_killed_worker_under_async_scheduling_errors_in_time_and_leaves_no_process(
    tiny_model: Path,
) -> None:
    from executor_harness import wait_gone
    from test_worker_failure import ERROR_WITHIN_S, _kill_mid_generation

    from atomrt.runtime.executors.base import WorkerError

    llm = LLM(
        str(tiny_model),
        **{**COMMON, "executor": "mp", "tensor_parallel_size": 2, "async_scheduling": True},
    )
    pids = dict(llm.engine.executor.worker_pids)
    try:
        message, seconds = _kill_mid_generation(llm, rank=1)
    finally:
        llm.shutdown()
    assert seconds < ERROR_WITHIN_S, f"the error took {seconds:.1f} s"
    assert "rank 1 (dp 0, tp 1)" in message, message
    with pytest.raises(WorkerError, match="stopped"):
        llm.engine.executor.submit(None)  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished()
    assert wait_gone(pids.values()) == []

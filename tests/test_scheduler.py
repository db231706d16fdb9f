"""Scheduler: continuous batching, token budget, chunked prefill, preemption, stop rules, and a
property test that no KV block is ever leaked or owned twice."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_block_manager import check_invariants

from atomrt.runtime.config import CacheConfig, SchedulerConfig
from atomrt.runtime.driver.block_manager import BlockManager
from atomrt.runtime.driver.scheduler import RequestRejectedError, Scheduler, SchedulerOutput
from atomrt.runtime.driver.sequence import Sequence, SequenceStatus
from atomrt.runtime.sampling_params import SamplingParams

VOCAB = 50


def fake_model(token_ids: list[int]) -> int:
    """A deterministic 'greedy model': the next token depends only on the history."""
    return (sum(t * (i + 1) for i, t in enumerate(token_ids)) * 31 + len(token_ids)) % VOCAB


def make(
    num_blocks=64, block_size=4, budget=64, max_seqs=8, chunked=True, prefix=True, **kw
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix),
        bm,
        **kw,
    )


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    bs = sched.block_manager.block_size
    for row in out.scheduled:
        assert len(row.seq.block_table) * bs >= row.context_len, (
            "block table too short for the step"
        )
        assert row.num_new_tokens >= 1
    assert out.num_batched_tokens == sum(r.num_new_tokens for r in out.scheduled)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert out.num_seqs <= len(sched.running) <= sched.config.max_num_seqs
    sampled = {r.seq.seq_id: fake_model(r.seq.token_ids) for r in out.scheduled if r.is_sampled}
    sched.advance(out)
    return out, sched.postprocess(out, sampled)


def run_all(sched: Scheduler, max_steps: int = 2000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched)[0])
        check_invariants(sched.block_manager, sched.running)
        assert len(outs) < max_steps, "scheduler made no progress"
    assert sched.block_manager.num_used_blocks == 0 or sched.block_manager.enable_prefix_caching
    assert all(b.ref_count == 0 for b in sched.block_manager.blocks)
    return outs


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_model(tokens))
    return tokens[len(prompt) :]


def seq(rid: str, prompt: list[int], **params) -> Sequence:
    params.setdefault("ignore_eos", True)
    return Sequence(rid, prompt, SamplingParams(**params))


def test_decodes_first_then_prefills_with_the_rest_of_the_budget() -> None:
    sched = make(budget=10)
    a = seq("a", list(range(6)), max_tokens=5)
    sched.add(a)
    out, _ = step(sched)
    assert [(r.seq.request_id, r.num_new_tokens) for r in out.scheduled] == [
        ("a", 6)
    ] and out.is_prefill
    b = seq("b", list(range(20, 40)), max_tokens=5)
    sched.add(b)
    out, _ = step(sched)
    assert [(r.seq.request_id, r.num_new_tokens) for r in out.scheduled] == [("a", 1), ("b", 9)]
    assert not out.scheduled[1].is_sampled and out.max_seqlen_q == 9 and out.num_tokens == 10
    out, _ = step(sched)
    assert [(r.seq.request_id, r.num_new_tokens) for r in out.scheduled] == [("a", 1), ("b", 9)]
    out, _ = step(sched)
    assert [(r.seq.request_id, r.num_new_tokens) for r in out.scheduled] == [("a", 1), ("b", 2)]
    assert out.scheduled[1].is_sampled and b.num_output_tokens == 1
    out, _ = step(sched)
    assert not out.is_prefill and out.num_seqs == 2 and out.max_seqlen_q == 1


def test_chunked_prefill_splits_by_the_budget_and_samples_only_at_the_end() -> None:
    sched = make(budget=16)
    s = seq("a", list(range(50)), max_tokens=2)
    sched.add(s)
    chunks = []
    while s.num_output_tokens == 0:
        out, _ = step(sched)
        chunks.append((out.scheduled[0].num_new_tokens, out.scheduled[0].is_sampled))
    assert chunks == [(16, False), (16, False), (16, False), (2, True)]
    run_all(sched)
    assert s.output_token_ids == reference_output(list(range(50)), 2)


def test_without_chunked_prefill_prompts_run_whole() -> None:
    sched = make(budget=16, chunked=False)
    sched.add(seq("a", list(range(10)), max_tokens=3))
    sched.add(seq("b", list(range(10)), max_tokens=3))
    out, _ = step(sched)
    assert [r.num_new_tokens for r in out.scheduled] == [10]
    with pytest.raises(RequestRejectedError, match="max_num_batched_tokens"):
        sched.add(seq("c", list(range(17))))
    run_all(sched)


def test_max_num_seqs_caps_the_batch() -> None:
    sched = make(max_seqs=2)
    for i in range(5):
        sched.add(seq(f"r{i}", [i + 1] * 3, max_tokens=4))
    outs = run_all(sched)
    assert max(o.num_seqs for o in outs) == 2


@pytest.mark.parametrize("chunked", [True, False])
def test_preemption_when_blocks_run_out_keeps_greedy_output(chunked: bool) -> None:
    prompts = [[(7 * i + j) % VOCAB for j in range(5 + i)] for i in range(6)]
    sched = make(num_blocks=12, block_size=4, budget=32, chunked=chunked, prefix=False)
    seqs = [seq(f"r{i}", p, max_tokens=20) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    outs = run_all(sched)
    preempted = [p for o in outs for p in o.preempted]
    assert preempted, (
        "12 blocks of 4 cannot hold six growing sequences: something must be preempted"
    )
    assert all(s.status == SequenceStatus.FINISHED_LENGTH for s in seqs)
    for s, p in zip(seqs, prompts):
        assert s.output_token_ids == reference_output(p, 20)


def test_preempted_sequence_goes_back_to_the_front_of_the_queue() -> None:
    sched = make(num_blocks=4, block_size=2, budget=32, prefix=False)
    a = seq("a", [1, 2, 3, 4], max_tokens=4)
    b = seq("b", [4, 5, 6, 7], max_tokens=4)
    c = seq("c", [7], max_tokens=1)
    for s in (a, b):
        sched.add(s)
    step(sched)  # a, b prefilled: 2 blocks each, cache full
    sched.add(c)
    out, _ = step(sched)  # a needs a 3rd block: b (newest) is preempted
    assert [p.request_id for p in out.preempted] == ["b"] and b.num_computed_tokens == 0
    assert b.block_table == [] and b.num_output_tokens == 1
    assert list(sched.waiting) == [b, c]
    run_all(sched)
    assert b.output_token_ids == reference_output([4, 5, 6, 7], 4)


def test_prompt_that_can_never_fit_is_rejected() -> None:
    sched = make(num_blocks=4, block_size=4)
    with pytest.raises(RequestRejectedError, match="KV"):
        sched.add(seq("big", list(range(17))))
    with pytest.raises(RequestRejectedError, match="max_tokens"):
        sched.add(seq("long", list(range(10)), max_tokens=8))
    sched.add(seq("ok", list(range(10)), max_tokens=7))  # 16 KV slots: fits exactly
    run_all(sched)
    with pytest.raises(RequestRejectedError, match="max_model_len"):
        make(max_model_len=8).add(seq("m", list(range(8))))


def test_max_model_len_stops_with_length() -> None:
    sched = make(max_model_len=10)
    s = seq("a", list(range(6)), max_tokens=100)
    sched.add(s)
    run_all(sched)
    assert s.num_tokens == 10 and s.finish_reason == "length"


def test_prefix_cache_hit_shares_blocks_and_skips_compute() -> None:
    sched = make(block_size=4)
    prompt = list(range(1, 14))
    a = seq("a", prompt, max_tokens=3)
    sched.add(a)
    step(sched)
    a_blocks = list(a.block_table)
    b = seq("b", prompt, max_tokens=3)
    sched.add(b)
    out, _ = step(sched)
    row = next(r for r in out.scheduled if r.seq is b)
    assert row.num_computed_tokens == 12 and row.num_new_tokens == 1
    assert b.block_table[:3] == a_blocks[:3]
    run_all(sched)
    assert a.output_token_ids == b.output_token_ids == reference_output(prompt, 3)


def test_abort_frees_blocks() -> None:
    sched = make()
    a = seq("a", list(range(9)), max_tokens=10)
    sched.add(a)
    sched.add(seq("b", list(range(9)), max_tokens=10))
    out = sched.schedule()
    assert sched.abort("a") == [a] and a.finish_reason == "abort" and a.block_table == []
    sched.advance(out)
    sched.postprocess(out, {r.seq.seq_id: 1 for r in out.scheduled})  # a's row is skipped
    assert a.num_output_tokens == 0
    assert sched.abort("nope") == []
    run_all(sched)


def test_a_waiting_sequence_that_is_not_ready_is_passed_over_and_keeps_its_place() -> None:
    """`ready` (structured outputs: a grammar still compiling) says no: later prompts go first,
    and once it says yes the sequence runs ahead of those that came after it."""
    compiled = {"a": False}
    asked = []

    def ready(s: Sequence) -> bool:
        asked.append(s.request_id)
        return compiled.get(s.request_id, True)

    sched = make(ready=ready)
    a, b, c = (seq(r, list(range(i, i + 5)), max_tokens=3) for i, r in enumerate("abc"))
    for s in (a, b, c):
        sched.add(s)
    out, _ = step(sched)
    assert [r.seq.request_id for r in out.scheduled] == ["b", "c"]
    assert list(sched.waiting) == [a] and a.status is SequenceStatus.WAITING and not a.block_table
    out, _ = step(sched)
    assert [r.seq.request_id for r in out.scheduled] == ["b", "c"]
    compiled["a"] = True
    d = seq("d", [9, 9, 9], max_tokens=3)
    sched.add(d)
    out, _ = step(sched)
    assert [r.seq.request_id for r in out.scheduled] == ["b", "c", "a", "d"]
    asked.clear()
    run_all(sched)
    assert not asked  # only a waiting sequence is asked
    assert a.output_token_ids == reference_output(a.prompt_token_ids, 3)


def eos_params(**kw) -> SamplingParams:
    return SamplingParams(**kw)


@pytest.mark.parametrize(
    "params,tokens,expect_len,reason",
    [
        (eos_params(max_tokens=10), [5, 0, 5], 2, "stop"),  # EOS id 0
        (eos_params(max_tokens=4, ignore_eos=True), [5, 0, 5, 5], 4, "length"),
        (
            eos_params(max_tokens=10, min_tokens=3),
            [0, 0, 0, 5],
            3,
            "stop",
        ),  # no stop before min_tokens
        (eos_params(max_tokens=10, stop_token_ids=[7]), [5, 7], 2, "stop"),
        (eos_params(max_tokens=3), [5, 5, 5, 5], 3, "length"),
    ],
)
def test_stop_rules(
    params: SamplingParams, tokens: list[int], expect_len: int, reason: str
) -> None:
    sched = make()
    s = Sequence("a", [1, 2, 3], params, eos_token_ids={0})
    sched.add(s)
    for token in tokens:
        out = sched.schedule()
        sched.advance(out)
        finished = sched.postprocess(out, {s.seq_id: token})
        if finished:
            break
    assert finished == [s] and s.num_output_tokens == expect_len and s.finish_reason == reason
    assert (
        s.block_table == []
        and sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    )


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(8, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(4, 24),
    max_seqs=st.integers(1, 4),
    chunked=st.booleans(),
    prefix=st.booleans(),
)
def test_random_traffic_never_leaks_blocks(
    data, num_blocks, block_size, budget, max_seqs, chunked, prefix
) -> None:
    sched = make(num_blocks, block_size, budget, max_seqs, chunked, prefix)
    all_seqs: list[Sequence] = []
    for _ in range(data.draw(st.integers(1, 30), label="num_ops")):
        op = data.draw(st.sampled_from(["add", "add", "step", "step", "step", "abort"]), label="op")
        if op == "add":
            prompt = data.draw(
                st.lists(st.integers(0, 3), min_size=1, max_size=budget if not chunked else 20)
            )
            s = Sequence(
                f"r{len(all_seqs)}",
                prompt,
                SamplingParams(max_tokens=data.draw(st.integers(1, 6))),
                eos_token_ids={3},
            )
            try:
                sched.add(s)
                all_seqs.append(s)
            except RequestRejectedError:
                assert (
                    len(prompt) + s.sampling_params.max_tokens - 1 > num_blocks * block_size
                    or len(prompt) > budget
                )
        elif op == "step":
            out = sched.schedule()
            tokens = {
                r.seq.seq_id: data.draw(st.integers(0, 3)) for r in out.scheduled if r.is_sampled
            }
            sched.advance(out)
            sched.postprocess(out, tokens)
        elif all_seqs:
            sched.abort(data.draw(st.sampled_from(all_seqs)).request_id)
        check_invariants(sched.block_manager, sched.running)
        assert all(not s.block_table for s in sched.waiting)
    run_all(sched)
    assert all(s.is_finished for s in all_seqs)
    assert sched.block_manager.num_free_blocks == num_blocks

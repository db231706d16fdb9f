"""Under async scheduling a step whose grammar masks go out builds the next plan before them,
submits it right after them, and only then builds its outputs and returns: the step those masks
are for samples at once, and its successor's forward must not wait for the plan's building, the
outputs or the caller's handling of them. The streamed tokens stay the synchronous engine's."""

from __future__ import annotations

from pathlib import Path

import pytest
from grammar_harness import build_tiny_bpe

from atomrt.runtime.driver import request as request_module
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import SamplingParams

COMMON = dict(device="cpu", enforce_eager=True, num_kv_blocks=128, max_num_seqs=8)
PROMPTS = [[504, 1090, 4401, 28, 504, 1090], [9, 90, 900, 9000], [41, 42, 43, 44, 45]]
REQUESTS = [
    SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"regex": r"[a-z]{3,12}"}),
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs={"choice": ["alpha", "beta gamma"]}
    ),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bpe(tmp_path_factory.mktemp("submit-ahead") / "model")


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, REQUESTS, use_tqdm=False)]


def test_the_next_plan_is_submitted_right_after_the_grammar_masks(tiny, monkeypatch) -> None:
    with LLM(str(tiny), **COMMON, async_scheduling=False) as llm:
        want = _tokens(llm)
    with LLM(str(tiny), **COMMON, async_scheduling=True) as llm:
        engine = llm.engine
        _tokens(llm)  # the grammars compiled: the run below is all cache hits
        executor = engine.executor
        events: list[tuple[str, int]] = []  # (what, step) in the order the executor saw them
        submit, send = executor.submit, executor.send_grammar

        def noted_submit(plan):
            assert len(engine._inflight) < 2, "a third step in flight"
            events.append(("submit", plan.step))
            return submit(plan)

        def noted_send(masks):
            events.append(("masks", masks[0].step))
            return send(masks)

        executor.submit, executor.send_grammar = noted_submit, noted_send
        build = request_module.make_request_output

        def noted_build(seq, *args, **kwargs):
            events.append(("output", -1))
            return build(seq, *args, **kwargs)

        monkeypatch.setattr(request_module, "make_request_output", noted_build)
        planner = engine.planners[0]
        batch = planner.batch

        def noted_batch(out):
            events.append(("plan", -1))
            return batch(out)

        monkeypatch.setattr(planner, "batch", noted_batch)
        # streamed: each step's outputs are built after the next plan went out
        ids = [engine.add_request(p, r, stream=True) for p, r in zip(PROMPTS, REQUESTS)]
        calls: list[list[tuple[str, int]]] = []
        got: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished():
            events.clear()
            for out in engine.step():
                got[out.request_id] += out.outputs[0].token_ids
            calls.append(list(events))
        executor.submit, executor.send_grammar = submit, send
    assert [got[i] for i in ids] == want
    ahead = 0
    for i, call in enumerate(calls):
        masks_at = [k for k, (w, _) in enumerate(call) if w == "masks"]
        if masks_at and masks_at[-1] + 1 < len(call):
            # the masks of step N, then at once the plan of step N + 1, in the same call
            (_, step), (nxt, nxt_step) = call[masks_at[-1]], call[masks_at[-1] + 1]
            assert (nxt, nxt_step) == ("submit", step + 1), call
            ahead += 1
            # that plan was built before the masks went out: only its submit follows them
            assert call[masks_at[-1] - 1] == ("plan", -1), call
            assert ("output", -1) not in call[: masks_at[-1] + 2], call  # outputs built after
            assert ("output", -1) in call, call
            # and the next call collects without submitting first
            assert not calls[i + 1] or calls[i + 1][0] != ("submit", step + 2), calls[i + 1]
    assert ahead >= 3, calls

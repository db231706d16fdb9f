"""Where the engine's step meets structured outputs: three calls, `StructuredOutputs.plan` once a
step is submitted, `advance` as its results come (before the stop rules apply them) and
`took_results` once they are applied (the scheduler asks `ready` of a waiting sequence itself),
and an engine with nothing but a compiling grammar waits in `plan` rather than spin."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from grammar_harness import build_tiny_bpe

from atomrt.runtime.driver.structured_outputs import IDLE_GRAMMAR_WAIT_S, StructuredOutputs
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import SamplingParams

COMMON = dict(device="cpu", enforce_eager=True, num_kv_blocks=128, max_num_seqs=8)
PROMPTS = [[504, 1090, 4401, 28, 504, 1090], [9, 90, 900, 9000], [41, 42, 43, 44, 45]]


def _params(so=None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, structured_outputs=so)


REQUESTS = [
    _params({"regex": r"(ab|cd){1,4}[0-9]{2,4}"}),
    _params(),
    _params({"choice": ["alpha", "beta gamma", "delta"]}),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bpe(tmp_path_factory.mktemp("structured-step") / "model")


class _Calls:
    """The engine's `grammars`, forwarding to the real one and noting what the engine asks of it
    and which calls handed back masks."""

    def __init__(self, real: StructuredOutputs) -> None:
        self.real = real
        self.names: list[str] = []
        self.masks: dict[str, int] = {}

    def __getattr__(self, name: str):
        got = getattr(self.real, name)
        if not callable(got):  # a read of its state (whether masks wait), not a call
            return got
        self.names.append(name)

        def call(*args, **kwargs):
            out = got(*args, **kwargs)
            masks = out[0] if isinstance(out, tuple) else out
            if isinstance(masks, list) and masks:
                self.masks[name] = self.masks.get(name, 0) + len(masks)
            return out

        return call


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "adaptive": False}


@pytest.mark.parametrize(
    "async_scheduling,settings",
    [(False, dict(speculative_config=NGRAM)), (True, {})],
    ids=["sync-ngram", "async"],
)
def test_the_step_calls_structured_outputs_at_three_points(
    tiny, async_scheduling, settings
) -> None:
    settings = dict(settings, async_scheduling=async_scheduling)
    with LLM(str(tiny), **COMMON, **settings) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, REQUESTS, use_tqdm=False)]
        engine = llm.engine
        for prompt, params in zip(PROMPTS, REQUESTS):
            engine.add_request(prompt, params)  # the grammars are compiled: cache hits
        calls = _Calls(engine.grammars)
        engine.grammars = calls
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] = out.outputs[0].token_ids
        engine.grammars = calls.real
        spec = engine.stats.spec_decode
    assert [got[k] for k in sorted(got)] == want
    assert spec is None or spec.num_drafts > 0
    assert set(calls.names) == {"plan", "advance", "took_results"}
    # async scheduling: a decode step is planned while its rows' tokens are out, so its masks
    # wait for the previous step's results; else they go out as the step is planned
    assert set(calls.masks) == ({"plan", "took_results"} if async_scheduling else {"plan"})


def test_an_engine_with_only_a_compiling_grammar_waits_rather_than_spins(tiny) -> None:
    props = {
        f"p{i}": {"type": "string", "pattern": f"^[a-{chr(98 + i % 24)}]{{1,{i % 9 + 2}}}$"}
        for i in range(60)
    }
    schema = {"type": "object", "properties": props, "required": list(props)}
    with LLM(str(tiny), **COMMON) as llm:
        engine = llm.engine
        engine.add_request(PROMPTS[0], _params({"json": schema}))
        start, idle = time.perf_counter(), 0
        while engine.step_no == 0:  # nothing is scheduled until the grammar is compiled
            assert engine.step() == [] and engine.has_unfinished()
            idle += 1
        elapsed = time.perf_counter() - start
        idle -= 1  # the last step scheduled the request
        while engine.has_unfinished():
            engine.step()
    # each idle step but the one the compile ends waited the whole IDLE_GRAMMAR_WAIT_S
    assert 2 <= idle <= elapsed / IDLE_GRAMMAR_WAIT_S + 1, (idle, elapsed)


def test_a_grammar_wait_is_counted_until_it_compiled_not_until_a_busy_scheduler_admits_it(tiny):
    """`grammar_compile_seconds` is the wait for the grammar: a request that then queues behind
    a full batch (max_num_seqs=1) does not add its queueing to it."""
    with LLM(str(tiny), **{**COMMON, "max_num_seqs": 1}) as llm:
        engine = llm.engine
        engine.add_request(PROMPTS[1], SamplingParams(max_tokens=120, ignore_eos=True))
        engine.step()
        start = time.perf_counter()
        rid = engine.add_request(PROMPTS[0], _params({"choice": ["yes", "no"]}), stream=True)
        queued = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and queued is None:
                    queued = time.perf_counter() - start
        stats = engine.grammars.compiler.stats
    assert stats.misses == 1 and queued is not None
    assert stats.miss_seconds < queued / 2, (stats.miss_seconds, queued)

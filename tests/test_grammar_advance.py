"""How the driver advances grammar matchers on a step's tokens, checked against xgrammar's own
matcher driven token by token (the reference): the terminated state the xgrammar matcher keeps,
the step's tokens accepted ahead in one batch (threaded or not), and an engine whose stop rules
read the batch's answers emitting what one advancing each matcher alone does."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from grammar_harness import EOS, bpe_tokenizer, build_tiny_bpe

from atomrt.runtime.driver import xgrammar_backend as xb
from atomrt.runtime.driver.grammar_backend import GrammarBackend
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = Path(__file__).resolve().parent.parent / "benchmarks" / "schemas" / "user_profiles.json"
VOCAB = 49152
DOC = '{"users": [{"id": 12, "name": "Ada", "email": "ada@ex.org", "age": 33, "roles": ['


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def backend(tok):
    return xb.XgrammarBackend(tok.hf, VOCAB, [EOS])


def _compiled(backend, **constraint):
    so = StructuredOutputsParams(**constraint)
    return backend.compile(backend.parse(so, backend.validate(so)))


def test_the_terminated_state_follows_xgrammars_through_accepts_and_rollbacks(tok, backend):
    m = backend.matcher(_compiled(backend, regex="(ab)+"))
    ids = tok.hf.encode("ababab", add_special_tokens=False)
    (z,) = tok.hf.encode("z", add_special_tokens=False)
    assert not m.accept(EOS)  # a stop token before the grammar is complete: refused
    steps = [*ids, z, EOS, EOS]  # refused, accepted (the end), refused once terminated
    for token in steps:
        m.accept(token)
        assert m.is_terminated == m.matcher.is_terminated()
    assert m.is_terminated
    m.rollback(1)  # the stop token undone
    assert not m.is_terminated and not m.matcher.is_terminated()
    assert m.accept(EOS) and m.is_terminated and m.matcher.is_terminated()


def _matchers_along(tok, backend, compiled, n, refuse=True):
    """n matchers, each at a different prefix of DOC (token by token), with each one's next token
    in DOC, and (`refuse`) every third given a token its grammar refuses instead (the stop token:
    DOC is never a whole document)."""
    ids = tok.hf.encode(DOC, add_special_tokens=False)
    bad = EOS
    matchers, tokens = [], []
    for i in range(n):
        at = 1 + (i * (len(ids) - 2)) // n
        m = backend.matcher(compiled)
        for t in ids[:at]:
            assert m.accept(t)
        matchers.append(m)
        tokens.append(bad if refuse and i % 3 == 2 else ids[at])
    return matchers, tokens


@pytest.mark.parametrize("refuse", [True, False], ids=["some-refused", "all-accepted"])
def test_a_batch_accepted_ahead_answers_as_each_matcher_alone(tok, refuse) -> None:
    backend = xb.XgrammarBackend(tok.hf, VOCAB, [EOS])
    compiled = _compiled(backend, json=json.loads(SCHEMA.read_text()))
    n = xb.PARALLEL_FILL_ROWS + 5
    matchers, tokens = _matchers_along(tok, backend, compiled, n, refuse)
    refs, _ = _matchers_along(tok, backend, compiled, n, refuse)  # the reference: one at a time
    backend.accept_ahead(matchers, tokens)
    words = (VOCAB + 31) // 32
    got, want = (torch.zeros((n, words), dtype=torch.int32) for _ in range(2))
    for row, (m, ref, t) in enumerate(zip(matchers, refs, tokens)):
        m.fill(got, row)  # already advanced, before the stop rules ask
        answer = ref.matcher.accept_token(t)
        ref.matcher.fill_next_token_bitmask(want, row)
        assert m.accept(t) == answer
        assert answer == (not refuse or row % 3 != 2)
    assert torch.equal(got, want)
    assert len({tuple(r.tolist()) for r in want}) > 4  # the states differ
    backend.shutdown()


def test_the_batch_accept_reads_its_answers_through_the_library_call() -> None:
    """The installed xgrammar has the call whose answers are read in one ask (else its wrapper,
    which reads each answer, would serve, slower)."""
    assert xb.core_batch_accept() is not None


def test_a_token_accepted_ahead_and_not_asked_about_is_undone(tok, backend) -> None:
    compiled = _compiled(backend, json=json.loads(SCHEMA.read_text()))
    matchers, tokens = _matchers_along(tok, backend, compiled, 6)
    refs, _ = _matchers_along(tok, backend, compiled, 6)
    backend.accept_ahead(matchers, tokens)
    words = (VOCAB + 31) // 32
    got, want = (torch.zeros((6, words), dtype=torch.int32) for _ in range(2))
    (other,) = tok.hf.encode('"', add_special_tokens=False)
    for row, (m, ref) in enumerate(zip(matchers, refs)):
        if row % 2:
            m.settle()  # the stop rules never asked
        else:  # the stop rules asked about another token
            assert m.accept(other) == ref.matcher.accept_token(other)
        m.fill(got, row)
        ref.matcher.fill_next_token_bitmask(want, row)
    assert torch.equal(got, want)


PROMPTS = [[504, 1090, 4401, 28, 504, 1090], [9, 90, 900, 9000], [41, 42, 43, 44, 45], [7, 8]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bpe(tmp_path_factory.mktemp("grammar-advance") / "model")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_stop_rules_read_the_batchs_answers_and_tokens_stay(tiny, async_scheduling) -> None:
    """An engine's constrained rows advance in one batch a step, not a call each, and emit what
    an engine advancing them one at a time does (the backend's accept_ahead made a no-op)."""
    import xgrammar

    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
        for so in (
            {"json": json.loads(SCHEMA.read_text())},
            {"regex": r"(ab|cd){1,4}[0-9]{2,4}"},
            None,
            {"choice": ["alpha", "beta gamma", "delta"]},
        )
    ]
    calls = {"one": 0, "batch": 0}
    one, batch = xgrammar.GrammarMatcher.accept_token, xb._batch_accept

    def counted_one(self, *args, **kwargs):
        calls["one"] += 1
        return one(self, *args, **kwargs)

    def counted_batch(matchers, tokens, *args, **kwargs):
        calls["batch"] += len(tokens)
        return batch(matchers, tokens, *args, **kwargs)

    outs = {}
    kwargs = dict(device="cpu", enforce_eager=True, num_kv_blocks=128, max_num_seqs=8)
    with LLM(str(tiny), async_scheduling=async_scheduling, **kwargs) as llm:
        for ahead in (False, True):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(xgrammar.GrammarMatcher, "accept_token", counted_one)
                mp.setattr(xb, "_batch_accept", counted_batch)
                if not ahead:
                    mp.setattr(xb.XgrammarBackend, "accept_ahead", GrammarBackend.accept_ahead)
                calls.update(one=0, batch=0)
                got = llm.generate(PROMPTS, params, use_tqdm=False)
            outs[ahead] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got]
            constrained = sum(
                len(o.outputs[0].token_ids) for o, p in zip(got, params) if p.structured_outputs
            )
            if ahead:  # every emitted token of a constrained request came through the batch
                assert calls["one"] == 0 and calls["batch"] >= constrained > 0, calls
            else:
                assert calls["batch"] == 0 and calls["one"] >= constrained > 0, calls
    assert outs[True] == outs[False]


def test_masks_filled_on_a_thread_beside_the_step_loop_are_the_same(tiny, monkeypatch) -> None:
    """structured_outputs.FILL_ON_THREAD: under async scheduling the masks that wait for a step's
    tokens fill on the fill thread, and the engine emits what it does filling them itself."""
    from atomrt.runtime.driver import structured_outputs as so

    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c)
        for c in (
            {"json": json.loads(SCHEMA.read_text())},
            {"regex": r"(ab|cd){1,4}[0-9]{2,4}"},
            None,
            {"choice": ["alpha", "beta gamma", "delta"]},
        )
    ]
    threads: list[str] = []
    fill_rows = xb.XgrammarBackend.fill_rows

    def noted(self, *args):
        threads.append(threading.current_thread().name)
        return fill_rows(self, *args)

    monkeypatch.setattr(xb.XgrammarBackend, "fill_rows", noted)
    outs = {}
    kwargs = dict(device="cpu", enforce_eager=True, num_kv_blocks=128, max_num_seqs=8)
    with LLM(str(tiny), async_scheduling=True, **kwargs) as llm:
        for on in (False, True):
            monkeypatch.setattr(so, "FILL_ON_THREAD", on)
            threads.clear()
            got = llm.generate(PROMPTS, params, use_tqdm=False)
            outs[on] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got]
            on_thread = sum(name.startswith("atomrt-grammar-fill") for name in threads)
            assert (on_thread > len(threads) // 2) if on else on_thread == 0, threads
    assert outs[True] == outs[False]


class _Unwalkable:
    """A step's scheduler output whose rows must not be read."""

    @property
    def scheduled(self):
        raise AssertionError("advance walked the rows of a step without a constrained row")


def test_a_step_without_constrained_rows_is_not_walked(tok) -> None:
    """An engine that once compiled a grammar: the results of a step planned without a
    constrained row cost `advance` no walk over its rows; a constrained step's are walked."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    import numpy as np

    from atomrt.runtime.config import StructuredOutputsConfig
    from atomrt.runtime.driver.structured_outputs import StructuredOutputs

    so = StructuredOutputs(tok, VOCAB, [EOS], StructuredOutputsConfig())
    so._compiler = Future()  # built, as after a constrained request
    plain = SimpleNamespace(ranks=[SimpleNamespace(grammar_rows=np.zeros(0, dtype=np.int32))])
    assert so.plan(plain, [SimpleNamespace(scheduled=[])], idle=False) == ([], [])
    so.advance([_Unwalkable()], [{}], speculative=False)  # its results: nothing read
    with pytest.raises(AssertionError, match="walked"):  # unplanned (a step in doubt): walked
        so.advance([_Unwalkable()], [{}], speculative=False)

"""How the driver advances grammar matchers on a step's tokens, checked against xgrammar's own
matcher driven token by token (the reference): the terminated state the xgrammar matcher keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
from grammar_harness import EOS, bpe_tokenizer

from atomrt.runtime.driver import xgrammar_backend as xb
from atomrt.runtime.sampling_params import StructuredOutputsParams

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

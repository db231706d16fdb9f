"""A large batch of grammar masks fills on threads on a machine with the cores for it, and the
masks are those each matcher fills alone (xgrammar's per-matcher fill, the reference)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from grammar_harness import EOS, bpe_tokenizer

from atomrt.runtime.driver import xgrammar_backend as xb
from atomrt.runtime.sampling_params import StructuredOutputsParams

SCHEMA = Path(__file__).resolve().parent.parent / "benchmarks" / "schemas" / "user_profiles.json"
VOCAB = 49152


def test_fill_threads_follow_the_cores() -> None:
    assert [xb.fill_threads(c) for c in (1, 2, 4, 7)] == [1, 1, 1, 1]
    assert [xb.fill_threads(c) for c in (8, 12, 16, 64)] == [4, 6, 8, xb.MAX_FILL_THREADS]


def test_a_threaded_batch_fill_gives_each_matchers_own_mask(monkeypatch) -> None:
    monkeypatch.setattr(xb, "usable_cpu_count", lambda: 16)  # as on a GPU host: a threaded filler
    tok = bpe_tokenizer()
    backend = xb.XgrammarBackend(tok.hf, VOCAB, [EOS])
    assert backend._parallel is not None
    so = StructuredOutputsParams(json=json.loads(SCHEMA.read_text()))
    compiled = backend.compile(backend.parse(so, backend.validate(so)))
    text = '{"users": [{"id": 12, "name": "Ada", "email": "ada@ex.org", "age": 33, "roles": ['
    matchers = []
    n = xb.PARALLEL_FILL_ROWS + 8
    for i in range(n):  # each a different state: a prefix of the document, token by token
        m = backend.matcher(compiled)
        for t in tok.hf.encode(text[: 1 + (i * len(text)) // n], add_special_tokens=False):
            assert m.accept(t)
        matchers.append(m)
    words = (VOCAB + 31) // 32
    want = torch.full((n, words), -1, dtype=torch.int32)
    for row, m in enumerate(matchers):
        m.fill(want, row)
    got = torch.zeros((n + 3, words), dtype=torch.int32)
    rows = [r + 3 for r in range(n)]
    backend.fill_rows(matchers, got, rows)
    assert torch.equal(got[3:], want)
    assert len({tuple(r.tolist()) for r in want}) > 4  # the states differ

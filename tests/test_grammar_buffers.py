"""The arrays grammar masks are filled into are reused step after step (`MaskBuffers`): they take
turns per DP rank, grow to the largest step, and every row of a step's mask is written before it
is sent, the rows of sequences that finished while their step was planned too (whatever the array
held before: here each array comes back filled with zeros, a mask that allows nothing)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from grammar_harness import build_tiny_bpe

from atomrt import SamplingParams
from atomrt.runtime.driver.grammar_backend import MaskBuffers
from atomrt.runtime.entrypoints.llm import LLM


def test_the_arrays_take_turns_per_rank_and_grow() -> None:
    buffers = MaskBuffers(words=5)
    first = [buffers.take(0, 3) for _ in range(MaskBuffers.SLOTS)]
    assert all(a.shape == (3, 5) and a.dtype == np.int32 for a in first)
    assert len({a.ctypes.data for a in first}) == MaskBuffers.SLOTS  # distinct while in turn
    again = buffers.take(0, 2)
    assert again.ctypes.data == first[0].ctypes.data and again.shape == (2, 5)  # reused
    other = buffers.take(1, 3)
    assert all(not np.shares_memory(other, a) for a in first)  # each rank its own
    for _ in range(MaskBuffers.SLOTS - 1):
        buffers.take(0, 1)
    grown = buffers.take(0, 9)  # the first array's turn again, larger than it was
    assert grown.shape == (9, 5) and grown.flags.c_contiguous


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bpe(tmp_path_factory.mktemp("buffers") / "model")


PROMPTS = [[504, 1090, 4401, 28], [9, 90, 900, 9000], [41, 42, 43, 44, 45], [7, 8, 9]]


def _run(tiny: Path, rows_sent: Optional[list[np.ndarray]] = None) -> list:
    requests = [  # sampled, each its own length: rows of finished sequences in planned steps
        SamplingParams(temperature=1.0, seed=i, max_tokens=24, structured_outputs=so)
        for i, so in enumerate(
            [
                {"regex": r"[a-z]{2,4}"},
                {"regex": r"[0-9]{6,12}"},
                {"choice": ["alpha", "beta gamma"]},
                {"json": {"type": "object", "properties": {"n": {"type": "integer"}}}},
            ]
        )
    ]
    with LLM(
        str(tiny), device="cpu", enforce_eager=True, num_kv_blocks=128, async_scheduling=True
    ) as llm:
        if rows_sent is not None:
            send = llm.engine.executor.send_grammar

            def noted(masks):
                rows_sent.extend(row.copy() for m in masks for row in m.bitmask)
                send(masks)

            llm.engine.executor.send_grammar = noted
        return llm.generate(PROMPTS * 2, requests * 2, use_tqdm=False)


def test_every_row_is_written_whatever_the_array_held(tiny, monkeypatch) -> None:
    want = [o.outputs[0].token_ids for o in _run(tiny)]
    take = MaskBuffers.take

    def stale(self, dp_rank, rows):
        array = take(self, dp_rank, rows)
        array[:] = 0  # allows nothing: a row left unwritten would sample from no token
        return array

    monkeypatch.setattr(MaskBuffers, "take", stale)
    rows_sent: list[np.ndarray] = []
    outs = _run(tiny, rows_sent)
    assert [o.outputs[0].token_ids for o in outs] == want
    # a grammar's mask allows a token until it ends, and a row of a sequence that ended allows all
    assert len(rows_sent) > len(want) and all(row.any() for row in rows_sent)
    assert any((row == -1).all() for row in rows_sent)  # the rows of finished sequences
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(r"[a-z]{2,4}", texts[0]) and re.fullmatch(r"[0-9]{6,12}", texts[1])
    assert texts[2] in ("alpha", "beta gamma") and isinstance(json.loads(texts[3]), dict)

"""DeepSeek-V4's shared step index (workers/layers/v4_rows.py, `step_memo`): the layers of a kind
share one answer to each index question of a forward (each row's sequence, its window's slots,
its entries' slots, the compressors' windows), and each forward makes its own, so a graph's
capture never reads what the warm-up before it made with the same metadata and buffers.

On the CPU, the tiny `csa_hca` model (tests/v4_harness.py: a sliding layer, two CSA layers of
rate 4 and an HCA layer of rate 8) through a paged cache, on the kernels' path (Triton's
interpreter) as on CUDA.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from model_harness import PagedHarness
from v4_harness import build_v4_folder, decode_step_context

from atomrt.runtime.config import Config
from atomrt.runtime.forward_context import get_forward_context, reset_forward_context
from atomrt.runtime.forward_context import set_forward_context as set_context
from atomrt.workers.layers import v4_attention, v4_rows
from atomrt.workers.loading.loader import load_model

PROMPTS = [[3 + i % 50 for i in range(21)], [7 + (3 * i) % 40 for i in range(14)]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    folder = build_v4_folder(Path(tmp_path_factory.mktemp("v4memo")), "csa_hca")
    return load_model(Config(model=str(folder)), "cpu", torch.float32).model


def _decode_inputs(model: torch.nn.Module) -> tuple:
    """A prefill of PROMPTS through a paged harness, then one decode step's inputs."""
    harness = PagedHarness(model, 40, len(PROMPTS), block_size=4)
    harness.step(PROMPTS, [0] * len(PROMPTS))
    ids, pos, md, ctx = decode_step_context(harness, [5, 6], [len(p) for p in PROMPTS])
    return harness, ids, pos, md, ctx


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in value if isinstance(t, torch.Tensor)]


def test_layers_of_a_kind_share_the_step_index(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One decode forward asks each question once per layer that needs it and makes each answer
    once per kind: the window's slots once for four layers, the compressors' index once per rate
    for three compressed layers."""
    monkeypatch.setattr(v4_attention, "USE_KERNELS_ON_CPU", True)
    asked: Counter = Counter()
    memo = v4_rows.step_memo

    def counted(key, make):
        asked[key[0]] += 1
        return memo(key, make)

    monkeypatch.setattr(v4_rows, "step_memo", counted)
    monkeypatch.setattr(v4_attention, "step_memo", counted)
    harness, ids, pos, md, ctx = _decode_inputs(model)
    asked.clear()
    set_context(md, harness.config, ctx, no_compile_layers=harness.layers,
                kv_cache_data=harness.kv_cache_data)  # fmt: skip
    try:
        with torch.inference_mode():
            model(ids, pos)
        made = Counter(key[0] for key in get_forward_context().step_memo)
    finally:
        reset_forward_context()
    assert asked["window"] == 4 and made["window"] == 1
    assert asked["compress"] == 3 and made["compress"] == 2  # CSA rate 4, HCA rate 8
    assert asked["entries"] == 3 and made["entries"] == 2
    assert made["seq"] == 1 and made["table"] == 1 and made["write"] == 1


def test_each_forward_makes_its_own_index(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two forwards with the same metadata object and input buffers (a warm-up, then a capture):
    after the first, every answer it made is overwritten with garbage; the second forward still
    gives the first's hidden states, as it makes its answers anew. The same with the clearing
    turned off gives other states: the garbage would be read."""
    monkeypatch.setattr(v4_attention, "USE_KERNELS_ON_CPU", True)
    harness, ids, pos, md, ctx = _decode_inputs(model)
    inputs = {
        t.untyped_storage().data_ptr()
        for t in (pos, md.block_tables, md.slot_mapping, md.cu_seqlens_q, md.context_lens)
    }

    def forward(poison: bool) -> torch.Tensor:
        with torch.inference_mode():
            out = model(ids, pos).clone()
            if poison:
                for key, value in get_forward_context().step_memo.items():
                    if key[0] == "held":  # the inputs the keys name, kept alive
                        continue
                    for t in _tensors(value):
                        assert t.untyped_storage().data_ptr() not in inputs, "an input aliased"
                        t.fill_(True if t.dtype == torch.bool else 1)
            return out

    set_context(md, harness.config, ctx, no_compile_layers=harness.layers,
                kv_cache_data=harness.kv_cache_data)  # fmt: skip
    try:
        first = forward(poison=True)
        again = forward(poison=True)
        monkeypatch.setattr(v4_rows, "clear_step_memo", lambda: None)
        from atomrt.workers.models import deepseek_v4

        monkeypatch.setattr(deepseek_v4, "clear_step_memo", lambda: None)
        stale = forward(poison=False)
    finally:
        reset_forward_context()
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert not torch.allclose(stale, first), "the garbage answers were never read"

"""A TR_HYBRID eager attention region binds its host-planned decode launch once per step plan,
stream and KV cache (workers/layers/attention.py `_BoundAttend`): later steps of the same plan
repeat the kept launch; a new plan, another cache, a prefill or a graph-safe step plan again.
CPU: the kept launch and attention_step are stand-ins that record their calls (the real ones run
on the GPU tier: tests/gpu/test_graph_modes_gpu.py compares TR_HYBRID's tokens with eager's)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from atomrt.runtime.forward_context import AttentionMetaData, Context, set_forward_context
from atomrt.workers.kernels import device_info
from atomrt.workers.kernels import launch as launch_module
from atomrt.workers.layers import attention as attention_layer


@dataclass
class KV:
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def _md(context_lens: list[int], rows_per_seq: int = 1, graph_safe: bool = False):
    n = len(context_lens)
    cu = [i * rows_per_seq for i in range(n + 1)]
    buffers = STATIC
    return AttentionMetaData(
        cu_seqlens_q=buffers["cu"][: n + 1],
        context_lens=buffers["ctx"][:n],
        block_tables=buffers["bt"][:n],
        slot_mapping=buffers["slots"][: cu[-1]],
        max_seqlen_q=rows_per_seq,
        max_seqlen_k=max(context_lens),
        num_seqs=n,
        num_tokens=cu[-1],
        cu_seqlens_q_cpu=cu,
        context_lens_cpu=context_lens,
        graph_safe=graph_safe,
    )


STATIC = {
    "cu": torch.zeros(9, dtype=torch.int32),
    "ctx": torch.zeros(8, dtype=torch.int32),
    "bt": torch.zeros(8, 64, dtype=torch.int32),
    "slots": torch.zeros(16, dtype=torch.int64),
}


@pytest.fixture
def calls(monkeypatch):
    log: list = []

    def general_path(q, k, v, out, positions, layer, md, kv):
        log.append(("general", md.num_seqs, max(md.context_lens_cpu)))

        def kept(stream: int) -> None:
            log.append(("kept", stream))

        return kept if md.cu_seqlens_q_cpu[-1] == md.num_seqs and not md.graph_safe else None

    monkeypatch.setattr(attention_layer, "_attention_step", general_path)
    monkeypatch.setattr(launch_module, "_raw_stream", lambda index: 7)
    monkeypatch.setattr(device_info, "sm_count", lambda device: 132)  # an H200: long contexts split
    monkeypatch.setattr(attention_layer, "_DECODE_PLANS", attention_layer._DecodePlans())
    return log


def _step(region, md, kv) -> None:
    with set_forward_context(
        md, None, Context(), no_compile_layers={0: object()}, kv_cache_data={"layers.0": kv}
    ):
        region()


def test_steps_of_one_plan_repeat_the_kept_launch(calls) -> None:
    q = torch.zeros(4, 6, 16)
    region = attention_layer._BoundAttend(q, q[:, :2], q[:, :2], q, None, 0)
    kv = KV(torch.zeros(10, 16, 2, 16), torch.zeros(10, 16, 2, 16))
    for context in ([5, 9], [6, 10], [7, 11]):  # short contexts: one plan (no KV split)
        _step(region, _md(context), kv)
    assert calls == [("general", 2, 9), ("kept", 7), ("kept", 7)]
    calls.clear()
    _step(region, _md([5, 9, 3]), kv)  # three sequences: another plan
    _step(region, _md([5, 2000]), kv)  # a long context splits its keys: another plan
    _step(region, _md([6, 2001]), kv)
    other = KV(torch.zeros(10, 16, 2, 16), torch.zeros(10, 16, 2, 16))
    _step(region, _md([7, 2002]), other)  # another cache
    assert calls == [("general", 3, 9), ("general", 2, 2000), ("kept", 7), ("general", 2, 2002)]


def test_prefill_and_graph_safe_steps_always_plan(calls) -> None:
    q = torch.zeros(4, 6, 16)
    region = attention_layer._BoundAttend(q, q[:, :2], q[:, :2], q, None, 0)
    kv = KV(torch.zeros(10, 16, 2, 16), torch.zeros(10, 16, 2, 16))
    for _ in range(2):
        _step(region, _md([5, 9], rows_per_seq=2), kv)
        _step(region, _md([5, 9], graph_safe=True), kv)
    assert calls == [("general", 2, 9)] * 4


def test_layers_of_one_step_share_its_plan(calls) -> None:
    q = torch.zeros(4, 6, 16)
    layers = [attention_layer._BoundAttend(q, q[:, :2], q[:, :2], q, None, 0) for _ in range(3)]
    kv = KV(torch.zeros(10, 16, 2, 16), torch.zeros(10, 16, 2, 16))
    md = _md([5, 9])
    for layer in layers:
        _step(layer, md, kv)
    plans = attention_layer._DECODE_PLANS
    assert len(plans.ids) == 1 and plans.md is md
    for layer in layers:
        _step(layer, _md([6, 10]), kv)
    assert calls[3:] == [("kept", 7)] * 3

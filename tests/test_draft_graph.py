"""The draft model's DraftGraphs, bookkept on CPU with the logging fake segment backend of
tests/test_region_graph_cpu.py (real recordings are tested in tests/gpu/test_spec_decode_gpu.py):
capture records every capture size, largest first, each broken at the attention eager regions; a
pass replays its padded bucket; a pass the ladder holds but that finds no recording (or a drafter
never captured while graphs are on) runs eagerly and is counted; a pass beyond the ladder runs
eagerly as the target's steps do, uncounted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from executor_harness import build_tiny_llama
from test_region_graph_cpu import FakeBackend

from atomrt.graphs.draft_graph import DraftGraph
from atomrt.graphs.region_graph import TokenGraph
from atomrt.runtime.config import Config
from atomrt.workers.spec_decode.draft_model import DraftModel


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> DraftModel:
    folder = build_tiny_llama(tmp_path_factory.mktemp("draft_graph") / "m")
    config = Config(
        model=str(folder),
        device="cpu",
        speculative_config={"model": str(folder), "num_speculative_tokens": 2},
    )
    dm = DraftModel(config, torch.device("cpu"), torch.float32, 64, 8, 16, graphs_enabled=True)
    dm.allocate_kv_cache(16)
    return dm


def _rows(dm: DraftModel, n: int):
    z = np.zeros(n, np.int64)
    return dm._padded(z, z, z - 1, np.arange(n + 1, dtype=np.int32), np.ones(n, np.int32), z)


def test_capture_records_each_size_largest_first_and_replay_dispatch(drafter):
    log: list = []
    drafter.graph = DraftGraph(backend=FakeBackend(log))
    assert isinstance(drafter.graph, TokenGraph)
    drafter.capture([1, 2, 4])
    assert drafter.capture_sizes == [1, 2, 4]
    assert log.count("session") == 3
    num_layers = len(drafter.attn_layers)
    for bs in (1, 2, 4):  # one segment per layer's attention break, plus one
        assert drafter.graph.num_segments(bs, "decode") == num_layers + 1
    p = _rows(drafter, 3)
    assert p.rows == 4 and p.slot_mapping[3] == -1  # padded to the bucket, the padding writes no KV
    assert drafter._replays(p) and drafter.num_eager_passes == 0
    beyond = _rows(drafter, 5)
    assert beyond.rows == 5 and not drafter._replays(beyond) and drafter.num_eager_passes == 0
    del drafter.graph._recordings[(4, None)]  # a bucket lost: its pass runs eagerly, counted
    assert not drafter._replays(p) and drafter.num_eager_passes == 1


def test_a_drafter_never_captured_counts_every_pass(drafter):
    drafter.graph, drafter.capture_sizes, drafter.num_eager_passes = (
        DraftGraph(FakeBackend([])),
        [],
        0,
    )
    assert not drafter._replays(_rows(drafter, 1))
    assert not drafter._replays(_rows(drafter, 64))
    assert drafter.num_eager_passes == 2

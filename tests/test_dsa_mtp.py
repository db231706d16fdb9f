"""DeepSeek-V3.2's multi-token prediction: its MTP layer is a sparse one (MLA with the lightning
indexer, `index_topk` below the prompts' lengths). The drafter's later passes carry a request
graph's metadata (every length on the device), where the sparse attention is planned from shapes
alone (workers/layers/dsa_mla.py); every draft the engine proposes is the float64 formula's
(tests/mtp_harness.py, transformers' DeepseekV32DecoderLayer as the block), and speculation
leaves the greedy tokens as they are."""

from __future__ import annotations

import pytest
from dsa_harness import tiny_dsa_configs
from mtp_harness import build_mtp_folder
from test_mtp import _Drafts, _generate, _mtp, reference_drafts

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def v32_mtp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v32_mtp")
    return folder, build_mtp_folder(folder, seed=1, target_config=tiny_dsa_configs()["v32"])


@pytest.mark.parametrize("k", [1, 3])
def test_sparse_mtp_drafts_are_the_formulas_and_tokens_do_not_change(v32_mtp, monkeypatch, k):
    folder, ref = v32_mtp
    reference_tokens = _generate(folder)[0]
    drafts = _Drafts(monkeypatch)
    tokens, engine = _generate(folder, speculative_config=_mtp(k))
    assert tokens == reference_tokens
    assert engine.stats.spec_decode.num_drafts > 0 and len(drafts.seen) >= 20
    r64 = ref.double()
    for seq_tokens, got in drafts.seen.items():
        assert got == reference_drafts(r64, list(seq_tokens), k), len(seq_tokens)

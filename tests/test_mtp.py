"""MTP speculative decoding (`speculative_config={"method": "mtp", ...}`) on a tiny DeepSeek-V3
made by transformers with a multi-token-prediction layer added to its folder (mtp_harness.py), CPU:

- the MTP layer's forward equals the formula written out in float64 (transformers' decoder layer
  as its block); a checkpoint whose copy of the embedding is not the target's, or that has no MTP
  tensors, is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from mtp_harness import (
    MTPReference,
    build_mtp_folder,
    reference_mtp_hidden,
    reference_mtp_logits,
    target_hidden,
)

from atomrt.runtime.config import Config
from atomrt.runtime.forward_context import AttentionMetaData, Context, set_forward_context
from atomrt.workers.layers.attention import collect_attention_layers
from atomrt.workers.loading.loader import load_model


def _mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def random_layer(tmp_path_factory) -> tuple[Path, MTPReference]:
    folder = tmp_path_factory.mktemp("mtp_random")
    return folder, build_mtp_folder(folder, seed=1)


# ------------------------------------------------------------------ the layer against the formula


def test_mtp_layer_forward_equals_the_float64_formula(random_layer):
    folder, ref = random_layer
    config = Config(model=str(folder), device="cpu", speculative_config=_mtp(1))
    model = load_model(config, "cpu", torch.float32).model
    ids = [3, 17, 42, 99, 5, 8, 61, 7, 120, 11, 40, 2]
    r64 = ref.double()
    hidden = target_hidden(r64, ids)[:-1]  # h_t, t = 0..T-2
    nxt, pos = torch.tensor(ids[1:]), torch.arange(len(ids) - 1)
    want = reference_mtp_hidden(r64, hidden, nxt, pos)
    want_logits = reference_mtp_logits(r64, want)
    rows = len(ids) - 1
    md = AttentionMetaData(cu_seqlens_q_cpu=[0, rows], num_seqs=1, num_tokens=rows)
    ctx = Context(positions=pos, is_prefill=True, batch_size=1, running_bs=1, running_tokens=rows)
    layers = collect_attention_layers(model)
    assert sorted(layers) == [0, 1, 2, 3]  # the MTP layer's attention is layer num_hidden_layers
    with torch.inference_mode(), set_forward_context(md, config, ctx, no_compile_layers=layers):
        got = model.mtp(nxt, pos, hidden.float())
        logits = model.mtp.compute_logits(got)
    assert (got.double() - want).abs().max() < 1e-4  # seen: 1e-6
    assert (logits.double() - want_logits).abs().max() < 1e-4
    assert model.mtp.layer_for(0) == model.mtp.layer_for(2) == 0  # one layer, reused


def test_an_mtp_copy_of_the_embedding_must_be_the_targets(random_layer, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    shutil.copytree(random_layer[0], folder)
    tensors = load_file(str(folder / "mtp.safetensors"))
    tensors["model.layers.3.embed_tokens.weight"][5] += 1.0
    save_file(tensors, str(folder / "mtp.safetensors"))
    config = Config(model=str(folder), device="cpu", speculative_config=_mtp(1))
    with pytest.raises(ValueError, match="model.layers.3.embed_tokens.weight differs"):
        load_model(config, "cpu", torch.float32)


def test_a_checkpoint_without_mtp_tensors_is_refused_with_a_reason(tmp_path):
    """A checkpoint whose config promises an MTP layer but holds no tensors of it."""
    from deepseek_harness import build_deepseek_folder

    v3 = build_deepseek_folder(tmp_path / "v3", "v3")  # num_nextn_predict_layers: 1, no tensors
    assert json.loads((v3 / "config.json").read_text())["num_nextn_predict_layers"] == 1
    config = Config(model=str(v3), device="cpu", speculative_config=_mtp(1))
    with pytest.raises(ValueError, match="no tensors of the multi-token-prediction layer"):
        load_model(config, "cpu", torch.float32)

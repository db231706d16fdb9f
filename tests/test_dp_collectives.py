"""The collectives a MoE layer runs across DP ranks (gloo), their deadline, and what an idle rank
feeds them.

- `dp_all_gather` / `dp_reduce_scatter` against their definitions on two real gloo ranks;
- a rank whose peer never joins gets `CollectiveTimeout` naming its DP rank within the deadline;
- a MoE layer handed the wrong row count says so instead of entering the gather;
- an idle rank's dummy rows stay within the rotary tables and spread over the experts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dp_ranks import dp_ranks

from atomrt.distributed.communication_op import DPInfo
from atomrt.runtime.config import Config, ModelConfig
from atomrt.runtime.forward_context import DPMetadata, set_forward_context
from atomrt.workers.layers.moe import FusedMoE, select_experts
from atomrt.workers.loading.loader import load_model
from atomrt.workers.runner.input_batch import dummy_idle_inputs


def test_dp_gather_scatter_and_deadline_on_gloo(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(dp_ranks, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    x = [torch.arange(6, dtype=torch.float32).reshape(3, 2) + 100 * r for r in (0, 1)]
    expected = torch.cat(x)
    for r in (r0, r1):
        torch.testing.assert_close(r["gathered"], expected, rtol=0, atol=0)
    # rank d keeps rows [3d, 3d + 3) summed over ranks (scaled by 1 and 2)
    torch.testing.assert_close(r0["summed"], 3 * x[0], rtol=0, atol=0)
    torch.testing.assert_close(r1["summed"], 3 * x[1], rtol=0, atol=0)
    text, waited = r0["timeout"]
    assert "dp rank 0 of 2" in text and "all_gather" in text and "worker_timeout_s" in text
    assert 1.0 <= waited < 3.0, waited


def test_moe_layer_refuses_a_row_count_other_ranks_do_not_bring() -> None:
    layer = FusedMoE(4, 2, 16, 8, renormalize=True, dp=DPInfo(0, 2, None))
    md = DPMetadata.make([5, 8], 8)
    with (
        set_forward_context(None, None, None, dp_metadata=md),
        pytest.raises(RuntimeError, match=r"dp rank 0: MoE layer got 5 rows, .* runs 8"),
    ):
        layer(torch.zeros(5, 16))


def test_dp_metadata_counts() -> None:
    md = DPMetadata.make([3, 0, 7], 8)
    assert md.running_tokens_per_dp_rank == [8, 8, 8] and md.max_tokens_across_dp == 8
    assert md.num_padded_tokens == 14
    cap = DPMetadata.for_capture(2, 16)
    assert cap.num_tokens_across_dp == cap.running_tokens_per_dp_rank == [16, 16]
    assert cap.num_padded_tokens == 0


@pytest.mark.parametrize(
    "num_tokens,max_q_len,max_model_len,lens",
    [
        (8, 1, 64, [1] * 8),  # a decode bucket: one row per sequence
        (9, 3, 64, [3, 3, 3]),  # decode with two draft rows each
        (40, 40, 64, [40]),  # a prefill bucket: one sequence
        (150, 150, 64, [64, 64, 22]),  # longer than max_model_len: cut
    ],
)
def test_idle_rank_dummy_rows(num_tokens, max_q_len, max_model_len, lens) -> None:
    inputs = dummy_idle_inputs(num_tokens, max_q_len, max_model_len, vocab_size=512)
    assert inputs.num_tokens == num_tokens
    assert (inputs.cu_seqlens_q[1:] - inputs.cu_seqlens_q[:-1]).tolist() == lens
    assert int(inputs.positions.max()) < max_model_len
    assert inputs.context_lens.tolist() == lens
    assert (inputs.slot_mapping == -1).all() and inputs.sample_rows.size == 0
    assert len(set(inputs.input_ids.tolist())) == min(num_tokens, 512)


def test_idle_rank_dummy_tokens_spread_over_experts() -> None:
    """The dummy rows of an idle rank do not all route to one expert (tiny preset, dummy weights)."""
    config = Config(model="tiny-qwen3-moe", model_config=ModelConfig(load_format="dummy"))
    model = load_model(config, "cpu", torch.float32).model
    inputs = dummy_idle_inputs(64, 64, 2048, model.arch.vocab_size)
    layer = model.model.layers[0]
    with torch.no_grad():
        h = layer.post_attention_layernorm(
            model.model.embed_tokens(torch.from_numpy(inputs.input_ids))
        )
        _, ids = select_experts(layer.mlp.experts.gate(h), model.arch.num_experts_per_tok, True)
    assert len(set(ids[:, 0].tolist())) >= model.arch.num_experts // 2

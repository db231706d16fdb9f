"""ExpertTally: the routed experts each MoE layer's rows select, counted on eager steps through the
forward context, each layer known by its expert weights."""

import pytest
import torch

from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.forward_context import Context, set_forward_context
from atomrt.runtime.sampling_params import SamplingParams
from atomrt.workers.layers.expert_tally import ExpertTally
from atomrt.workers.layers.moe import routed_experts
from atomrt.workers.loading.presets import PRESETS


def test_the_tally_counts_eager_steps_of_each_moe_layer_by_its_weights() -> None:
    """Each layer's calls, told apart by its expert weights; a call outside the model, and a call
    whose forward context carries no tally, are not counted."""
    llm = LLM("tiny-deepseek-v3", load_format="dummy", device="cpu", enforce_eager=True)
    try:
        runner = llm.engine.executor.worker.runner
        tally = ExpertTally(runner.model)
        assert len(tally.layers) == 3  # 4 layers, the first dense
        runner.expert_tally = tally
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        llm.generate([[5, 17, 99, 3, 8]], params, use_tqdm=False)
        runner.expert_tally = None
        llm.generate([[5, 17]], params, use_tqdm=False)  # not counted
        # a prefill step of 5 rows, then two decode steps of one row (top-2 each)
        assert [len(d) for d in tally.distinct] == [3, 3, 3]
        top_k = PRESETS["tiny-deepseek-v3"]["num_experts_per_tok"]
        assert all(d[1:] == [top_k, top_k] and top_k <= d[0] <= 8 for d in tally.distinct)

        moe = runner.model.model.layers[2].mlp.experts
        x = torch.randn(3, moe.w13_weight.shape[-1])
        ids = torch.tensor([[0, 1], [1, 2], [0, 2]])
        weights = torch.full((3, 2), 0.5)
        with set_forward_context(None, None, Context(), expert_tally=tally):
            routed_experts(x, weights, ids, moe.w13_weight, moe.w2_weight)
            routed_experts(x, weights, ids, moe.w13_weight.clone(), moe.w2_weight)  # not its
        assert tally.distinct[1][-1] == 3 and [len(d) for d in tally.distinct] == [3, 4, 3]
        assert tally.num_steps == 3
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="no step was counted"):
        ExpertTally(runner.model).mean_touched()

"""The `experts_touched` probe: the routed experts each MoE layer's rows select, counted on the
probed steps through the executor (in-process and `mp` alike), each layer known by its expert
weights; a layer that reported no call of a step read every expert."""

import numpy as np
import pytest
import torch

from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import SamplingParams
from atomrt.workers.layers import expert_tally
from atomrt.workers.layers.moe import routed_experts
from atomrt.workers.loading.presets import PRESETS
from atomrt.workers.probes import routed_layers

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
TOP_K = PRESETS["tiny-deepseek-v3"]["num_experts_per_tok"]


def _probed(executor: str) -> list[np.ndarray]:
    """What the probe counted over a prompt of 5 tokens and two decode steps; then a request
    outside the probe, which adds nothing."""
    llm = LLM("tiny-deepseek-v3", load_format="dummy", device="cpu", executor=executor)
    try:
        with llm.engine.executor.probe("experts_touched") as counts:
            llm.generate([[5, 17, 99, 3, 8]], PARAMS, use_tqdm=False)
        assert llm.engine.executor.probing == ""
        llm.generate([[5, 17]], PARAMS, use_tqdm=False)
        return counts.arrays
    finally:
        llm.shutdown()


def test_the_probe_counts_each_moe_layer_of_each_probed_step() -> None:
    """A prefill step of 5 rows, then two decode steps of one row (top-2 each), per MoE layer (4
    layers, the first dense); a probe needs a known name and is opened once at a time."""
    arrays = _probed("inproc")
    assert [a.shape for a in arrays] == [(1, 3)] * 3
    assert all(TOP_K <= n <= 8 for n in arrays[0][0])
    assert all((a == TOP_K).all() for a in arrays[1:])
    llm = LLM("tiny-deepseek-v3", load_format="dummy", device="cpu")
    try:
        with pytest.raises(ValueError, match="probe: expected one of"):
            with llm.engine.executor.probe("experts"):
                pass
        with llm.engine.executor.probe("experts_touched") as counts:
            with pytest.raises(RuntimeError, match="already open"):
                with llm.engine.executor.probe("experts_touched"):
                    pass
        with pytest.raises(ValueError, match="no step was counted"):
            counts.mean_touched()
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_the_probe_counts_the_same_through_the_mp_executor() -> None:
    """The probe rides the plan and comes back in the step's result: a spawned rank counts what
    the in-process worker counts."""
    inproc, mp = _probed("inproc"), _probed("mp")
    assert len(mp) == len(inproc) and all((a == b).all() for a, b in zip(inproc, mp))


def test_a_tally_counts_a_layer_by_its_expert_weights_while_open() -> None:
    """A call of another tensor's experts, and a call with no tally open, are not counted."""
    llm = LLM("tiny-deepseek-v3", load_format="dummy", device="cpu", enforce_eager=True)
    try:
        model = llm.engine.executor.worker.runner.model
        tally = expert_tally.ExpertTally(routed_layers(model))
        assert len(tally.layers) == 3
        moe = model.model.layers[2].mlp.experts
        x = torch.randn(3, moe.w13_weight.shape[-1])
        ids = torch.tensor([[0, 1], [1, 2], [0, 2]])
        weights = torch.full((3, 2), 0.5)
        routed_experts(x, weights, ids, moe.w13_weight, moe.w2_weight)  # no tally open
        with expert_tally.counting(tally):
            routed_experts(x, weights, ids, moe.w13_weight, moe.w2_weight)
            routed_experts(x, weights, ids, moe.w13_weight.clone(), moe.w2_weight)  # not its
        assert tally.distinct == [[], [3], []] and tally.num_steps == 0
        assert tally.counts().shape == (0, 3)
        # a step's counts: the layers that reported no call read every expert
        e = moe.w13_weight.shape[0]
        assert tally.step_counts().tolist() == [[e, 3, e]]
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="no step was counted"):
        expert_tally.ExpertTally(routed_layers(model)).mean_touched()

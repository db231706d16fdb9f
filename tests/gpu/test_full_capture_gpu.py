"""GPU tier: a request graph (FULL) records the whole step inline, so no op of its forward may
plan from the host copies of the step's lengths (`cu_seqlens_q_cpu`, `context_lens_cpu`): the
recording would keep the capture's lengths and replay them for every later step, silently (the
sparse attention of DeepSeek-V3.2 and GLM-5 once did). Here those copies, in every graph-safe
metadata the runner builds, fail the capture where one is read, and each model family -- Llama
(SmolLM2's shape), Qwen3-MoE, DeepSeek-V3 (MLA), DeepSeek-V3.2 (sparse MLA, its first layers),
DeepSeek-V4 -- captures its FULL buckets and decodes through them.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_full_capture_gpu.py`.
"""

import dataclasses
import gc

import pytest
import torch
from model_harness import NoHostRead

from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.workers.runner.step_buffers import StepBuffers

pytestmark = pytest.mark.gpu

MODELS = {
    "SmolLM2-135M": {},
    "tiny-qwen3-moe": {},
    "tiny-deepseek-v3": {},
    "DeepSeek-V3.2": {
        "hf_overrides": {"num_hidden_layers": 4, "n_routed_experts": 64},
        "max_model_len": 1024,
    },
    "tiny-deepseek-v4": {},
}


@pytest.fixture
def host_reads_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every graph-safe metadata the runner builds carries host copies whose read fails."""
    build = StepBuffers._metadata

    def guarded(self, inputs, decision, seqs, rows):
        md = build(self, inputs, decision, seqs, rows)
        if not md.graph_safe:
            return md
        return dataclasses.replace(
            md,
            cu_seqlens_q_cpu=NoHostRead(md.cu_seqlens_q_cpu),
            context_lens_cpu=NoHostRead(md.context_lens_cpu),
        )

    monkeypatch.setattr(StepBuffers, "_metadata", guarded)


@pytest.mark.parametrize("model", list(MODELS))
def test_full_capture_reads_no_host_lengths(host_reads_fail: None, model: str) -> None:
    cc = CompilationConfig(level=0, cudagraph_mode="FULL", cuda_graph_sizes=[8])
    llm = LLM(model, load_format="dummy", device="cuda", compilation_config=cc, **MODELS[model])
    try:
        assert llm.engine.info.req_keys, "FULL captured request graphs"
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([[5, 6, 7], [9, 10, 11, 12, 13]], params)
        assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()

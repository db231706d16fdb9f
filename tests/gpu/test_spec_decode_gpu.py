"""GPU tier: speculative decoding under CUDA graphs gives eager's greedy tokens, and no draft pass
runs eagerly.

For n-gram drafts and for a draft model (the target's shape with the same dummy weights: every
draft is accepted, so verify steps of every width run), under FULL (verify steps replay request
graphs keyed `(running_bs, k)`) and TR_HYBRID (token buckets `bs * (k + 1)`), synchronously and
with async scheduling: greedy tokens equal eager decoding without speculation, the verify steps ran
as graphs, capture recorded the verify buckets, and the draft model's passes all replayed
DraftGraphs (`EngineStats.spec_decode.num_eager_draft_passes == 0`).

Dummy weights of SmolLM2-135M's shape in float32 (the GGUF does not travel; float32 keeps eager and
graph kernels well clear of greedy near-ties). Run: `pytest -m gpu tests/gpu/test_spec_decode_gpu.py`.
"""

import random

import pytest
import torch

from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig, CUDAGraphMode
from atomrt.runtime.entrypoints.llm import LLM

pytestmark = pytest.mark.gpu

MODEL = dict(model="SmolLM2-135M", load_format="dummy", dtype="float32", device="cuda")
K = 3
LADDER_TOP = 16
NUM_REQUESTS = 12
SPECS = {
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    },
    "draft_model": {"method": "draft_model", "model": "SmolLM2-135M", "num_speculative_tokens": K},
}


def _requests():
    rng = random.Random(0)
    prompts = []
    for i in range(NUM_REQUESTS):
        if i % 2:  # repetitive: the n-gram proposer finds its drafts
            pattern = [rng.randrange(1, 49000) for _ in range(rng.randrange(2, 6))]
            prompts.append(pattern * 8)
        else:
            prompts.append([rng.randrange(1, 49000) for _ in range(rng.randrange(1, 60))])
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + (i * 5) % 24, ignore_eos=True)
        for i in range(NUM_REQUESTS)
    ]
    return prompts, params


def _run(mode, spec=None, enforce_eager=False, **settings):
    cc = CompilationConfig(level=0, cudagraph_mode=mode, cuda_graph_sizes=[LADDER_TOP])
    llm = LLM(
        **MODEL,
        enforce_eager=enforce_eager,
        compilation_config=cc,
        max_num_seqs=LADDER_TOP,
        speculative_config=spec,
        **settings,
    )
    try:
        prompts, params = _requests()
        outs = llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outs], llm.engine
    finally:
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def eager_tokens():
    tokens, _ = _run(None, enforce_eager=True)
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "mode", [CUDAGraphMode.FULL, CUDAGraphMode.TR_HYBRID], ids=lambda m: m.name
)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_under_graphs_gives_eager_tokens(eager_tokens, method, mode, async_scheduling):
    tokens, engine = _run(mode, SPECS[method], async_scheduling=async_scheduling)
    assert tokens == eager_tokens
    stats = engine.stats
    assert stats.spec_decode.num_drafts > 0
    assert stats.spec_decode.num_eager_draft_passes == 0, "a draft pass ran eagerly"
    if mode is CUDAGraphMode.FULL:
        # verify buckets, and plain ones where adaptive n-gram speculation pauses (async)
        plain = method == "ngram" and async_scheduling
        assert {d for _, d in engine.info.req_keys} == ({0, K} if plain else {K})
        assert (1, K) in engine.info.req_keys
        assert stats.steps["req_graph"] > 0
        # only steps with prompt rows run eagerly (each prefills a request): every decode step,
        # with drafts or without, replays a request graph
        assert stats.steps["eager"] <= NUM_REQUESTS, stats.steps
    else:
        assert (K + 1) in engine.info.decode_token_sizes
        assert stats.steps["token_graph"] > 0
    if method == "draft_model":  # the drafter is the target itself
        assert stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens

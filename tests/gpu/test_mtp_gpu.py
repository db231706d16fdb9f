"""GPU tier: MTP speculation (the target's own multi-token-prediction layer drafts) under CUDA
graphs gives eager's greedy tokens, and no draft pass runs eagerly.

- The tiny DeepSeek-V3 preset with dummy weights (its MTP layer's included), float32: under FULL
  (verify steps replay request graphs keyed `(running_bs, k)`) and TR_HYBRID (token buckets
  `bs * (k + 1)`), synchronously and with async scheduling, k = 1 and 3: greedy tokens equal eager
  decoding without speculation, capture recorded the verify buckets, and every draft pass replayed
  a DraftGraph (`num_eager_draft_passes == 0`); the draft passes' device time is reported.
- The CPU tier's tiny DeepSeek-V3 with an MTP layer built to predict it (tests/mtp_harness.py),
  and its tiny DeepSeek-V3.2 with a random sparse one: under graphs the drafts are accepted
  exactly as often, position by position, as in an eager run with speculation (the drafts are
  the same), and the tokens are eager's.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_mtp_gpu.py`.
"""

import random

import pytest
import torch

from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig, CUDAGraphMode
from atomrt.runtime.entrypoints.llm import LLM

pytestmark = pytest.mark.gpu

MODEL = dict(model="tiny-deepseek-v3", load_format="dummy", dtype="float32", device="cuda")
LADDER_TOP = 16
NUM_REQUESTS = 12


def _requests(vocab: int):
    rng = random.Random(0)
    prompts = [
        [rng.randrange(2, vocab) for _ in range(rng.randrange(1, 60))] for _ in range(NUM_REQUESTS)
    ]
    params = [  # staggered lengths: the decode batch walks down the buckets
        SamplingParams(temperature=0.0, max_tokens=8 + (i * 5) % 24, ignore_eos=True)
        for i in range(NUM_REQUESTS)
    ]
    return prompts, params


def _run(model: dict, mode, k=None, enforce_eager=False, **settings):
    cc = CompilationConfig(level=0, cudagraph_mode=mode, cuda_graph_sizes=[LADDER_TOP])
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(
        **model,
        enforce_eager=enforce_eager,
        compilation_config=cc,
        max_num_seqs=LADDER_TOP,
        speculative_config=spec,
        **settings,
    )
    try:
        prompts, params = _requests(llm.engine.info.vocab_size)
        outs = llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outs], llm.engine
    finally:
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def eager_tokens():
    return _run(MODEL, None, enforce_eager=True)[0]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "mode", [CUDAGraphMode.FULL, CUDAGraphMode.TR_HYBRID], ids=lambda m: m.name
)
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_under_graphs_gives_eager_tokens(eager_tokens, k, mode, async_scheduling):
    tokens, engine = _run(MODEL, mode, k, async_scheduling=async_scheduling)
    assert tokens == eager_tokens
    spec = engine.stats.spec_decode
    assert spec.num_drafts > 0 and len(spec.accepted_per_position) == k
    assert spec.num_eager_draft_passes == 0, "a draft pass ran eagerly"
    assert spec.draft_seconds > 0
    if mode is CUDAGraphMode.FULL:
        assert {d for _, d in engine.info.req_keys} == {k} and (1, k) in engine.info.req_keys
        assert engine.stats.steps["req_graph"] > 0
        assert engine.stats.steps["eager"] <= NUM_REQUESTS, engine.stats.steps  # prefills only
    else:
        assert (k + 1) in engine.info.decode_token_sizes
        assert engine.stats.steps["token_graph"] > 0


@pytest.fixture(scope="module")
def predicting(tmp_path_factory):
    from mtp_harness import build_mtp_folder

    folder = tmp_path_factory.mktemp("mtp_predicting")
    build_mtp_folder(folder, seed=1, predicting=True)
    return dict(model=str(folder), dtype="float32", device="cuda")


@pytest.mark.parametrize(
    "mode", [CUDAGraphMode.FULL, CUDAGraphMode.TR_HYBRID], ids=lambda m: m.name
)
def test_graphed_drafts_are_the_eager_drafts(predicting, mode):
    want = _graphed_drafts_are_the_eager_drafts(predicting, mode)
    # the layer predicts the target (less well in k=3 chains on CUDA than in the CPU test)
    assert want.acceptance_rate_per_position[0] > 0.7


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    from dsa_harness import tiny_dsa_configs
    from mtp_harness import build_mtp_folder

    folder = tmp_path_factory.mktemp("mtp_sparse")
    build_mtp_folder(folder, seed=1, target_config=tiny_dsa_configs()["v32"])
    return dict(model=str(folder), dtype="float32", device="cuda")


@pytest.mark.parametrize(
    "mode", [CUDAGraphMode.FULL, CUDAGraphMode.TR_HYBRID], ids=lambda m: m.name
)
def test_sparse_mtp_under_graphs_drafts_as_eager(sparse, mode):
    """DeepSeek-V3.2's MTP layer is sparse (the CPU tier's tiny one, tests/test_dsa_mtp.py): its
    later draft passes run the graph-safe sparse attention inside their DraftGraph; the drafts
    are those of an eager run with speculation, and the tokens eager's."""
    _graphed_drafts_are_the_eager_drafts(sparse, mode)


def _graphed_drafts_are_the_eager_drafts(model: dict, mode):
    """k = 3 under `mode`: the tokens are eager's without speculation, every draft pass replayed
    a graph, and the drafts were accepted as in an eager run with speculation; returns that
    run's speculation stats."""
    plain, _ = _run(model, None, enforce_eager=True)
    eager, eager_engine = _run(model, None, k=3, enforce_eager=True)
    graphed, engine = _run(model, mode, k=3)
    assert eager == plain and graphed == plain
    want, got = eager_engine.stats.spec_decode, engine.stats.spec_decode
    assert got.num_eager_draft_passes == 0
    assert got.accepted_per_position == want.accepted_per_position
    assert got.num_drafts == want.num_drafts
    return want

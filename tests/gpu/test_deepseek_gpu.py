"""GPU tier: DeepSeek-family models (MLA over the latent cache, DeepSeekMoE) on CUDA. The tiny V3,
V3.2 and GLM-5 checkpoints made by transformers give its logits through the Triton latent write and
paged MLA decode (and the reference prefill; V3.2 and GLM-5 with the lightning indexer's sparse
attention); the tiny V3 preset's greedy tokens are eager's in every CUDA-graph mode at levels 0
and 3. The layers of DeepSeek-V2-Lite, GLM-4.7-Flash, DeepSeek-V3.2 and GLM-5 at their real
shapes -- their first four (dense, then MoE: every kind of layer; the sparse ones with 64 of their
256 routed experts, so that an H100 holds them), through `hf_overrides` -- give
eager's greedy tokens under FULL, TR_HYBRID and FULL_AND_TR_HYBRID at level 3, and every bucket of
both graph kinds replays like eager at level 0, in random order after all are captured (a sparse
model's TR_HYBRID decode step segment by segment only: its indexer region records no request
graph to join it). Float32, so that graphs and eager agree to well under a near-tie (a failure
names eager's top-2 margin where tokens part). `atomrt bench latency` counts the experts a batch
touches under FULL graphs.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_deepseek_gpu.py`.
"""

import gc
import json
import random

import pytest
import torch
from test_graph_modes_gpu import check_matches_eager, replay_every_bucket_like_eager

from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig, Config
from atomrt.runtime.entrypoints.llm import LLM

pytestmark = pytest.mark.gpu

TINY = "tiny-deepseek-v3"
REAL_SHAPES = ("DeepSeek-V2-Lite", "GLM-4.7-Flash", "DeepSeek-V3.2", "GLM-5")
SPARSE = ("DeepSeek-V3.2", "GLM-5")
FEW_LAYERS = {"num_hidden_layers": 4}  # dense, then MoE layers: every kind of layer, real shapes
# the sparse models' first 4 layers hold about 55 GB of float32 weights, more than an 80 GB card
# keeps beside graphs and a profile run; 64 of their 256 routed experts (each of its real shape)
# leave about 27 GB
SPARSE_LAYERS = {**FEW_LAYERS, "n_routed_experts": 64}
NUM_REQUESTS = 24


def _requests(logprobs=None):
    rng = random.Random(0)
    prompts = [
        [rng.randrange(2, 512) for _ in range(rng.randrange(1, 60))] for _ in range(NUM_REQUESTS)
    ]
    # staggered lengths: the decode batch walks down the buckets
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=1 + (i * 5) % 24, ignore_eos=True, logprobs=logprobs
        )
        for i in range(NUM_REQUESTS)
    ]
    return prompts, params


def _llm(model: str, level: int, mode, enforce_eager: bool = False) -> LLM:
    cc = CompilationConfig(level=level, cudagraph_mode=mode, cuda_graph_sizes=[16])
    overrides = {} if model == TINY else {"hf_overrides": FEW_LAYERS}
    if model in SPARSE:  # a small profile run beside the weights
        overrides.update(hf_overrides=SPARSE_LAYERS, max_model_len=1024)
    return LLM(
        model,
        load_format="dummy",
        dtype="float32",
        device="cuda",
        enforce_eager=enforce_eager,
        compilation_config=cc,
        max_num_seqs=16,
        **overrides,
    )


def _run(level: int, mode, enforce_eager: bool = False, model: str = TINY, logprobs=None):
    """Every request's greedy tokens (and logprobs when asked), and the engine's info."""
    llm = _llm(model, level, mode, enforce_eager)
    try:
        prompts, params = _requests(logprobs)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [o.token_ids for o in outs], [o.logprobs for o in outs], llm.engine.info
    finally:
        llm.shutdown()
        del llm
        gc.collect()  # what a failed run left, freed before the next model loads
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def eager_run():
    """Each model's eager tokens and top-2 logprobs, run once."""
    runs = {}

    def get(model: str):
        if model not in runs:
            runs[model] = _run(0, None, enforce_eager=True, model=model, logprobs=2)[:2]
        return runs[model]

    return get


@pytest.mark.parametrize(
    "level,mode",
    [(0, "FULL"), (0, "TR_HYBRID"), (0, "FULL_DECODE_ONLY"), (3, "TR_HYBRID"), (3, "FULL")],
)
def test_graph_modes_give_eager_tokens(eager_run, level: int, mode: str) -> None:
    tokens, _, info = _run(level, mode)
    eager_tokens, eager_logprobs = eager_run(TINY)
    check_matches_eager(tokens, info, mode, eager_tokens, f"{mode} level {level}", eager_logprobs)


@pytest.mark.parametrize("mode", ["FULL", "TR_HYBRID", "FULL_AND_TR_HYBRID"])
@pytest.mark.parametrize("model", REAL_SHAPES)
def test_real_shapes_give_eager_tokens_at_level_3(eager_run, model: str, mode: str) -> None:
    tokens, _, info = _run(3, mode, model=model)
    eager_tokens, eager_logprobs = eager_run(model)
    check_matches_eager(
        tokens, info, mode, eager_tokens, f"{model} x4 layers {mode} level 3", eager_logprobs
    )


@pytest.mark.parametrize("mode", ["FULL", "TR_HYBRID"])
@pytest.mark.parametrize("model", REAL_SHAPES)
def test_real_shapes_replay_every_bucket_like_eager(model: str, mode: str) -> None:
    """Under TR_HYBRID both replays of a decode bucket: segment by segment, and joined whole (a
    sparse model's segment by segment only)."""
    llm = _llm(model, 0, mode)
    try:
        for joined in (False, True) if mode == "TR_HYBRID" and model not in SPARSE else (False,):
            sizes = replay_every_bucket_like_eager(llm, mode, joined)
            assert sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    finally:
        llm.shutdown()
        del llm
        gc.collect()  # what a failed run left, freed before the next model loads
        torch.cuda.empty_cache()


def test_bench_latency_counts_the_experts_a_batch_touches_under_graphs(tmp_path) -> None:
    """The timed steps replay FULL graphs (async scheduling); the counted ones run eagerly after
    them. One row touches its top-k experts per MoE layer; the floor with them is below the one
    with every expert."""
    from atomrt.runtime.bench.latency import main
    from atomrt.workers.loading.presets import PRESETS

    out = tmp_path / "latency.json"
    argv = ["--model", TINY, "--modes", "FULL+async", "--level", "0", "--batch-sizes", "1,8"]
    argv += ["--decode-steps", "16", "--warmup-steps", "2", "--dtype", "float32"]
    assert main(argv + ["--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch_size"], r["forward_kind"]) for r in rows] == [
        (1, "req_graph"),
        (8, "req_graph"),
    ]
    top_k = PRESETS[TINY]["num_experts_per_tok"]
    assert rows[0]["experts_touched"] == top_k
    assert top_k <= rows[1]["experts_touched"] <= PRESETS[TINY]["n_routed_experts"]
    for r in rows:
        assert 0 < r["floor_ms"] < r["floor_all_experts_ms"]


@pytest.mark.parametrize(
    "name,graph_safe",
    [("v3", False), ("v32", False), ("glm5", False), ("v32", True), ("glm5", True)],
)
def test_cuda_logits_match_transformers(tmp_path, monkeypatch, name: str, graph_safe: bool) -> None:
    """A ragged prefill with padded rows, then decode steps, through the paged cache, against
    transformers' forward of the same sequences. `graph_safe`: every step with a request graph's
    metadata, as FULL records it (the sparse models' top-k picked from every slot of the block
    table, the indexer's scores by the Triton kernel; fewer picks than the prompts' tokens)."""
    from deepseek_harness import build_deepseek_folder
    from dsa_harness import build_dsa_folder
    from model_harness import record_as_request_graphs, run_prefill_and_decode
    from transformers import AutoModelForCausalLM

    from atomrt.workers.loading.loader import load_model

    if graph_safe:
        record_as_request_graphs(monkeypatch)
    build = build_deepseek_folder if name == "v3" else build_dsa_folder
    folder = build(tmp_path / name, name)
    prompts = [[3, 17, 42, 99, 5, 8, 61], [7, 1, 120], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    model = load_model(Config(model=str(folder), device="cuda"), "cuda", torch.float32).model
    result = run_prefill_and_decode(model, prompts, 4, block_size=16, num_pad_rows=3)
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    for s, prompt in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([result.sequences[s][:-1]])).logits[0][len(prompt) - 1 :]
        got = torch.stack([step[s] for step in result.logits]).cpu()
        assert (got - want).abs().max().item() <= 2e-4, (name, graph_safe, s)

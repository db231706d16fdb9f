"""GPU tier: a DeepSeek-family model (MLA over the latent cache, DeepSeekMoE) on CUDA. The tiny V3
checkpoint made by transformers gives its logits through the Triton latent write and paged MLA
decode (and the reference prefill); the tiny V3 preset's greedy tokens are eager's in every
CUDA-graph mode at levels 0 and 3 (float32, so graphs and eager agree to well under a near-tie).

Run on the GPU machine: `pytest -m gpu tests/gpu/test_deepseek_gpu.py`.
"""

import random

import pytest
import torch

from atomrt.runtime import SamplingParams
from atomrt.runtime.config import CompilationConfig, Config
from atomrt.runtime.entrypoints.llm import LLM

pytestmark = pytest.mark.gpu

MODEL = dict(model="tiny-deepseek-v3", load_format="dummy", dtype="float32", device="cuda")
NUM_REQUESTS = 24


def _requests():
    rng = random.Random(0)
    prompts = [
        [rng.randrange(2, 512) for _ in range(rng.randrange(1, 60))] for _ in range(NUM_REQUESTS)
    ]
    # staggered lengths: the decode batch walks down the buckets
    params = [
        SamplingParams(temperature=0.0, max_tokens=1 + (i * 5) % 24, ignore_eos=True)
        for i in range(NUM_REQUESTS)
    ]
    return prompts, params


def _run(level: int, mode, enforce_eager: bool = False) -> list[list[int]]:
    cc = CompilationConfig(level=level, cudagraph_mode=mode, cuda_graph_sizes=[16])
    llm = LLM(**MODEL, enforce_eager=enforce_eager, compilation_config=cc, max_num_seqs=16)
    try:
        prompts, params = _requests()
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def eager_tokens() -> list[list[int]]:
    return _run(0, None, enforce_eager=True)


@pytest.mark.parametrize(
    "level,mode",
    [(0, "FULL"), (0, "TR_HYBRID"), (0, "FULL_DECODE_ONLY"), (3, "TR_HYBRID"), (3, "FULL")],
)
def test_graph_modes_give_eager_tokens(eager_tokens, level: int, mode: str) -> None:
    assert _run(level, mode) == eager_tokens


def test_cuda_logits_match_transformers(tmp_path) -> None:
    from deepseek_harness import build_deepseek_folder
    from model_harness import run_prefill_and_decode
    from transformers import AutoModelForCausalLM

    from atomrt.workers.loading.loader import load_model

    folder = build_deepseek_folder(tmp_path / "v3", "v3")
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
        assert (got - want).abs().max().item() <= 2e-4, s

"""GPU tier: DeepSeek-V4's compressors on their side stream under CUDA graphs. The tiny V4 preset
(dummy weights, float32) captures its TR_HYBRID decode buckets with each compressed layer's fork
onto the model's side stream and its join back in the same recorded segment; every bucket, in a
random order, replays to the logits of the same batch run eagerly, and the greedy tokens of a
TR_HYBRID engine at levels 0 and 3 are an eager engine's.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_deepseek_v4_gpu.py`.
"""

import random

import pytest
import test_v4_kernels as cpu_tier
import torch
from test_graph_modes_gpu import check_matches_eager, replay_every_bucket_like_eager

from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.entrypoints.llm import LLM

pytestmark = pytest.mark.gpu

TINY = "tiny-deepseek-v4"


def _llm(level: int, mode, enforce_eager: bool = False) -> LLM:
    cc = CompilationConfig(level=level, cudagraph_mode=mode, cuda_graph_sizes=[8])
    return LLM(
        TINY,
        load_format="dummy",
        dtype="float32",
        device="cuda",
        enforce_eager=enforce_eager,
        compilation_config=cc,
        max_num_seqs=8,
    )


def _side_streams(llm: LLM):
    runner = llm.engine.executor.worker.runner
    model = getattr(runner.model, "_orig_mod", runner.model)
    return model.model.side_streams


def _close(llm: LLM) -> None:
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()


def test_side_stream_buckets_replay_like_eager() -> None:
    llm = _llm(0, "TR_HYBRID")
    try:
        streams = _side_streams(llm)
        assert list(streams._made) == ["cuda:0"], "the capture forked onto the side stream"
        side = streams._made["cuda:0"][0]
        assert side != torch.cuda.current_stream()
        sizes = replay_every_bucket_like_eager(llm, "TR_HYBRID")
        assert sizes == [1, 2, 3, 4, 5, 6, 7, 8]
        assert streams.pending_layer is None
        assert streams._made["cuda:0"][0] is side  # one stream for every step
    finally:
        _close(llm)


def _requests():
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(1, 50))] for _ in range(12)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1 + (i * 5) % 24, ignore_eos=True)
        for i in range(12)
    ]
    return prompts, params


def _tokens(llm: LLM):
    try:
        prompts, params = _requests()
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [o.token_ids for o in outs], llm.engine.info
    finally:
        _close(llm)


@pytest.mark.parametrize("level", [0, 3])
def test_side_stream_graphs_give_eager_tokens(level: int) -> None:
    eager, _ = _tokens(_llm(0, None, enforce_eager=True))
    tokens, info = _tokens(_llm(level, "TR_HYBRID"))
    check_matches_eager(tokens, info, "TR_HYBRID", eager, f"tiny V4 TR_HYBRID level {level}")


def test_kernels_read_e4m3_rows() -> None:
    """kv_cache_dtype fp8 on CUDA: every V4 kernel over an e4m3 cache as over its rows widened."""
    cpu_tier.check_kernels_read_e4m3_rows("cuda")

"""GPU tier: after start-up (which warms the host-planned attention kernels), prompts of new
lengths, contexts that split their keys and mixed prefill + decode steps compile no attention
kernel: the first requests of a fresh server do not wait on Triton. Dummy weights of
SmolLM2-135M's shape, FULL graphs (eager prefill and mixed steps) and TR_HYBRID (eager regions).

Run on the GPU machine: `pytest -m gpu tests/gpu/test_kernel_warmup_gpu.py`.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.gpu

ATTENTION = (
    "paged_attention_kernel",
    "reduce_splits_kernel",
    "decode_attention_kernel",
    "rope_write_kv_kernel",
    "write_kv_kernel",
)


@pytest.mark.parametrize("mode", ["FULL", "TR_HYBRID"])
def test_requests_after_start_up_compile_no_attention_kernel(mode: str) -> None:
    from triton import knobs

    from atomrt.runtime import SamplingParams
    from atomrt.runtime.config import CompilationConfig, CUDAGraphMode
    from atomrt.runtime.entrypoints.llm import LLM

    llm = LLM(
        model="SmolLM2-135M",
        load_format="dummy",
        device="cuda",
        max_num_seqs=16,
        max_model_len=4096,
        compilation_config=CompilationConfig(
            level=3, cudagraph_mode=CUDAGraphMode[mode], cuda_graph_sizes=[16]
        ),
    )
    compiled: list[str] = []

    def hook(**kw):
        compiled.append(kw["repr"].split("[", 1)[0])

    old, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, hook
    rng = random.Random(0)
    try:
        for n, length, out in [
            (1, 3, 4),
            (1, 100, 4),
            (3, 37, 8),
            (2, 700, 16),
            (16, 9, 8),
            (5, 2000, 4),
        ]:
            prompts = [[rng.randrange(10, 500) for _ in range(length)] for _ in range(n)]
            # staggered lengths: later prompts join running decodes (mixed steps)
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
        llm.generate(
            [[rng.randrange(10, 500) for _ in range(rng.randrange(2, 300))] for _ in range(12)],
            [
                SamplingParams(temperature=0, max_tokens=rng.randrange(1, 40), ignore_eos=True)
                for _ in range(12)
            ],
        )
    finally:
        knobs.runtime.jit_post_compile_hook = old
        llm.shutdown()
    print("kernels compiled after start-up:", compiled)
    assert not [name for name in compiled if name.endswith(ATTENTION)], compiled

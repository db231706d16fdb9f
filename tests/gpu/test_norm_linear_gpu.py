"""The residual add + RMSNorm fused into the skinny GEMM (and the standalone add+norm kernel) on
CUDA at SmolLM2-135M's shapes in bf16/fp16 against float64; and, in a bf16 model, FULL graphs give
the eager run's greedy tokens with the fused kernel in both (decode batches of 1-4 rows).

Run on the GPU machine:  python -m pytest -m gpu tests/gpu/test_norm_linear_gpu.py
The CPU tier (tests/test_norm_linear.py) runs the kernels through Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from atomrt.runtime import SamplingParams
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.llm import LLM
from atomrt.workers.kernels.rmsnorm import add_rmsnorm
from atomrt.workers.kernels.skinny_gemm import rmsnorm_skinny_linear
from atomrt.workers.layers.norm import rms_norm
from atomrt.workers.models.llama import LlamaDecoderLayer

pytestmark = pytest.mark.gpu
EPS = 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [960, 3072], ids=["qkv", "gate_up"])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_rmsnorm_skinny_linear_matches_float64(m: int, n: int, dtype: torch.dtype) -> None:
    k = 576
    g = torch.Generator(device="cuda").manual_seed(m * n)
    hidden = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    update = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(dtype)
    weight = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    y, h = rmsnorm_skinny_linear(hidden, update, norm_w, EPS, weight)
    want_h = hidden + update
    assert torch.equal(h, want_h), "hidden + update must be the eager sum exactly"
    normed = rms_norm(want_h, norm_w, EPS)  # the model's eager norm, rounded as it rounds
    want_y = normed.double() @ weight.double().T
    torch.testing.assert_close(y.double(), want_y, atol=3e-2, rtol=2e-2)
    # At most one rounding step from the eager norm's own projection.
    torch.testing.assert_close(y, torch.nn.functional.linear(normed, weight), atol=3e-2, rtol=2e-2)
    normed2, h2 = add_rmsnorm(hidden, update, norm_w, EPS)
    assert torch.equal(h2, want_h)
    torch.testing.assert_close(normed2, normed, atol=2e-2, rtol=1e-2)


def test_bf16_full_graphs_match_eager_with_the_fused_norms() -> None:
    """Same kernels in both runs (decode batches of at most 4 rows take the fused kernel eagerly and
    inside the request graphs), so the greedy tokens must be identical even in bf16."""
    prompts = [[7 + i] * (10 + 13 * i) for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(4)]

    def run(mode, enforce_eager: bool) -> list[list[int]]:
        cc = CompilationConfig(level=0, cudagraph_mode=mode, cuda_graph_sizes=[4])
        llm = LLM(model="SmolLM2-135M", load_format="dummy", dtype="bfloat16", device="cuda",
                  enforce_eager=enforce_eager, compilation_config=cc, max_num_seqs=4)
        try:
            blocks = [m for m in llm.engine.executor.worker.runner.model.modules() if isinstance(m, LlamaDecoderLayer)]
            assert blocks and all(b.fused_norms for b in blocks), "SmolLM2-135M's blocks should fuse their norms"
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()

    assert run("FULL", False) == run(None, True)

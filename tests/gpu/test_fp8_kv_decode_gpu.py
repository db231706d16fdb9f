"""GPU tier: the one-launch decode kernel over an e4m3 cache at Llama-3.1-8B's shape (8 KV heads,
group 4, head_dim 128, 128-key tiles, contexts past 2k keys), float16 products (the default) and
bfloat16 products (fp8_f16_products=False), each against a float64 reference over the dequantized
cache, and against each other.

Run on the GPU machine: `python -m pytest -m gpu tests/gpu/test_fp8_kv_decode_gpu.py`.
The CPU tier (tests/test_fp8_kv_decode_products.py) checks the float16 products at tiny shapes.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_kv_decode_products import run_fp8_decode

from atomrt.workers.kernels.attention.decode_attention import prepare_decode_counters

pytestmark = pytest.mark.gpu

LLAMA_8B = dict(num_kv_heads=8, group=4, head_dim=128, tile_n=128, device="cuda")
LONG_LENS = [1, 130, 2049, 3001]


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("q_scale", [1.0, 2.0e6], ids=["q1", "q2e6"])
def test_f16_and_bf16_products_at_llama_8b_shape(q_scale: float, num_splits: int) -> None:
    prepare_decode_counters(torch.device("cuda"))
    f16, ref = run_fp8_decode(q_scale, True, num_splits, lens=LONG_LENS, **LLAMA_8B)
    bf16, _ = run_fp8_decode(q_scale, False, num_splits, lens=LONG_LENS, **LLAMA_8B)
    assert torch.isfinite(f16).all()
    torch.testing.assert_close(f16, ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(bf16, ref, rtol=2e-2, atol=2e-2)
    # float16's p keeps 3 more bits than bfloat16's: no further from the reference
    assert (f16 - ref).abs().max() <= (bf16 - ref).abs().max() * 1.25 + 1e-4


def test_the_sweeps_candidates_at_llama_8b_shape() -> None:
    """Every e4m3 plan bench_decode_attention.py --sweep times (V widened first or not, 1 to 8 warps,
    1 to 3 stages, the splits it gives them at bs 32), compiled for this GPU, gives the float64
    reference's attention over contexts past 2k keys, and a V widened first gives the unwidened
    plan's output to float16 rounding: not bit for bit on a GPU, where the compiler orders the V
    products differently (1e-5 to 6e-5 apart at Llama-3.1-8B bs 32 on an H100); under the Triton
    interpreter the two are equal (tests/test_fp8_kv_decode_products.py)."""
    import dataclasses

    from test_fp8_kv_decode_products import _bench_decode_attention

    from atomrt.workers.kernels.attention.decode_attention import plan_decode

    prepare_decode_counters(torch.device("cuda"))
    bench = _bench_decode_attention()
    base = plan_decode(32, 8192, 8, 4, 128, 132, fp8_cache=True)
    shape = {k: v for k, v in LLAMA_8B.items() if k != "tile_n"}
    for name in bench.FP8_CANDIDATES:
        plan = bench.candidate_plan(base, name, 32 * 8, 132)
        out, ref = run_fp8_decode(1.0, True, plan.num_splits, lens=LONG_LENS, plan=plan, **shape)
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2, msg=name)
        if plan.widen_v_first:
            late = dataclasses.replace(plan, widen_v_first=False)
            same, _ = run_fp8_decode(1.0, True, plan.num_splits, lens=LONG_LENS, plan=late, **shape)
            torch.testing.assert_close(out, same, rtol=1e-3, atol=1e-3, msg=name)

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

"""GPU tier: MLA's one-launch rotary and latent write (mla_rope_write_kv_cache) at
DeepSeek-V2-Lite's shapes (16 heads, rope 64, latent 512, YaRN, interleaved pairs) in bfloat16:
RotaryEmbedding's rotated q_pe and k_pe bit for bit, and mla_write_kv_cache's rows; an e4m3
latent cache's rows over its scale too.

Run on the GPU machine: `python -m pytest -m gpu tests/gpu/test_mla_rope_write_gpu.py`.
The CPU tier (tests/test_mla_kernels.py) checks the same in float32 through the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from atomrt.workers.kernels.attention.mla_write import mla_rope_write_kv_cache, mla_write_kv_cache
from atomrt.workers.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.gpu

HEADS, NOPE, ROPE, LORA, BLOCK = 16, 128, 64, 512, 16
YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rope_write_at_v2_lite_shapes(cache_dtype: torch.dtype) -> None:
    dev, n = "cuda", 33
    rotary = RotaryEmbedding(ROPE, 16384, 10000.0, YARN, interleaved=True).to(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(n, HEADS, NOPE + ROPE, generator=gen, device=dev).to(torch.bfloat16)
    kv_a = torch.randn(n, LORA + ROPE, generator=gen, device=dev).to(torch.bfloat16)
    kv_c, k_pe = kv_a[:, :LORA], kv_a[:, LORA:]
    positions = torch.randint(0, 16384, (n,), generator=gen, device=dev)
    num_blocks = 8
    slots = torch.randperm(num_blocks * BLOCK, generator=gen, device=dev)[:n]
    slots[3] = -1
    scales = torch.tensor([0.02, 0.02], device=dev) if cache_dtype != torch.bfloat16 else None
    cache = torch.zeros(num_blocks, BLOCK, LORA + ROPE, device=dev, dtype=cache_dtype)
    q_rot = mla_rope_write_kv_cache(
        q[..., NOPE:], kv_c, k_pe, positions, rotary.cos_cache, rotary.sin_cache, True, cache,
        slots, scales,
    )  # fmt: skip
    want_q, want_k = rotary(positions, q[..., NOPE:], k_pe.unsqueeze(1))
    assert torch.equal(q_rot, want_q)
    want = torch.zeros_like(cache)
    mla_write_kv_cache(kv_c, want_k.squeeze(1), want, slots, scales)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))

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


def test_fp8_decode_steps_after_start_up_compile_no_decode_kernel() -> None:
    """An engine with kv_cache_dtype fp8 at Llama-3.1-8B's attention shape (two layers, dummy
    weights) warms its e4m3 decode plans at start-up: decode steps of one sequence and of enough
    sequences to fill the SMs (FP8_PLAN_D128, split and not) compile no attention kernel."""
    from triton import knobs

    from atomrt import SamplingParams
    from atomrt.runtime.entrypoints.llm import LLM

    llm = LLM(
        model="Llama-3.1-8B",
        load_format="dummy",
        device="cuda",
        hf_overrides={"num_hidden_layers": 2},
        kv_cache_dtype="fp8",
        enforce_eager=True,
        max_num_seqs=64,
        max_model_len=4096,
    )
    compiled: list[str] = []
    old = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"].split("[", 1)[0])
    try:
        for n, length in [(1, 3000), (20, 30), (20, 900), (40, 30), (40, 900)]:
            prompts = [[11 + (i * 7 + j) % 400 for j in range(length)] for i in range(n)]
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finally:
        knobs.runtime.jit_post_compile_hook = old
        llm.shutdown()
    assert not [name for name in compiled if "attention" in name], compiled

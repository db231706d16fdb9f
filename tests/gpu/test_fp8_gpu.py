"""GPU tier: FP8 on CUDA. The FP8 kernels at real model shapes against float64 references applying
the same quantization (the e4m3 rounding of the activation-quantization kernel too, which Triton's
interpreter cannot check); FP8 checkpoints (block-scaled and per-tensor, tiny Llama and tiny
DeepSeek-V3) and online quantization="fp8" giving the float64 reference's greedy tokens through
the engine under FULL and TR_HYBRID CUDA graphs; the FP8 KV cache at Llama-3.2-1B's shape, its
logprobs within a stated tolerance of the bfloat16 cache's.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_fp8_gpu.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch
from executor_harness import build_tiny_llama
from fp8_harness import quantize_folder, reference_logits, reference_model

from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.workers.kernels.gemm.fp8_gemm import quantize_fp8_triton, w8a8_fp8_linear
from atomrt.workers.kernels.moe.fused_moe_fp8 import fused_experts_fp8
from atomrt.workers.layers.moe import select_experts
from atomrt.workers.layers.quantization.fp8 import (
    dequantize_fp8,
    fp8_experts_ref,
    quantize_fp8,
    quantize_weight_per_row,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
PROMPTS = [[3, 17, 42, 9, 77, 5, 23], [11, 64, 2, 90], [8, 8, 31, 120, 4, 56, 7, 19, 3]]
MAX_TOKENS = 6
# atomrt in float32 on CUDA: an activation now and then rounds to the neighbouring e4m3 value
# (its input differs from float64's by float32 rounding), moving a logit by up to ~0.1
# (tests/test_fp8_checkpoints.py). The tiny models' best two logits are often only 0.03-0.2
# apart, so: every chosen token's logprob within LOGPROB_TOLERANCE of the reference's, every
# chosen token within NEAR_TIE of the reference's best logit, and most exactly its argmax.
LOGPROB_TOLERANCE = 0.2
NEAR_TIE = 0.1
MIN_EXACT = 0.8


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------ kernels at real shapes


@pytest.mark.parametrize("group", [128, None])
@pytest.mark.parametrize("k", [4096, 14336])
def test_quant_kernel_rounds_like_the_reference_at_real_shapes(group: Optional[int], k: int):
    """Per token and 1x128 group, or per token: the same float32 scales, the same e4m3 values
    (round to nearest even) but for a rare tie that float32 division rounds the other way."""
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(k)) * 4
    x[0, :7] = torch.tensor([1e4, -1e4, 0.0, 1e-30, 3.0, -448.0, 124.3])  # saturate, zero, tiny
    q, s = quantize_fp8_triton(x.to(DEVICE), group)
    rq, rs = quantize_fp8(x, group)
    torch.testing.assert_close(s.cpu(), rs, rtol=1e-6, atol=0)
    differ = (q.cpu().float() != rq.float()).float().mean().item()
    assert differ < 1e-3, f"{differ:.2e} of the e4m3 values differ from the reference's"
    steps = (q.cpu().float() - rq.float()).abs() / rq.float().abs().clamp(min=2**-6)
    assert steps.max() <= 0.125 + 1e-6  # one e4m3 step at most (3 mantissa bits)
    assert torch.isfinite(q.float()).all()


@pytest.mark.parametrize("m", [1, 8, 64, 512])
@pytest.mark.parametrize("group", [128, None])
@pytest.mark.parametrize("nk", [(6144, 4096), (4096, 14336)], ids=["8B-qkv", "8B-down"])
def test_w8a8_linear_at_llama_8b_shapes(m: int, group: Optional[int], nk: tuple[int, int]):
    """bf16 x quantized by the kernel, the w8a8 GEMM (skinny rows and the FP8 MMA): the float64
    product of the same e4m3 operands and scales, to bf16's output rounding."""
    n, k = nk
    gen = torch.Generator(DEVICE).manual_seed(m + n)
    w = torch.randn(n, k, generator=gen, device=DEVICE) * 0.02
    qw, sw = quantize_fp8(w, group) if group else quantize_weight_per_row(w)
    x = (torch.randn(m, k, generator=gen, device=DEVICE) * 2).to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out.copy_(w8a8_fp8_linear(x, qw, sw, None, group))
    qx, sx = quantize_fp8_triton(x, group)
    ref = (
        dequantize_fp8(qx, sx, group, torch.float64)
        @ dequantize_fp8(qw, sw, group, torch.float64).T
    )
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 8e-3  # bf16 output: 2^-8 relative rounding


@pytest.mark.parametrize("num_tokens", [1, 32, 512])
@pytest.mark.parametrize("group", [128, None])
def test_fused_moe_fp8_at_v2_lite_shape(num_tokens: int, group: Optional[int]):
    """DeepSeek-V2-Lite's routed experts (64 experts, hidden 2048, 1408 features, top 6), bf16
    activations: the float64 reference quantizing the same way."""
    gen = torch.Generator(DEVICE).manual_seed(num_tokens)
    e, hidden, inter, top_k = 64, 2048, 1408, 6
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen, device=DEVICE) * 0.02
    w2 = torch.randn(e, hidden, inter, generator=gen, device=DEVICE) * 0.02
    q13, s13 = quantize_fp8(w13, group) if group else quantize_weight_per_row(w13)
    q2, s2 = quantize_fp8(w2, group) if group else quantize_weight_per_row(w2)
    x = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(torch.bfloat16)
    logits = torch.randn(num_tokens, e, generator=gen, device=DEVICE)
    weights, ids = select_experts(logits, top_k, True)
    y = torch.full_like(x, float("nan"))
    y.copy_(fused_experts_fp8(x, q13, q2, s13, s2, weights, ids, group))
    ref = fp8_experts_ref(x.double(), q13, q2, s13, s2, weights.double(), ids, group)
    assert torch.isfinite(y).all()
    assert _rel(y, ref) < 2e-2  # bf16 activations and the intermediate's re-quantization


# ------------------------------------------------------------------ models through the engine


@pytest.fixture(scope="module")
def llama_256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("llama") / "model", hidden_size=256)


@pytest.fixture(scope="module")
def deepseek_v3_256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deepseek_harness import make_hf_deepseek, tiny_deepseek_configs

    cfg = tiny_deepseek_configs()["v3"]
    cfg.hidden_size, cfg.intermediate_size = 256, 160
    folder = tmp_path_factory.mktemp("v3") / "src"
    make_hf_deepseek(cfg, seed=1).save_pretrained(folder, safe_serialization=True)
    return folder


def _engine_tokens(folder: Path, mode: Optional[str], **settings: object) -> list:
    """Greedy outputs (token ids and each chosen token's logprob) of an engine in float32."""
    cc = CompilationConfig(level=0, cudagraph_mode=mode, cuda_graph_sizes=[8])
    llm = LLM(
        str(folder),
        device=DEVICE,
        dtype="float32",
        enforce_eager=mode is None,
        compilation_config=cc,
        max_num_seqs=8,
        **settings,
    )
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        return [
            (
                list(o.outputs[0].token_ids),
                [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
            )
            for o in outs
        ]
    finally:
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


def _check_reference_tokens(reference: torch.nn.Module, outputs: list, what: str) -> None:
    """Along atomrt's sequences, the float64 reference's logits (see LOGPROB_TOLERANCE)."""
    exact, steps, worst_gap, worst_lp = 0, 0, 0.0, 0.0
    for prompt, (tokens, logprobs) in zip(PROMPTS, outputs):
        logits = reference_logits(reference, prompt + tokens[:-1])[len(prompt) - 1 :]
        ref_lp = torch.log_softmax(logits, dim=-1)
        for row, lp_row, token, lp in zip(logits, ref_lp, tokens, logprobs):
            worst_gap = max(worst_gap, (row.max() - row[token]).item())
            worst_lp = max(worst_lp, abs(lp_row[token].item() - lp))
            exact += int(row.argmax().item() == token)
            steps += 1
    summary = f"{what}: {exact}/{steps} exact, worst gap {worst_gap:.3f}, logprob {worst_lp:.3f}"
    print(summary)
    assert worst_gap < NEAR_TIE and worst_lp < LOGPROB_TOLERANCE, summary
    assert exact >= MIN_EXACT * steps, summary


MODES = [None, "FULL", "TR_HYBRID"]


@pytest.mark.parametrize("scheme", ["block", "tensor"])
@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
def test_fp8_checkpoint_graphs_give_the_float64_reference_tokens(
    model: str, scheme: str, llama_256: Path, deepseek_v3_256: Path, tmp_path: Path
) -> None:
    src = llama_256 if model == "llama" else deepseek_v3_256
    quantize_folder(src, tmp_path / "fp8", scheme, tmp_path / "deq")
    reference = reference_model(tmp_path / "deq", scheme)
    tokens = {}
    for mode in MODES:
        tokens[mode] = _engine_tokens(tmp_path / "fp8", mode)
        _check_reference_tokens(reference, tokens[mode], f"{model} {scheme} {mode or 'eager'}")
    eager = [t for t, _ in tokens[None]]
    for mode in ("FULL", "TR_HYBRID"):  # the same kernels, replayed: eager's tokens
        assert [t for t, _ in tokens[mode]] == eager, mode


def test_online_fp8_graphs_give_the_float64_reference_tokens(
    llama_256: Path, tmp_path: Path
) -> None:
    """quantization="fp8" on a float checkpoint: per-channel weights, per-token activations."""
    quantize_folder(llama_256, tmp_path / "fp8", "channel", tmp_path / "deq")
    reference = reference_model(tmp_path / "deq", "channel")
    tokens = {}
    for mode in MODES:
        tokens[mode] = _engine_tokens(llama_256, mode, quantization="fp8")
        _check_reference_tokens(reference, tokens[mode], f"online fp8 {mode or 'eager'}")
    eager = [t for t, _ in tokens[None]]
    for mode in ("FULL", "TR_HYBRID"):  # the same kernels, replayed: eager's tokens
        assert [t for t, _ in tokens[mode]] == eager, mode


# ------------------------------------------------------------------ FP8 KV cache, real shape

# Dummy weights of Llama-3.2-1B's shape (16 layers, 8 KV heads of 128), bfloat16, 600-token
# prompts: each cached key and value element moves by up to 1/16 of itself in e4m3; the chosen
# tokens' logprobs must stay within this of the bfloat16 cache's while the sequences agree.
KV_LOGPROB_TOLERANCE = 0.5


def _kv_run(kv_cache_dtype: str) -> list:
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(2, 120000) for _ in range(600)] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    llm = LLM(
        "Llama-3.2-1B",
        load_format="dummy",
        device=DEVICE,
        dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=1024,
        max_num_seqs=8,
        compilation_config=CompilationConfig(level=0, cudagraph_mode="FULL"),
    )
    try:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


def test_fp8_kv_cache_at_llama_1b_shape_stays_near_the_bf16_cache() -> None:
    bf16, fp8 = _kv_run("auto"), _kv_run("fp8")
    worst, compared = 0.0, 0
    for a, b in zip(bf16, fp8):
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if ta != tb:
                break  # the sequences part: later rows read different contexts
            worst = max(worst, abs(la[ta].logprob - lb[tb].logprob))
            compared += 1
    print(f"FP8 KV cache: {compared} tokens compared, worst logprob difference {worst:.4f}")
    assert compared >= 8  # every request's first token at least
    assert worst < KV_LOGPROB_TOLERANCE

"""Our Llama-family models on CUDA against Hugging Face transformers (float32, CPU) on the same
weights: the GPU kernels in a real forward -- decode attention, the skinny GEMM with the residual
add + RMSNorm and the SiLU fused in (bf16 decode steps of at most 4 rows), add_rms_norm (prefill,
and every float32 step), paged prefill attention.

Run on the GPU machine:  python -m pytest -m gpu tests/gpu/test_models_hf_gpu.py
The tiny configurations and the teacher-forced comparison are tests/test_models_hf.py's: our greedy
sequences are fed to transformers, which gives the logits each of our steps should have produced.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_harness import run_prefill_and_decode
from test_models_hf import PROMPTS, _hf_logits, build_hf_folders

from atomrt.runtime.config import Config, ModelConfig
from atomrt.workers.loading.loader import load_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_hf_folders(tmp_path_factory)


NUM_DECODE_STEPS = 6
# float32: every product in full fp32 (no TF32) on both sides, only the summation order differs.
# bfloat16: relative error of each step's logits vector (bf16 keeps 8 bits: ~0.4% per rounding; the
# same comparison on CPU, torch's bf16 ops, gives 1.0-1.6%). A wrong kernel is off by far more.
FP32_MAX_ABS = 1e-3
BF16_MAX_REL = 0.04


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama", "llama_tied", "llama3_rope", "qwen2", "qwen3"])
def test_tiny_model_on_cuda_matches_transformers(
    hf_folders: dict[str, Path], name: str, dtype: torch.dtype
) -> None:
    from transformers import AutoModelForCausalLM

    folder = hf_folders[name]
    dtype_name = "float32" if dtype == torch.float32 else "bfloat16"
    ours = load_model(
        Config(model=str(folder), model_config=ModelConfig(dtype=dtype_name)), "cuda", dtype
    ).model
    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # 3 sequences + 1 padded row: decode steps of 4 rows, the most the skinny GEMM takes
    result = run_prefill_and_decode(ours, PROMPTS, NUM_DECODE_STEPS, block_size=16, num_pad_rows=1)
    for s, prompt in enumerate(PROMPTS):
        want = _hf_logits(hf_model, result.sequences[s][:-1], len(prompt))  # [steps + 1, vocab]
        got = torch.stack([step_logits[s] for step_logits in result.logits]).float().cpu()
        if dtype == torch.float32:
            worst = (got - want).abs().max().item()
            assert worst <= FP32_MAX_ABS, (
                f"{name} seq {s}: max |logits - transformers| = {worst:.3g}"
            )
        else:
            rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
            assert rel <= BF16_MAX_REL, f"{name} seq {s}: max relative logits error {rel:.3g}"

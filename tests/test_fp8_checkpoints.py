"""FP8 checkpoints (block-scaled, per tensor, per channel, static input scales) and online FP8
quantization, against a float64 reference of the quantized model (fp8_harness.py): transformers in
float64 on the dequantized weights, each quantized layer's input quantized as atomrt quantizes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from executor_harness import build_tiny_llama
from fp8_harness import quantize_folder, reference_logits, reference_model
from model_harness import run_prefill_and_decode

from atomrt.runtime.config import Config, ConfigError
from atomrt.workers.layers.quantization.fp8 import FP8_DTYPE
from atomrt.workers.loading.loader import load_model

PROMPTS = [[3, 17, 42, 9, 77, 5, 23], [11, 64, 2, 90], [8, 8, 31, 120, 4, 56, 7, 19, 3]]
DECODE_STEPS = 4
# atomrt in float64 quantizes exactly as the reference does (float32 scales): the logits, O(1-10),
# agree to float64's rounding of the float32 parts
TOLERANCE = 1e-5
# atomrt in float32: now and then an activation rounds to the neighbouring e4m3 value (its input
# differs from float64's by float32 rounding), moving a logit by up to ~0.1
TOLERANCE_FLOAT32 = 0.2


def _check_against_reference(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Largest logit difference over the prefill and every decode step; atomrt's greedy tokens
    must be the reference's (its argmax at every step of atomrt's sequence)."""
    result = run_prefill_and_decode(model, PROMPTS, DECODE_STEPS)
    worst = 0.0
    for s, prompt in enumerate(PROMPTS):
        ref = reference_logits(reference, result.sequences[s][:-1])[len(prompt) - 1 :]
        got = torch.stack([step[s] for step in result.logits]).double().cpu()
        worst = max(worst, (got - ref).abs().max().item())
        assert ref.argmax(dim=-1).tolist() == result.sequences[s][len(prompt) :]
    return worst


@pytest.fixture(scope="module")
def llama_256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hidden 256: two 128-feature groups per row, q/k/v rows over several blocks, the MLP's 96
    features a partial block."""
    return build_tiny_llama(tmp_path_factory.mktemp("llama") / "model", hidden_size=256)


@pytest.mark.parametrize("scheme", ["block", "tensor", "channel", "tensor_static"])
def test_llama_fp8_checkpoint_matches_float64_reference(
    llama_256: Path, tmp_path: Path, scheme: str
) -> None:
    ignored = ("model.layers.1.mlp.down_proj",) if scheme == "block" else ()
    scales = quantize_folder(llama_256, tmp_path / "fp8", scheme, tmp_path / "deq", ignored)
    loaded = load_model(Config(model=str(tmp_path / "fp8")), "cpu", torch.float64)
    layer0 = loaded.model.model.layers[0]
    assert layer0.self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    assert layer0.mlp.down_proj.weight.dtype == FP8_DTYPE
    if ignored:  # the listed layer stays float
        assert loaded.model.model.layers[1].mlp.down_proj.weight.dtype == torch.float64
    reference = reference_model(
        tmp_path / "deq", scheme, ignored, scales if scheme == "tensor_static" else None
    )
    assert _check_against_reference(loaded.model, reference) < TOLERANCE
    if scheme == "block":  # the float32 model: the same tokens, logits close
        loaded = load_model(Config(model=str(tmp_path / "fp8")), "cpu", torch.float32)
        assert _check_against_reference(loaded.model, reference) < TOLERANCE_FLOAT32


def test_deepseek_v3_block_fp8_checkpoint_matches_float64_reference(tmp_path: Path) -> None:
    """MLA (kv_b_proj dequantized, the rest FP8), the FP8 routed and shared experts, the float
    router; hidden 256 so that rows and features span several blocks."""
    from deepseek_harness import make_hf_deepseek, tiny_deepseek_configs

    cfg = tiny_deepseek_configs()["v3"]
    cfg.hidden_size, cfg.intermediate_size = 256, 160
    make_hf_deepseek(cfg, seed=1).save_pretrained(tmp_path / "src", safe_serialization=True)
    quantize_folder(tmp_path / "src", tmp_path / "fp8", "block", tmp_path / "deq")
    loaded = load_model(Config(model=str(tmp_path / "fp8")), "cpu", torch.float64)
    moe = loaded.model.model.layers[1].mlp.experts
    assert moe.w13_weight.dtype == FP8_DTYPE and moe.w2_weight.dtype == FP8_DTYPE
    assert moe.w13_weight_scale.shape == (8, 64, 2)  # per row, per 128 hidden features
    attn = loaded.model.model.layers[0].self_attn
    assert attn.fused_qkv_a_proj.weight.dtype == FP8_DTYPE
    assert attn.kv_b_proj.weight.dtype == torch.float64  # absorbed into W_UK / W_UV
    reference = reference_model(tmp_path / "deq", "block")
    assert _check_against_reference(loaded.model, reference) < TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["block", "channel", "tensor_static"])
def test_fp8_checkpoint_on_the_gpu(llama_256: Path, tmp_path: Path, scheme: str) -> None:
    """The Triton kernels (activation quantization, w8a8 GEMM: skinny decode rows and MMA
    prefill rows) in a float32 and a bfloat16 model against the float64 reference."""
    scales = quantize_folder(llama_256, tmp_path / "fp8", scheme, tmp_path / "deq")
    reference = reference_model(
        tmp_path / "deq", scheme, (), scales if scheme == "tensor_static" else None
    )
    loaded = load_model(Config(model=str(tmp_path / "fp8")), "cuda", torch.float32)
    assert _check_against_reference(loaded.model, reference) < TOLERANCE_FLOAT32
    bf16 = load_model(Config(model=str(tmp_path / "fp8")), "cuda", torch.bfloat16)
    result = run_prefill_and_decode(bf16.model, PROMPTS, DECODE_STEPS)
    ref = reference_logits(reference, result.sequences[0][:-1])[len(PROMPTS[0]) - 1 :]
    got = torch.stack([step[0] for step in result.logits]).double().cpu()
    assert (got - ref).abs().max() < 0.5  # bfloat16 activations: closeness, not equality


@pytest.mark.gpu
def test_deepseek_v3_fp8_on_the_gpu(tmp_path: Path) -> None:
    """The FP8 fused-MoE kernel and the FP8 GEMMs in the MLA model, float32, on CUDA."""
    from deepseek_harness import make_hf_deepseek, tiny_deepseek_configs

    cfg = tiny_deepseek_configs()["v3"]
    cfg.hidden_size, cfg.intermediate_size = 256, 160
    make_hf_deepseek(cfg, seed=1).save_pretrained(tmp_path / "src", safe_serialization=True)
    quantize_folder(tmp_path / "src", tmp_path / "fp8", "block", tmp_path / "deq")
    loaded = load_model(Config(model=str(tmp_path / "fp8")), "cuda", torch.float32)
    reference = reference_model(tmp_path / "deq", "block")
    assert _check_against_reference(loaded.model, reference) < TOLERANCE_FLOAT32


def test_online_fp8_quantizes_a_float_checkpoint(llama_256: Path, tmp_path: Path) -> None:
    """quantization="fp8": one scale per output row, per-token activations; the reference is the
    per-channel quantization of the same weights."""
    quantize_folder(llama_256, tmp_path / "fp8", "channel", tmp_path / "deq")
    config = Config(model=str(llama_256), model_config={"quantization": "fp8"})
    loaded = load_model(config, "cpu", torch.float64)
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.shape == (qkv.weight.shape[0], 1)
    reference = reference_model(tmp_path / "deq", "channel")
    assert _check_against_reference(loaded.model, reference) < TOLERANCE


def _fp8_folder(tmp_path: Path, llama: Path, **qc_changes: object) -> Path:
    quantize_folder(llama, tmp_path / "fp8", "block", tmp_path / "deq")
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"].update(qc_changes)
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "fp8"


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(quant_method="gptq"), "quant_method 'gptq' is not supported"),
        (dict(quant_method="awq"), "quant_method 'awq' is not supported"),
        (dict(weight_block_size=[64, 64]), r"weight_block_size \[64, 64\] is not supported"),
        (dict(activation_scheme="static"), "activation_scheme 'static' with weight_block_size"),
        (dict(activation_scheme="mixed"), "activation_scheme 'mixed'"),
        (dict(fmt="e5m2"), "fmt 'e5m2'"),
        (
            dict(modules_to_not_convert=["model.layers.0.self_attn.q_proj"]),
            "qkv_proj fuses q_proj, k_proj, v_proj",
        ),
    ],
)
def test_unsupported_quantization_is_refused_by_name(
    llama_256: Path, tmp_path: Path, changes: dict, match: str
) -> None:
    folder = _fp8_folder(tmp_path, llama_256, **changes)
    with pytest.raises(ValueError, match=match):
        load_model(Config(model=str(folder)), "cpu", torch.float32)


def test_quantization_knob_is_checked(llama_256: Path, tmp_path: Path) -> None:
    """quantization="gptq" is refused at the knob (on an FP8 checkpoint too); "fp8" on an FP8
    checkpoint loads it as it ships; a float tensor where the config says FP8 is named."""
    folder = _fp8_folder(tmp_path, llama_256)
    with pytest.raises(ConfigError, match="model_config.quantization.*'gptq'"):
        Config(model=str(folder), model_config={"quantization": "gptq"})
    loaded = load_model(
        Config(model=str(folder), model_config={"quantization": "fp8"}), "cpu", torch.float32
    )
    assert loaded.model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8_DTYPE
    cfg = json.loads((llama_256 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "bad").mkdir()
    for f in llama_256.iterdir():
        if f.name != "config.json":
            (tmp_path / "bad" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "bad" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="checkpoint's weight is F32, but quantization_config"):
        load_model(Config(model=str(tmp_path / "bad")), "cpu", torch.float32)


@pytest.mark.slow
def test_fp8_checkpoint_at_level_3_gives_the_eager_tokens(llama_256: Path, tmp_path: Path) -> None:
    """The FP8 GEMM is one opaque op in the compiled graph (level 3, Inductor on CPU)."""
    from atomrt import SamplingParams
    from atomrt.runtime.entrypoints.llm import LLM

    quantize_folder(llama_256, tmp_path / "fp8", "block", tmp_path / "deq")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for name, settings in (("eager", {}), ("level3", {"compilation_config": 3})):
        with LLM(
            str(tmp_path / "fp8"), enforce_eager=name == "eager", device="cpu", **settings
        ) as llm:
            outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        tokens[name] = [o.outputs[0].token_ids for o in outs]
    assert tokens["level3"] == tokens["eager"]

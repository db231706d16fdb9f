"""The FP8 KV cache's per-layer scales: from the checkpoint (k_scale / v_scale and the other names
FP8 checkpoints use) or calibrated at start-up (amax x margin / 448 over a calibration forward).

The embedded SmolLM2-135M keeps values (~0.01) that a scale of 1.0 leaves in e4m3's few subnormal
steps: with calibrated scales its logits stay near the float32 cache's and the chat answer names
Paris."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_fp8_kv_cache as fp8_kv_cache
import torch
from executor_harness import build_tiny_llama
from safetensors.torch import save_file
from test_fp8_kv_cache import _run, _worst

from atomrt import SamplingParams
from atomrt.runtime.config import Config
from atomrt.runtime.entrypoints.llm import LLM, load_tokenizer_for
from atomrt.workers.layers.attention import collect_attention_layers
from atomrt.workers.layers.attention_ref import from_cache_dtype, to_cache_dtype
from atomrt.workers.layers.quantization.fp8 import Fp8Config
from atomrt.workers.loading.kv_scales import kv_scale_target
from atomrt.workers.loading.loader import load_model
from atomrt.workers.runner.kv_scales import settle_kv_scales
from atomrt.workers.runner.kv_sizing import determine_num_blocks, dummy_forward
from atomrt.workers.runner.model_runner import ModelRunner

FP8 = torch.float8_e4m3fn
# SmolLM2's logits (up to ~40) with the calibrated e4m3 cache vs the float32 cache, over three
# prompts' prefill and 8 decode steps on the same tokens: measured 1.79 worst (e4m3's 3 mantissa
# bits move each key and value by up to 1/16 of itself); the bound leaves room.
SMOL_TOLERANCE = 2.5


def test_scaled_cache_round_trip_keeps_small_values() -> None:
    """Values of ~0.01 come back within e4m3's relative step (1/16) with a scale of amax / 448;
    with a scale of 1.0 they land on subnormals, off by far more."""
    x = torch.linspace(-0.02, 0.02, 101, dtype=torch.float64)
    x = x[x.abs() > 1e-3]
    scale = float(x.abs().max()) / 448
    back = from_cache_dtype(to_cache_dtype(x, FP8, scale), torch.float64, scale)
    assert ((back - x).abs() / x.abs()).max() <= 1 / 16
    unit = from_cache_dtype(to_cache_dtype(x, FP8, 1.0), torch.float64, 1.0)
    assert ((unit - x).abs() / x.abs()).max() > 0.25


def test_checkpoint_scale_names() -> None:
    """The names vLLM maps onto an attention layer's k_scale / v_scale."""
    p = "model.layers.3.self_attn."
    assert kv_scale_target(p + "k_scale") == (3, "k")
    assert kv_scale_target(p + "v_scale") == (3, "v")
    assert kv_scale_target(p + "attn.k_scale") == (3, "k")
    assert kv_scale_target(p + "k_proj.k_scale") == (3, "k")  # ModelOpt
    assert kv_scale_target(p + "v_proj.v_scale") == (3, "v")
    assert kv_scale_target(p + "k_proj.output_scale") == (3, "k")  # compressed-tensors
    assert kv_scale_target(p + "v_proj.output_scale") == (3, "v")
    assert kv_scale_target(p + "kv_scale") == (3, "kv")  # the older single scale
    for other in ("q_proj.output_scale", "k_proj.input_scale", "k_proj.weight_scale", "o_proj"):
        assert kv_scale_target(p + other) is None


def _with_scales(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(folder / "kv_scales.safetensors"))
    return folder


def test_checkpoint_scales_round_trip(tmp_path: Path) -> None:
    """A tiny Llama saved with k_scale / v_scale tensors (two of the naming schemes): the layers
    get them, the runner records them as the checkpoint's, and the FP8 cache written and read
    with them gives logits near the float32 cache's."""
    folder = build_tiny_llama(tmp_path / "llama")
    scales = {0: (0.011, 0.007), 1: (0.013, 0.005)}
    _with_scales(
        folder,
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(scales[0][0]),
            "model.layers.0.self_attn.v_scale": torch.tensor(scales[0][1]),
            "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([scales[1][0]]),
            "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([scales[1][1]]),
        },
    )
    config = Config(
        model=str(folder),
        cache_config={"kv_cache_dtype": "fp8", "num_kv_blocks": 64},
        enforce_eager=True,
    )
    runner = ModelRunner(config, torch.device("cpu"))
    sizing = determine_num_blocks(runner)
    assert sizing.kv_scales.source == "checkpoint"
    expected = tuple((i, pytest.approx(k), pytest.approx(v)) for i, (k, v) in scales.items())
    assert sizing.kv_scales.layers == expected
    layers = collect_attention_layers(runner.model)
    for i, (k, v) in scales.items():  # as the CUDA kernels read them
        want = torch.tensor([k, v], dtype=torch.float32)
        assert torch.equal(layers[i].kv_scales.cpu(), want)
    full, tokens = _run(runner.model, torch.float32)
    fp8, _ = _run(runner.model, FP8, forced=tokens)
    assert 0 < _worst(full, fp8) < 0.3


def test_checkpoint_scales_refused_by_name(tmp_path: Path) -> None:
    folder = build_tiny_llama(tmp_path / "llama")
    _with_scales(folder, {"model.layers.0.self_attn.k_scale": torch.ones(2)})
    with pytest.raises(ValueError, match="k_scale: a KV cache scale of shape"):
        load_model(Config(model=str(folder)), "cpu", torch.float32)
    (folder / "kv_scales.safetensors").unlink()
    _with_scales(folder, {"model.layers.0.self_attn.k_scale": torch.tensor(0.5)})
    with pytest.raises(ValueError, match="layer 0 has a KV cache scale for keys only"):
        load_model(Config(model=str(folder)), "cpu", torch.float32)


def test_calibrated_scales_on_the_embedded_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """No scales in SmolLM2's checkpoint: the runner calibrates one per layer and tensor and
    records them in the sizing result; with them, the FP8 cache's greedy chat answer names Paris
    and the logits stay within SMOL_TOLERANCE of the float32 cache's."""
    config = Config(cache_config={"kv_cache_dtype": "fp8", "num_kv_blocks": 64}, enforce_eager=True)
    runner = ModelRunner(config, torch.device("cpu"))
    sizing = determine_num_blocks(runner)
    scales = sizing.kv_scales
    assert scales.source == "calibrated"
    assert [i for i, _, _ in scales.layers] == sorted(runner.attn_layers)
    assert all(0 < k < 1 and 0 < v < 1 for _, k, v in scales.layers)
    assert config.cache_config.kv_cache_dtype == "fp8"  # the config is not where they live
    layers = collect_attention_layers(runner.model)
    assert all(x.kv_scale_source == "calibrated" for x in layers.values())
    # the calibration is deterministic: settling again gives the same scales
    again = settle_kv_scales(runner, lambda n: dummy_forward(runner, n))
    assert again.layers == scales.layers
    tokenizer = load_tokenizer_for(config)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [
        tokenizer.apply_chat_template(question, add_generation_prompt=True),
        tokenizer.encode("def fibonacci(n):\n    if n <"),
        tokenizer.encode("Once upon a time, in a small village,"),
    ]
    monkeypatch.setattr(fp8_kv_cache, "PROMPTS", prompts)
    full, tokens = _run(runner.model, torch.float32, steps=8)
    fp8, fp8_tokens = _run(runner.model, FP8, steps=8)
    assert "Paris" in tokenizer.decode([step[0] for step in fp8_tokens])
    forced, _ = _run(runner.model, FP8, steps=8, forced=tokens)
    worst = _worst(full, forced)
    assert 0 < worst < SMOL_TOLERANCE, worst


def test_embedded_model_with_an_fp8_cache_names_paris() -> None:
    """The chat answer (greedy) with kv_cache_dtype="fp8" names Paris, as the float cache's does."""
    with LLM(kv_cache_dtype="fp8") as llm:
        out = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(temperature=0, max_tokens=24),
        )
    assert "Paris" in out[0].outputs[0].text


def test_kv_cache_scheme_checked() -> None:
    """A quantization_config's kv_cache_scheme: static 8-bit float scales per tensor load (as
    k_proj / v_proj output_scale tensors); any other scheme is refused by name."""
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    good = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    assert Fp8Config.from_hf({**qc, "kv_cache_scheme": good}, "m") == Fp8Config.from_hf(qc, "m")
    for key, bad in (("num_bits", 4), ("type", "int"), ("strategy", "channel"), ("dynamic", True)):
        with pytest.raises(ValueError, match=f"kv_cache_scheme.{key} {bad!r} is not supported"):
            Fp8Config.from_hf({**qc, "kv_cache_scheme": {**good, key: bad}}, "m")


@pytest.mark.gpu
def test_checkpoint_and_calibrated_scales_on_the_gpu(tmp_path: Path) -> None:
    """The CUDA kernels write and read the cache with each layer's scales: a checkpoint's load
    and give logits near the float32 cache's; without them start-up calibrates on the GPU."""
    folder = build_tiny_llama(tmp_path / "llama")
    scales = {0: (0.011, 0.007), 1: (0.013, 0.005)}
    _with_scales(
        folder,
        {
            f"model.layers.{i}.self_attn.{name}": torch.tensor(value)
            for i, pair in scales.items()
            for name, value in zip(("k_scale", "v_scale"), pair)
        },
    )
    config = Config(
        model=str(folder),
        model_config={"dtype": "float32"},  # the float32 cache it is compared with
        cache_config={"kv_cache_dtype": "fp8", "num_kv_blocks": 64},
        enforce_eager=True,
    )
    runner = ModelRunner(config, torch.device("cuda", torch.cuda.current_device()))
    sizing = determine_num_blocks(runner)
    assert sizing.kv_scales.source == "checkpoint"
    layers = collect_attention_layers(runner.model)
    assert all(layers[i].kv_scales.is_cuda for i in scales)
    full, tokens = _run(runner.model, torch.float32)
    fp8, _ = _run(runner.model, FP8, forced=tokens)
    assert 0 < _worst(full, fp8) < 0.3
    (folder / "kv_scales.safetensors").unlink()
    runner = ModelRunner(config, torch.device("cuda", torch.cuda.current_device()))
    calibrated = determine_num_blocks(runner).kv_scales
    assert calibrated.source == "calibrated"
    assert all(0 < k < 1 and 0 < v < 1 for _, k, v in calibrated.layers)
    full, tokens = _run(runner.model, torch.float32)
    fp8, _ = _run(runner.model, FP8, forced=tokens)
    assert 0 < _worst(full, fp8) < 0.3

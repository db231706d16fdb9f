"""MLA without a query LoRA (DeepSeek-V2 / V2-Lite): this rank's query heads of `q_proj` and the
whole `kv_a_proj_with_mqa` are one GEMM, the layer's `in_proj` (`q_kv_a_proj`), into which the
decoder layer's residual add and norm fuse.

The fused layer against its unfused computation (the two projections applied apart, same weights)
at TP 1 and per rank at TP 2; checkpoints with the separate names load at TP 1 (a bias on the
latent projection alone, online FP8 and a block-scaled FP8 checkpoint whose query rows end
mid-block) and at TP 2 over gloo, each against transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from deepseek_harness import make_hf_deepseek, tiny_deepseek_configs
from model_harness import gloo_tp_run, load_hf, max_logit_diff, run_prefill_and_decode
from safetensors.torch import load_file

from atomrt.distributed.communication_op import TPInfo
from atomrt.runtime.config import Config
from atomrt.runtime.forward_context import Context, set_forward_context
from atomrt.workers.layers.mla import MLAAttention
from atomrt.workers.layers.norm import RMSNorm, rms_norm
from atomrt.workers.layers.quantization.fp8 import FP8_DTYPE, quantize_weight_per_row
from atomrt.workers.layers.rotary import RotaryEmbedding
from atomrt.workers.loading.loader import load_model

transformers = pytest.importorskip("transformers")

H, NOPE, ROPE, V, L, HIDDEN = 4, 16, 8, 12, 32, 48
QK = NOPE + ROPE
SCALE = QK**-0.5
ROWS = 9
PROMPTS = [[3, 17, 42, 99, 5, 8, 61], [7, 1, 120], [11, 12, 13, 14, 15, 16, 17, 18]]
TOLERANCE = 1e-4  # against transformers in float32 (as tests/test_models_deepseek.py)
TOLERANCE_FP8 = 1e-5  # float64 against the float64 reference of the FP8 checkpoint


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """One layer's weights as a checkpoint names them (q_proj, kv_a_proj_with_mqa apart)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.3

    return {
        "q_proj": rand(H * QK, HIDDEN),
        "kv_a_proj_with_mqa": rand(L + ROPE, HIDDEN),
        "kv_b_proj": rand(H * (NOPE + V), L),
        "o_proj": rand(HIDDEN, H * V),
        "kv_a_layernorm": 1.0 + rand(L),
    }


def _layer(w: dict[str, torch.Tensor], tp: TPInfo = TPInfo()) -> MLAAttention:
    """The layer of rank `tp`, loaded through its parameters' loaders as the model loader does."""
    rotary = RotaryEmbedding(ROPE, 256, 10000.0, None, True)
    layer = MLAAttention(0, HIDDEN, H, None, L, NOPE, ROPE, V, SCALE, rotary, tp)
    fused = layer.in_proj.weight
    fused.weight_loader(fused, w["q_proj"], 0)
    fused.weight_loader(fused, w["kv_a_proj_with_mqa"], 1)
    for name in ("kv_b_proj", "o_proj"):
        param = getattr(layer, name).weight
        param.weight_loader(param, w[name])
    with torch.no_grad():
        layer.kv_a_layernorm.weight.copy_(w["kv_a_layernorm"])
    layer.process_weights_after_loading()
    return layer


def _q_rows(w: dict[str, torch.Tensor], tp: TPInfo) -> torch.Tensor:
    """q_proj's rows of rank `tp`: its heads."""
    per_rank = H * QK // tp.tp_size
    return w["q_proj"][tp.tp_rank * per_rank : (tp.tp_rank + 1) * per_rank]


def _unfused(layer: MLAAttention, w: dict, x: torch.Tensor, positions: torch.Tensor):
    """The layer's computation with q_proj and kv_a_proj_with_mqa as two GEMMs."""
    q = F.linear(x, _q_rows(w, layer.o_proj.tp)).view(-1, layer.num_heads, QK)
    kv_c, k_pe = F.linear(x, w["kv_a_proj_with_mqa"]).split([L, ROPE], dim=-1)
    output = q.new_empty(q.shape[0], layer.num_heads, V)
    torch.ops.atomrt.mla_attention(q, layer.kv_a_layernorm(kv_c), k_pe, output, positions, 0)
    return layer.o_proj(output.view(-1, layer.num_heads * V))


def _outputs(layer: MLAAttention, w: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused, unfused) outputs of the layer over one sequence of x's rows (no cache: causal
    attention within the rows)."""
    positions = torch.arange(x.shape[0])
    ctx = Context(positions=positions, batch_size=1, running_tokens=x.shape[0])
    config = Config(enforce_eager=True)
    with (
        torch.inference_mode(),
        set_forward_context(None, config, ctx, no_compile_layers={0: layer}),
    ):
        return layer(positions, layer.in_proj(x)), _unfused(layer, w, x, positions)


def test_one_input_gemm_equals_the_two_projections_at_tp1() -> None:
    w = _checkpoint()
    layer = _layer(w)
    assert not hasattr(layer, "q_proj") and not hasattr(layer, "kv_a_proj_with_mqa")
    fused = layer.in_proj.weight
    assert torch.equal(fused, torch.cat((w["q_proj"], w["kv_a_proj_with_mqa"])))
    x = torch.randn(ROWS, HIDDEN)
    got, expected = _outputs(layer, w, x)
    assert got.shape == (ROWS, HIDDEN)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_residual_add_and_norm_fuse_into_the_input_gemm() -> None:
    """The decoder layer's `add_project` door: (h, in_proj(norm(h))) is [q | kv_a] of norm(h)."""
    w = _checkpoint(1)
    layer = _layer(w)
    norm = RMSNorm(HIDDEN, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(HIDDEN))
    residual, update = torch.randn(ROWS, HIDDEN), torch.randn(ROWS, HIDDEN)
    with torch.inference_mode():
        h, a = norm.add_project(residual, update, layer.in_proj)
    normed = rms_norm(residual + update, norm.weight, norm.eps)
    expected = torch.cat(
        (F.linear(normed, w["q_proj"]), F.linear(normed, w["kv_a_proj_with_mqa"])), dim=-1
    )
    torch.testing.assert_close(h, residual + update, rtol=0, atol=0)
    torch.testing.assert_close(a, expected, rtol=1e-5, atol=1e-5)


def test_at_tp2_each_rank_holds_its_heads_and_the_whole_latent_projection() -> None:
    """Rank r's in_proj is [q_proj's rows of heads 2r, 2r + 1 ; every kv_a_proj_with_mqa row]; its
    output (before o_proj's all-reduce) is the unfused computation's, and the ranks' partial sums
    add up to the TP 1 layer's output."""
    w = _checkpoint(2)
    x = torch.randn(ROWS, HIDDEN)
    whole, _ = _outputs(_layer(w), w, x)
    total = torch.zeros_like(whole)
    for rank in range(2):
        tp = TPInfo(rank, 2)
        layer = _layer(w, tp)
        assert layer.num_heads == H // 2
        expected_weight = torch.cat((_q_rows(w, tp), w["kv_a_proj_with_mqa"]))
        assert torch.equal(layer.in_proj.weight, expected_weight)
        layer.o_proj.reduce_output = False  # this rank's partial sum (no process group here)
        got, expected = _outputs(layer, w, x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        total += got
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def _v2_folder(folder: Path, hidden: int = 64, bias: bool = False) -> Path:
    """tiny DeepSeek-V2 without a query LoRA (deepseek_harness's v2_greedy), saved by
    transformers; with `bias`, kv_a_proj_with_mqa's bias random (q_proj has none)."""
    cfg = tiny_deepseek_configs()["v2_greedy"]
    cfg.hidden_size, cfg.attention_bias = hidden, bias
    model = make_hf_deepseek(cfg, seed=3)
    if bias:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.kv_a_proj_with_mqa.bias.normal_(0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "kv_a_bias"])
def test_a_checkpoint_with_the_separate_names_matches_transformers(
    tmp_path: Path, bias: bool
) -> None:
    folder = _v2_folder(tmp_path, bias=bias)
    assert "model.layers.0.self_attn.q_proj.weight" in load_file(folder / "model.safetensors")
    loaded = load_model(Config(model=str(folder)), "cpu", torch.float32)
    fused = loaded.model.model.layers[0].self_attn.in_proj
    if bias:  # q_proj's rows of the bias are zero, kv_a_proj_with_mqa's are the checkpoint's
        assert torch.equal(fused.bias[: H * QK], torch.zeros(H * QK))
    result = run_prefill_and_decode(loaded.model, PROMPTS, 3, block_size=4, num_pad_rows=2)
    worst = max_logit_diff(result, load_hf(folder), PROMPTS)
    assert worst <= TOLERANCE, f"max |logits - transformers| = {worst:.3g}"


def test_online_fp8_keeps_each_projections_row_scales(tmp_path: Path) -> None:
    """quantization="fp8": one scale per output row, so the fused weight and scales are the two
    projections' own, stacked."""
    folder = _v2_folder(tmp_path)
    state = load_file(folder / "model.safetensors")
    config = Config(model=str(folder), model_config={"quantization": "fp8"})
    fused = load_model(config, "cpu", torch.float32).model.model.layers[0].self_attn.in_proj
    parts = [
        state[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "kv_a_proj_with_mqa")
    ]
    quantized = [quantize_weight_per_row(p) for p in parts]
    assert fused.weight.dtype == FP8_DTYPE
    expected = torch.cat([q for q, _ in quantized])
    assert torch.equal(fused.weight.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(fused.weight_scale, torch.cat([s for _, s in quantized]))


def test_block_fp8_checkpoint_with_query_rows_ending_mid_block(tmp_path: Path) -> None:
    """weight_scale_inv per 128x128 block: q_proj's 96 rows end inside a block, and the scales
    are expanded to rows at load, so kv_a_proj_with_mqa's rows keep their own blocks' scales."""
    from fp8_harness import quantize_folder, reference_logits, reference_model

    _v2_folder(tmp_path / "src", hidden=256)
    quantize_folder(tmp_path / "src", tmp_path / "fp8", "block", tmp_path / "deq")
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    loaded = load_model(Config(model=str(tmp_path / "fp8")), "cpu", torch.float64)
    fused = loaded.model.model.layers[0].self_attn.in_proj
    assert fused.weight.dtype == FP8_DTYPE and H * QK % 128
    reference = reference_model(tmp_path / "deq", "block")
    result = run_prefill_and_decode(loaded.model, PROMPTS, 3)
    for s, prompt in enumerate(PROMPTS):
        ref = reference_logits(reference, result.sequences[s][:-1])[len(prompt) - 1 :]
        got = torch.stack([step[s] for step in result.logits]).double()
        assert (got - ref).abs().max().item() < TOLERANCE_FP8


def test_tp2_on_gloo_loads_the_separate_names_and_matches_transformers(tmp_path: Path) -> None:
    folder = _v2_folder(tmp_path / "model")
    result = gloo_tp_run(folder, PROMPTS, tmp_path)
    worst = max_logit_diff(result, load_hf(folder), PROMPTS)
    assert worst <= TOLERANCE, f"TP=2: max |logits - transformers| = {worst:.3g}"

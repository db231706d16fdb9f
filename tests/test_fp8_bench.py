"""`atomrt bench latency --quantization fp8 --kv-cache-dtype fp8`: the floor counts the bytes a
decode step reads as they are stored -- e4m3 weights with a float32 scale per output row (online
quantization), the float parts (norms, router, embeddings, LM head, MLA's kv_b_proj) at 4 bytes,
and an e4m3 latent cache -- counted by hand from the tiny DeepSeek-V3 preset's config."""

import json
from pathlib import Path

from atomrt.runtime.bench.latency import main
from atomrt.runtime.bench.step_bytes import StepBytes
from atomrt.workers.layers.expert_tally import RoutedLayer
from atomrt.workers.loading.presets import PRESETS

F32, FP8 = 4, 1
LAYERS = 3  # --hf-overrides: layer 0 dense, layers 1 and 2 MoE


def _fp8(n: int, k: int) -> int:
    """An FP8 projection [n, k]: e4m3 weights and one float32 scale per output row."""
    return n * k * FP8 + n * F32


def hand_count() -> StepBytes:
    c = PRESETS["tiny-deepseek-v3"]
    h, heads, vocab = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    q_lora, kv_lora = c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    experts, moe_i, inter = (
        c["n_routed_experts"],
        c["moe_intermediate_size"],
        c["intermediate_size"],
    )
    attention = (
        _fp8(q_lora + kv_lora + rope, h)  # fused_qkv_a_proj
        + _fp8(heads * (nope + rope), q_lora)  # q_b_proj
        + kv_lora * heads * (nope + v) * F32  # kv_b_proj stays float (MLA absorbs it)
        + _fp8(h, heads * v)  # o_proj
        + (q_lora + kv_lora + 2 * h) * F32  # q_a / kv_a layernorms, the layer's two norms
    )
    dense_mlp = _fp8(2 * inter, h) + _fp8(h, inter)
    shared = _fp8(2 * c["n_shared_experts"] * moe_i, h) + _fp8(h, c["n_shared_experts"] * moe_i)
    router = (experts * h + experts) * F32
    moe_layers = LAYERS - c["first_k_dense_replace"]
    weights = (
        LAYERS * attention
        + dense_mlp
        + moe_layers * (shared + router)
        + (vocab * h + h) * F32  # the LM head, the final norm
    )
    expert = _fp8(2 * moe_i, h) + _fp8(h, moe_i)
    latent = LAYERS * (kv_lora + rope) * FP8
    return StepBytes(
        weights=weights,
        row=h * F32,
        kv_per_token=latent,
        routed=(RoutedLayer(experts, expert),) * moe_layers,
        kv_by_kind={"mla": latent},
    )


def test_the_floor_counts_fp8_weights_and_cache_as_stored(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    argv = ["--model", "tiny-deepseek-v3", "--device", "cpu", "--modes", "eager"]
    argv += ["--batch-sizes", "2", "--decode-steps", "2", "--warmup-steps", "1"]
    argv += ["--input-len", "8", "--hf-overrides", json.dumps({"num_hidden_layers": LAYERS})]
    argv += ["--quantization", "fp8", "--kv-cache-dtype", "fp8", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == []
    assert report["args"]["quantization"] == "fp8" and report["args"]["kv_cache_dtype"] == "fp8"
    got = report["step_bytes"]["tiny-deepseek-v3"]
    step = StepBytes(
        got["weights"],
        got["row"],
        got["kv_per_token"],
        tuple(RoutedLayer(*layer) for layer in got["routed"]),
        got["kv_by_kind"],
    )
    assert step == hand_count()
    (row,) = report["rows"]
    assert row["floor_ms"] is not None and row["floor_ms"] < row["floor_all_experts_ms"]


def test_engine_flags_take_quantization_and_kv_cache_dtype() -> None:
    """`atomrt generate` / `serve` flags: --quantization and --kv-cache-dtype reach the config, a
    value atomrt does not take is refused naming the knob."""
    import argparse

    import pytest

    from atomrt.runtime.config import ConfigError
    from atomrt.runtime.entrypoints.config_args import add_config_args, config_from_args

    p = argparse.ArgumentParser()
    add_config_args(p)
    config = config_from_args(p.parse_args(["--quantization", "fp8", "--kv-cache-dtype", "fp8"]))
    assert config.model_config.quantization == "fp8"
    assert config.cache_config.kv_cache_dtype == "fp8"
    plain = config_from_args(p.parse_args([]))
    assert (plain.model_config.quantization, plain.cache_config.kv_cache_dtype) == (None, "auto")
    with pytest.raises(ConfigError, match="model_config.quantization.*'gptq'"):
        config_from_args(p.parse_args(["--quantization", "gptq"]))
    with pytest.raises(ConfigError, match="cache_config.kv_cache_dtype.*'int8'"):
        config_from_args(p.parse_args(["--kv-cache-dtype", "int8"]))


def test_fp8_runs_get_rows_of_their_own() -> None:
    """The case of a run with --quantization or --kv-cache-dtype names them: its row on the page
    stands beside the bf16 run's instead of replacing it."""
    from atomrt.runtime.bench.latency import _parse
    from atomrt.runtime.bench.targets import engine_variant

    base = ["--model", "Llama-3.1-8B", "--modes", "FULL+async", "--level", "3"]
    plain = engine_variant(_parse(base))  # the environment's variables (OMP_*) at most
    fp8 = engine_variant(_parse([*base, "--quantization", "fp8", "--kv-cache-dtype", "fp8"]))
    assert fp8 == ["--quantization fp8", "--kv-cache-dtype fp8", *plain]
    assert not any("fp8" in part for part in plain)

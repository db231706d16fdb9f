"""The floor of `atomrt bench latency` on a MoE model with latent attention: the bytes a decode
step reads, counted by hand from the tiny DeepSeek-V3 preset's config, with the routed experts the
batch touched (counted in the run) in place of all of them."""

import json
from pathlib import Path

import pytest
from records_harness import check_records

from atomrt.runtime.bench.latency import main
from atomrt.runtime.bench.step_bytes import StepBytes
from atomrt.workers.layers.expert_tally import RoutedLayer
from atomrt.workers.loading.presets import PRESETS

F32 = 4
LAYERS = 3  # --hf-overrides: layer 0 dense, layers 1 and 2 MoE


def hand_count() -> StepBytes:
    """The tiny V3 preset's bytes per decode step, float32, from its config.json fields."""
    c = PRESETS["tiny-deepseek-v3"]
    h, heads, vocab = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    q_lora, kv_lora = c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    experts, moe_i = c["n_routed_experts"], c["moe_intermediate_size"]
    attention = (
        h * (q_lora + kv_lora + rope)  # the query LoRA's and the latent's down projections
        + q_lora  # q_a_layernorm
        + q_lora * heads * (nope + rope)  # q_b_proj
        + kv_lora  # kv_a_layernorm
        + kv_lora * heads * (nope + v)  # kv_b_proj (a decode step reads its absorbed copies)
        + heads * v * h  # o_proj
        + 2 * h  # the layer's two norms
    )
    dense_mlp = 3 * h * c["intermediate_size"]
    shared = 3 * h * c["n_shared_experts"] * moe_i
    router = experts * h + experts  # float32 router and noaux_tc's correction bias
    moe_layers = LAYERS - c["first_k_dense_replace"]
    weights = (
        LAYERS * attention + dense_mlp + moe_layers * (shared + router) + vocab * h + h
    )  # the LM head whole, the final norm; the untied input embedding by its rows
    expert = 3 * h * moe_i * F32
    return StepBytes(
        weights=weights * F32,
        row=h * F32,
        kv_per_token=LAYERS * (kv_lora + rope) * F32,  # one latent row per token and layer
        routed=(RoutedLayer(experts, expert),) * moe_layers,
        kv_by_kind={"mla": LAYERS * (kv_lora + rope) * F32},
    )


def test_the_floor_counts_the_experts_the_batch_touches(tmp_path: Path) -> None:
    out, records = tmp_path / "latency.json", tmp_path / "records"
    argv = ["--model", "tiny-deepseek-v3", "--device", "cpu", "--modes", "eager"]
    argv += ["--batch-sizes", "1,4", "--decode-steps", "4", "--warmup-steps", "1"]
    argv += ["--input-len", "8", "--hf-overrides", json.dumps({"num_hidden_layers": LAYERS})]
    assert main(argv + ["--json", str(out), "--record", str(records)]) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == []
    want = hand_count()
    got = report["step_bytes"]["tiny-deepseek-v3"]
    assert (
        StepBytes(
            got["weights"],
            got["row"],
            got["kv_per_token"],
            tuple(RoutedLayer(*layer) for layer in got["routed"]),
            got["kv_by_kind"],
        )
        == want
    )
    top_k = PRESETS["tiny-deepseek-v3"]["num_experts_per_tok"]
    ctx = 8 + 1 + 4 // 2  # the prompt, warm-up and half the timed steps
    expert = want.routed[0].expert_bytes
    for r in report["rows"]:
        bs, touched = r["batch_size"], r["experts_touched"]
        if bs == 1:
            assert touched == top_k  # one row: its top-k, distinct by construction
        else:
            assert top_k <= touched <= min(bs * top_k, want.routed[0].num_experts)
        base = want.weights + bs * want.row + bs * ctx * want.kv_per_token
        floor = (base + touched * len(want.routed) * expert) / report["copy_gbps"] / 1e6
        every = (base + want.routed_bytes()) / report["copy_gbps"] / 1e6
        assert r["floor_ms"] == pytest.approx(floor, rel=1e-3, abs=1e-4)
        assert r["floor_all_experts_ms"] == pytest.approx(every, rel=1e-3, abs=1e-4)
        assert r["floor_ms"] < r["floor_all_experts_ms"]
    (record,) = check_records(records, "latency")
    case = '--hf-overrides {"num_hidden_layers":3}'
    for f, r in zip(record.figures, report["rows"]):
        assert case in f.case and f.anchor == r["floor_ms"]
        assert f.extra["experts touched"].value == r["experts_touched"]
        assert f.extra["all-experts floor"].value == r["floor_all_experts_ms"]

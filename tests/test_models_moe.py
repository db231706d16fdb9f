"""Our mixture-of-experts models against Hugging Face transformers on the same weights (CPU, float32):
Qwen3-MoE (q/k norm, top-k renormalized, a dense layer among sparse ones), Qwen2-MoE (qkv bias, a
shared expert, decoder_sparse_step 2) and Mixtral, made by transformers and saved as safetensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_harness import gloo_tp_run, load_hf, max_logit_diff, run_prefill_and_decode
from moe_harness import make_hf_model, tiny_moe_configs

from atomrt import SamplingParams
from atomrt.runtime.config import Config, ModelConfig
from atomrt.workers.loading.loader import load_model

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
PROMPTS = [[3, 17, 42, 99, 5, 8, 61], [7, 1, 120], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
NUM_DECODE_STEPS = 3


def build_moe_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folders = {}
    for name, cfg in tiny_moe_configs().items():
        folder = tmp_path_factory.mktemp(name)
        make_hf_model(cfg).save_pretrained(folder, safe_serialization=True)
        folders[name] = folder
    return folders


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_moe_folders(tmp_path_factory)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_tiny_moe_matches_transformers(moe_folders: dict[str, Path], name: str) -> None:
    folder = moe_folders[name]
    loaded = load_model(
        Config(model=str(folder), model_config=ModelConfig(dtype="float32")), "cpu", torch.float32
    )
    assert loaded.arch.is_moe
    result = run_prefill_and_decode(
        loaded.model, PROMPTS, NUM_DECODE_STEPS, block_size=4, num_pad_rows=2
    )
    worst = max_logit_diff(result, load_hf(folder), PROMPTS)
    assert worst <= TOLERANCE, f"{name}: max |logits - transformers| = {worst:.3g}"


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_engine_greedy_tokens_equal_transformers_generate(
    moe_folders: dict[str, Path], name: str
) -> None:
    from atomrt.runtime.entrypoints.llm import LLM

    folder = moe_folders[name]
    hf_model = load_hf(folder)
    expected = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None
            )
        expected.append(out[0, len(prompt) :].tolist())
    llm = LLM(str(folder), device="cpu", enforce_eager=True, num_kv_blocks=64, max_num_seqs=8)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.shutdown()
    assert got == expected


def test_fused_expert_checkpoint_layout_loads(tmp_path: Path) -> None:
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) saved as is loads to the same model as the per-expert tensors."""
    from safetensors.torch import save_file

    cfg = tiny_moe_configs()["qwen3_moe"]
    hf_model = make_hf_model(cfg)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    hf_model.config.architectures = [type(hf_model).__name__]
    hf_model.config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_model(Config(model=str(tmp_path)), "cpu", torch.float32)
    result = run_prefill_and_decode(loaded.model, PROMPTS, 1)
    assert max_logit_diff(result, hf_model, PROMPTS) <= TOLERANCE


def test_missing_expert_names_the_parameter(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    cfg = tiny_moe_configs()["mixtral"]
    make_hf_model(cfg).save_pretrained(tmp_path, safe_serialization=True)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.2.block_sparse_moe.experts.3.w3.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors .*layers\.2\.mlp\.experts\.w13_weight"):
        load_model(Config(model=str(tmp_path)), "cpu", torch.float32)


def test_dynamo_traces_moe_without_graph_breaks(moe_folders: dict[str, Path]) -> None:
    """The decoder traces in one graph with a dynamic token dimension; the experts are one op."""
    loaded = load_model(Config(model=str(moe_folders["qwen2_moe"])), "cpu", torch.float32)
    eager = run_prefill_and_decode(loaded.model, PROMPTS, 1)
    torch._dynamo.reset()
    loaded.model.model = torch.compile(
        loaded.model.model, backend="eager", fullgraph=True, dynamic=True
    )
    compiled = run_prefill_and_decode(loaded.model, PROMPTS, 1)
    for a, b in zip(eager.logits, compiled.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.slow  # the default run splits experts over TP ranks in tests/test_dp_moe.py
def test_expert_tensor_parallel_on_gloo_matches_transformers(
    moe_folders: dict[str, Path], tmp_path: Path
) -> None:
    """TP=2 splits every expert's intermediate dimension and the shared expert (Qwen2-MoE); one
    all-reduce per MoE block."""
    folder = moe_folders["qwen2_moe"]
    result = gloo_tp_run(folder, PROMPTS, tmp_path)
    worst = max_logit_diff(result, load_hf(folder), PROMPTS)
    assert worst <= TOLERANCE, f"TP=2: max |logits - transformers| = {worst:.3g}"

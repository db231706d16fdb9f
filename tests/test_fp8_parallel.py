"""FP8 weights and the FP8 KV cache over tensor and data parallel ranks (mp executor, CPU): each
rank loads its shard of the scales with its shard of the weights, so the greedy tokens are one
rank's."""

from __future__ import annotations

from pathlib import Path

import pytest
from executor_harness import build_tiny_llama, greedy_tokens
from fp8_harness import quantize_folder


@pytest.fixture(scope="module")
def llama_256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("llama") / "model", hidden_size=256)


@pytest.mark.slow
def test_tp2_fp8_checkpoint_and_cache_give_tp1_tokens(llama_256: Path, tmp_path: Path) -> None:
    """Per-tensor weights with static input scales (the same quantization on every split), and the
    FP8 KV cache."""
    quantize_folder(llama_256, tmp_path / "fp8", "tensor_static", tmp_path / "deq")
    one, _ = greedy_tokens(tmp_path / "fp8", kv_cache_dtype="fp8")
    two, _ = greedy_tokens(
        tmp_path / "fp8", kv_cache_dtype="fp8", executor="mp", tensor_parallel_size=2
    )
    assert two == one


def test_tp2_block_fp8_refuses_a_shard_off_the_block(llama_256: Path, tmp_path: Path) -> None:
    """The MLP's 96 features split into 48 per rank: not whole 128-feature groups."""
    from atomrt.distributed.communication_op import TPInfo
    from atomrt.runtime.config import Config
    from atomrt.workers.loading.loader import load_model

    quantize_folder(llama_256, tmp_path / "fp8", "block", tmp_path / "deq")
    with pytest.raises(ValueError, match=r"down_proj: the input features of each .* \(48\)"):
        load_model(Config(model=str(tmp_path / "fp8")), "cpu", "float32", TPInfo(0, 2))


@pytest.mark.slow
def test_dp2_online_fp8_moe_gives_dp1_tokens(tmp_path: Path) -> None:
    """DeepSeek-V3 quantized at load, its experts split over two DP ranks, the FP8 latent cache."""
    from deepseek_harness import build_deepseek_folder
    from executor_harness import save_word_tokenizer

    folder = save_word_tokenizer(build_deepseek_folder(tmp_path / "v3", "v3"))
    prompts = [[3, 17, 42, 9, 77, 5], [11, 64, 2, 90, 31]]
    settings = dict(quantization="fp8", kv_cache_dtype="fp8")
    one, _ = greedy_tokens(folder, prompts, **settings)
    two, _ = greedy_tokens(folder, prompts, executor="mp", data_parallel_size=2, **settings)
    assert two == one

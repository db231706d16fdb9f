"""Loader and tokenizer: user-facing errors, dummy weights at preset shapes, the embedded tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from executor_harness import build_tiny_llama
from model_harness import run_prefill_and_decode

from atomrt.distributed.communication_op import TPInfo
from atomrt.runtime.config import DEFAULT_MODEL, Config, ModelConfig
from atomrt.workers.loading.loader import build_model, embedded_gguf_path, load_model, resolve_model
from atomrt.workers.loading.presets import preset_config
from atomrt.workers.models.registry import arch_from_hf_config


def _load(model: str, load_format: str = "auto") -> None:
    load_model(
        Config(model=model, model_config=ModelConfig(load_format=load_format)), "cpu", torch.float32
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return embedded_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))


def _copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_tiny_folder_loads(tiny_folder: Path) -> None:
    _load(str(tiny_folder))


def test_unknown_model_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="no-such-model"):
        _load(str(missing))
    with pytest.raises(ValueError, match="not-a-model-name"):
        resolve_model("not-a-model-name")


def test_missing_config_json(tiny_folder: Path, tmp_path: Path) -> None:
    folder = _copy_folder(tiny_folder, tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json") as e:
        _load(str(folder))
    assert str(folder) in str(e.value)


def test_unsupported_architecture(tiny_folder: Path, tmp_path: Path) -> None:
    folder = _copy_folder(tiny_folder, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        _load(str(folder))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tiny_folder: Path, tmp_path: Path, damage: str) -> None:
    folder = _copy_folder(tiny_folder, tmp_path / "m")
    (file,) = folder.glob("*.safetensors")
    data = file.read_bytes()
    file.write_bytes(b"\x93garbage" * 100 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match="safetensors") as e:
        _load(str(folder))
    assert str(file) in str(e.value)


@pytest.mark.parametrize("keep_fraction", [0.0, 0.01, 0.6])
def test_corrupt_gguf(gguf_path: Path, tmp_path: Path, keep_fraction: float) -> None:
    bad = tmp_path / "bad.gguf"
    if keep_fraction == 0.0:
        bad.write_bytes(b"not a gguf file at all" * 50)
    else:
        with gguf_path.open("rb") as f:
            bad.write_bytes(f.read(int(gguf_path.stat().st_size * keep_fraction)))
    with pytest.raises(ValueError, match="GGUF") as e:
        _load(str(bad))
    assert str(bad) in str(e.value)


def test_preset_needs_dummy() -> None:
    with pytest.raises(ValueError, match="dummy"):
        _load("Llama-3.2-1B")


def test_dummy_smollm2_shapes_and_finite_logits() -> None:
    config = Config(model="SmolLM2-135M", model_config=ModelConfig(load_format="dummy", seed=3))
    loaded = load_model(config, "cpu", torch.float32)
    assert sum(p.numel() for p in loaded.model.parameters()) == 134_515_008  # the published 134.5M
    result = run_prefill_and_decode(loaded.model, [[1, 2, 3, 4, 5], [9, 8]], num_decode_steps=1)
    assert all(torch.isfinite(step).all() for step in result.logits)
    again = load_model(config, "cpu", torch.float32)
    assert torch.equal(
        again.model.model.layers[0].mlp.down_proj.weight,
        loaded.model.model.layers[0].mlp.down_proj.weight,
    )


@pytest.mark.parametrize(
    "preset, num_params", [("Llama-3.2-1B", 1_235_814_400), ("Llama-3.1-8B", 8_030_261_248)]
)
def test_preset_parameter_counts(preset: str, num_params: int) -> None:
    arch = arch_from_hf_config(preset_config(preset), preset)
    model = build_model(arch, "meta", torch.bfloat16, max_position=16)
    assert sum(p.numel() for p in model.parameters()) == num_params
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "llama3"


def test_tp_shards_cover_the_model() -> None:
    """With tp_size > num_kv_heads each rank holds one kv head; shards add up to the whole."""
    arch = arch_from_hf_config(preset_config("SmolLM2-135M"), "preset")  # 9 heads, 3 kv heads
    ranks = [
        build_model(arch, "meta", torch.float32, TPInfo(r, 3), max_position=16) for r in range(3)
    ]
    qkv = [m.model.layers[0].self_attn.qkv_proj for m in ranks]
    assert [q.num_kv_heads for q in qkv] == [1, 1, 1] and [q.kv_head_start for q in qkv] == [
        0,
        1,
        2,
    ]
    with pytest.raises(ValueError, match="num_attention_heads"):
        build_model(arch, "meta", torch.float32, TPInfo(0, 2), max_position=16)


def test_tokenizer_decode_is_transformers_decode(
    gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's decode (the Rust tokenizer's, called directly where that is all transformers
    does) gives transformers' text for random windows of ids, special tokens and byte pieces
    included; a tokenizer that cleans up spaces keeps transformers' decode."""
    import random

    from atomrt.workers.loading.tokenizer import Tokenizer, load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    assert tokenizer.rust is not None, "the embedded tokenizer takes the direct path"
    rng = random.Random(0)
    specials = [0, 1, 2]  # <|endoftext|>, <|im_start|>, <|im_end|>
    for _ in range(300):
        ids = [
            rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tokenizer.vocab_size)
            for _ in range(rng.randrange(0, 12))
        ]
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == tokenizer.hf.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)
    # the loaded tokenizer is shared by the engines of this process: change it for this test only
    monkeypatch.setattr(tokenizer.hf, "clean_up_tokenization_spaces", True)
    assert Tokenizer(tokenizer.hf, (2,)).rust is None


def test_embedded_tokenizer_round_trip_and_chat_template(
    gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from atomrt.workers.loading.tokenizer import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    text = "The capital of France is Paris. ¿Qué tal? 1234"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token_ids == (2,)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids == tokenizer.encode(prompt, add_special_tokens=False) and ids[0] == 1  # <|im_start|>


def test_a_gguf_file_is_parsed_once_while_it_is_unchanged(tmp_path: Path) -> None:
    """The architecture check, the weights and the tokenizer share one parse of a GGUF file; a
    file that changed (size or mtime) is parsed again."""
    import gguf

    from atomrt.workers.loading.gguf import open_gguf

    def write(path: Path, value: int) -> None:
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_uint32("test.value", value)
        w.add_tensor("t", np.arange(4, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    path = tmp_path / "tiny.gguf"
    write(path, 1)
    first = open_gguf(path)
    assert open_gguf(path) is first
    write(path, 2)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    second = open_gguf(path)
    assert second is not first and second.fields["test.value"].contents() == 2


def test_a_gguf_tokenizer_saved_for_other_processes_is_the_same_tokenizer(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer built from the GGUF file is saved under the cache root; another process loads
    that copy, which must encode, decode and apply the chat template as the GGUF-built one does
    (transformers' own conversion is the reference); a damaged copy is rebuilt."""
    import dataclasses
    import random

    from atomrt.runtime import envs
    from atomrt.workers.loading import tokenizer as tok

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, cache_root=tmp_path))
    monkeypatch.setattr(tok, "_GGUF_TOKENIZERS", {})
    built = tok.load_tokenizer(resolve_model(DEFAULT_MODEL))
    [saved] = (tmp_path / "tokenizers").iterdir()
    assert (saved / "tokenizer.json").is_file()
    monkeypatch.setattr(tok, "_GGUF_TOKENIZERS", {})  # a new process: the saved copy
    loaded = tok.load_tokenizer(resolve_model(DEFAULT_MODEL))
    assert loaded.hf is not built.hf and type(loaded.hf) is type(built.hf)
    assert (loaded.vocab_size, loaded.eos_token_ids, loaded.bos_token_id) == (
        built.vocab_size,
        built.eos_token_ids,
        built.bos_token_id,
    )
    assert (loaded.rust is None) == (built.rust is None)
    texts = [
        "Hello, world!",
        "  leading and trailing spaces  ",
        "naïve café — 東京 🚀 ñ",
        "<|im_start|>user\nhi<|im_end|>",
        "def f(x):\n\treturn x ** 2\n",
        "",
    ]
    for text in texts:
        for special in (True, False):
            assert loaded.encode(text, special) == built.encode(text, special), text
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(built.vocab_size) for _ in range(rng.randrange(0, 12))]
        for skip in (True, False):
            assert loaded.decode(ids, skip) == built.decode(ids, skip)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert loaded.hf.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == built.hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    (saved / "tokenizer.json").write_text("{not json")  # damaged: rebuilt from the GGUF file
    monkeypatch.setattr(tok, "_GGUF_TOKENIZERS", {})
    again = tok.load_tokenizer(resolve_model(DEFAULT_MODEL))
    assert again.encode("Hello, world!") == built.encode("Hello, world!")
    assert tok._load_saved(saved) is not None


# ------------------------------------------------------------------ hf_overrides


def test_hf_overrides_build_fewer_layers_at_the_real_shapes() -> None:
    """vLLM's `hf_overrides`: the preset's fields replaced before the model is built. Fewer layers
    keep each layer's shapes (and which MLPs are dense); the config's hash changes with them."""
    from atomrt.runtime.entrypoints.llm import config_from_kwargs
    from atomrt.workers.loading.loader import read_arch

    kwargs = dict(load_format="dummy", device="cpu")
    whole = config_from_kwargs("tiny-deepseek-v3", kwargs)
    cut = config_from_kwargs(
        "tiny-deepseek-v3", {**kwargs, "hf_overrides": {"num_hidden_layers": 2}}
    )
    assert (read_arch(whole).num_layers, read_arch(cut).num_layers) == (4, 2)
    assert read_arch(cut).mlp_only_layers == (0,)  # first_k_dense_replace=1: layer 0 stays dense
    model = load_model(cut, "cpu", torch.float32).model
    reference = load_model(whole, "cpu", torch.float32).model
    assert len(model.model.layers) == 2
    shapes = {n: p.shape for n, p in reference.named_parameters()}
    for name, p in model.named_parameters():
        assert p.shape == shapes[name], name
    assert whole.compute_hash() != cut.compute_hash()
    assert Config.from_dict(cut.to_dict()).model_config == cut.model_config  # YAML, workers


def test_hf_overrides_errors_name_the_field(tiny_folder: Path, tmp_path: Path) -> None:
    from atomrt.runtime.config import ConfigError
    from atomrt.runtime.entrypoints.config_args import add_config_args, config_from_args

    for bad in ([("num_hidden_layers", 2)], {1: 2}, {"x": object()}):
        with pytest.raises(ConfigError, match=r"model_config\.hf_overrides"):
            ModelConfig(hf_overrides=bad)
    # a GGUF file's architecture is its metadata's: nothing to override
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    config = Config(model=str(fake), model_config=ModelConfig(hf_overrides={"vocab_size": 8}))
    with pytest.raises(ValueError, match="hf_overrides"):
        load_model(config, "cpu", torch.float32)
    # a checkpoint's tensors must fit the overridden architecture
    config = Config(
        model=str(tiny_folder), model_config=ModelConfig(hf_overrides={"num_hidden_layers": 1})
    )
    with pytest.raises(ValueError, match=r"model\.layers\.1\..* has no place"):
        load_model(config, "cpu", torch.float32)
    # the command line's --hf-overrides
    import argparse

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(["--model", "m", "--hf-overrides", '{"num_hidden_layers": 4}'])
    assert config_from_args(args).model_config.hf_overrides == {"num_hidden_layers": 4}
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-overrides", "[4]"])


def test_a_draft_model_takes_none_of_the_targets_hf_overrides() -> None:
    from atomrt.workers.spec_decode.draft_model import draft_config

    config = Config(
        model="tiny-deepseek-v3",
        model_config=ModelConfig(load_format="dummy", hf_overrides={"num_hidden_layers": 2}),
        speculative_config={"model": "tiny-qwen3-moe", "num_speculative_tokens": 2},
    )
    assert draft_config(config).model_config.hf_overrides is None

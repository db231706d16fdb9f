"""GGUF files: architecture from the metadata, and every tensor dequantized to float32 under its
Hugging Face name.

llama.cpp's converter permutes the rows of the Llama q/k projections (interleaved rotary pairs);
our rotary uses the Hugging Face half-split layout, so `_unpermute_rows` undoes it for `llama`.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from atomrt.workers.models.arch import ModelArch

if TYPE_CHECKING:
    from atomrt.workers.loading.gguf_file import GGUFFile

# general.architecture -> Hugging Face class; only llama.cpp's "llama" permutes q/k.
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


# Files already opened in this process, by (path, size, mtime): the architecture check, the weights
# and the tokenizer each open the file. A GGUFFile only reads (its arrays map the file read-only),
# so one is shared.
_READERS: OrderedDict[tuple[str, int, int], Any] = OrderedDict()
MAX_READERS = 2


def file_key(path: Path) -> tuple[str, int, int]:
    """(resolved path, size, mtime): what a cache of a file's parse is keyed by."""
    st = Path(path).stat()
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def open_gguf(path: Path) -> GGUFFile:
    """A GGUFFile over `path` (the one this process parsed already, while the file is
    unchanged); a file that does not parse is a ValueError naming it."""
    from atomrt.workers.loading.gguf_file import GGUFFile  # gguf's constants: imported on use

    try:
        key = file_key(path)
        reader = _READERS.get(key)
        if reader is not None:
            _READERS.move_to_end(key)
            return reader
        reader = GGUFFile(path)  # checks that every tensor lies inside the file
    except Exception as e:  # any parse failure of a third-party format means a corrupt file
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    _READERS[key] = reader
    while len(_READERS) > MAX_READERS:
        _READERS.popitem(last=False)
    return reader


def metadata_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def arch_from_gguf(reader: GGUFFile, path: Path) -> ModelArch:
    gguf_arch = metadata_value(reader, "general.architecture")
    if gguf_arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(_GGUF_ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"{path}: GGUF per-frequency rope factors (rope_freqs.weight) are not supported"
        )

    def meta(key: str, default: Any = None) -> Any:
        value = metadata_value(reader, f"{gguf_arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {gguf_arch}.{key}")
        return value

    hidden_size, num_heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")  # its length, not its strings
    vocab_size = int(meta("vocab_size", getattr(tokens, "count", None)))
    eos = metadata_value(reader, "tokenizer.ggml.eos_token_id")
    scaling = None
    if metadata_value(reader, f"{gguf_arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    return ModelArch(
        architecture=_GGUF_ARCHITECTURES[gguf_arch],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden_size // num_heads)),
        intermediate_size=int(meta("feed_forward_length")),
        max_position=int(meta("context_length")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token_id=metadata_value(reader, "tokenizer.ggml.bos_token_id"),
        checkpoint_dtype=None,
    )


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows are (pair, 2) interleaved; HF has (2, pair)."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    # [num_heads, head_dim / 2, 2, ...] -> [num_heads, 2, head_dim / 2, ...] -> [rows, ...]
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_weights(
    reader: GGUFFile, arch: ModelArch, path: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor [out, in]) for every tensor in the file."""
    from gguf.quants import dequantize

    unpermute = arch.architecture == "LlamaForCausalLM"
    for tensor in reader.tensors:
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:  # a bad block inside the file
            raise ValueError(f"{path}: cannot dequantize tensor {tensor.name!r} ({e})") from e
        array = np.ascontiguousarray(array, dtype=np.float32)
        w = torch.from_numpy(
            array if array.flags.writeable else array.copy()
        )  # F32 tensors are mmap views
        name = _hf_name(tensor.name)
        if unpermute and name.endswith("self_attn.q_proj.weight"):
            w = _unpermute_rows(w, arch.num_heads)
        elif unpermute and name.endswith("self_attn.k_proj.weight"):
            w = _unpermute_rows(w, arch.num_kv_heads)
        yield name, w

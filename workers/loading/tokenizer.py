"""Tokenizer loading (transformers, offline) and a small wrapper with the calls the engine uses."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

from atomrt.workers.loading.gguf import file_key, metadata_value, open_gguf
from atomrt.workers.loading.loader import ResolvedModel

EMBEDDED = "embedded"  # model_config.tokenizer: the bundled default model's tokenizer


class Tokenizer:
    """encode / decode / chat template over a transformers tokenizer."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id: Optional[int] = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        # Where transformers' decode would only call the Rust tokenizer, call it directly (about 1.6
        # of 2.5 us per call here); None: decode through transformers.
        self.rust = plain_rust_tokenizer(hf_tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.rust is not None:
            return self.rust.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools: Optional[list[dict[str, Any]]] = None,
    ) -> Union[list[int], str]:
        """The prompt for `messages` (and the `tools` they may call, OpenAI's form) as token ids
        (tokenize=True) or text."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        text = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def plain_rust_tokenizer(tokenizer: Any) -> Any:
    """The Rust tokenizer (`tokenizers.Tokenizer`) whose `decode` of a list of ids is exactly what
    `tokenizer`'s is: a transformers tokenizers-backed class that overrides neither `decode` nor
    `_decode`, without clean-up of tokenization spaces, or a `Tokenizer` over one. None otherwise
    (slow tokenizers, model-specific decoding)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.rust
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    rust = getattr(tokenizer, "_tokenizer", None)
    if (
        not isinstance(tokenizer, PreTrainedTokenizerFast)
        or rust is None
        or tokenizer.clean_up_tokenization_spaces
    ):
        return None
    base = PreTrainedTokenizerFast
    if type(tokenizer).decode is not base.decode or type(tokenizer)._decode is not base._decode:
        return None
    return rust


def load_tokenizer(resolved: ResolvedModel, tokenizer_path: Optional[str] = None) -> Tokenizer:
    """The tokenizer of `resolved` (or of `tokenizer_path`: a folder, a .gguf file, or "embedded",
    the bundled default model's), from local files only."""
    from transformers import AutoTokenizer

    if tokenizer_path == EMBEDDED:
        from atomrt.runtime.config import DEFAULT_MODEL
        from atomrt.workers.loading.loader import resolve_model

        tokenizer_path = str(resolve_model(DEFAULT_MODEL).path)
    source = Path(tokenizer_path).expanduser() if tokenizer_path else resolved.path
    if source is None:
        raise ValueError(
            f"{resolved.name}: a preset has no tokenizer; set model_config.tokenizer to a folder"
        )
    try:
        if source.suffix == ".gguf":
            hf = _gguf_tokenizer(source)
        else:
            hf = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{source}: cannot load a tokenizer ({e})") from e
    eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
    gen_config = source / "generation_config.json" if source.is_dir() else None
    if gen_config is not None and gen_config.is_file():
        import json

        value = json.loads(gen_config.read_text()).get("eos_token_id")
        eos += value if isinstance(value, list) else [value] if value is not None else []
    return Tokenizer(hf, tuple(dict.fromkeys(int(e) for e in eos)))


# Tokenizers built from a GGUF file in this process, by (path, size, mtime): transformers parses
# the file's metadata again (seconds for a large vocabulary) for every engine it starts. The engines
# of a process share one, which nothing may change. Other processes (an engine core, the API
# server, the next start) load it from the copy saved under the cache root, in a fraction of that.
_GGUF_TOKENIZERS: dict[tuple[str, int, int], Any] = {}


def _gguf_tokenizer(source: Path) -> Any:
    key = file_key(source)
    hf = _GGUF_TOKENIZERS.get(key)
    if hf is None:
        saved = _saved_tokenizer_dir(key)
        hf = _load_saved(saved) or _from_gguf(source, saved)
        _GGUF_TOKENIZERS[key] = hf
    return hf


def _saved_tokenizer_dir(key: tuple[str, int, int]) -> Path:
    from atomrt.runtime.envs import ENV

    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
    return ENV.cache_root / "tokenizers" / f"{Path(key[0]).stem}-{digest}"


def _load_saved(folder: Path) -> Any:
    """The tokenizer saved in `folder`, or None (not saved, or unreadable: built again)."""
    from transformers import AutoTokenizer

    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception:  # noqa: BLE001 - a damaged copy is rebuilt from the GGUF file
        return None


def _from_gguf(source: Path, saved: Path) -> Any:
    """Build the tokenizer from the GGUF file's metadata and save a copy for other processes (a
    cache root that cannot be written is skipped)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(
        str(source.parent), gguf_file=source.name, local_files_only=True
    )
    template = metadata_value(open_gguf(source), "tokenizer.chat_template")
    if template and not hf.chat_template:
        hf.chat_template = template
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=saved.name + ".", dir=saved.parent))
        hf.save_pretrained(str(tmp))
        if saved.exists():  # a damaged copy (it did not load)
            shutil.rmtree(saved, ignore_errors=True)
        try:
            os.replace(tmp, saved)  # whole or not at all; a copy saved meanwhile stays
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass
    return hf

"""Shared set-up of the executor tests: a tiny random Llama folder (safetensors + a word-level
tokenizer) and helpers to run it through `LLM` and to check that no engine process is left."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch

from atomrt import SamplingParams
from atomrt.runtime.entrypoints.llm import LLM

VOCAB = 128
PROMPTS = [
    [3, 17, 42, 99, 5, 8, 61],
    [7, 1, 120],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [50, 51],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# small KV cache (not the 1 GiB CPU default per rank), no graphs on CPU
COMMON = dict(
    device="cpu", enforce_eager=True, num_kv_blocks=64, max_num_seqs=8, worker_timeout_s=90.0
)


def build_tiny_llama(
    folder: Path, num_layers: int = 2, hidden_size: int = 64, seed: int = 0
) -> Path:
    """A 2-layer Llama (4 heads, 2 kv heads: TP=2 splits both) with weights large enough to matter.
    Other sizes and seeds give other models with the same vocabulary (draft models)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="w0", eos_token="w1", unk_token="w2"
    ).save_pretrained(folder)
    return folder


WORDS = [a + b for a in "abcdefghijklmnop" for b in "abcdefgh"]  # VOCAB two-letter words


def save_word_tokenizer(folder: Path, chat_template: Optional[str] = None) -> Path:
    """Replace a tiny model's tokenizer with a word-level one whose words are WORDS (one token
    each, whatever the text around them): tests that send text (bad words, echo, lm-eval) read
    token ids back from it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token=WORDS[2]))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token=WORDS[0], eos_token=WORDS[1], unk_token=WORDS[2]
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(folder)
    return folder


def build_target_and_draft(root: Path) -> tuple[Path, Path]:
    """A tiny target and a smaller, weaker model of its vocabulary to draft for it."""
    target = build_tiny_llama(root / "target")
    return target, build_tiny_llama(root / "draft", num_layers=1, hidden_size=32, seed=1)


def greedy_tokens(
    model: Path, prompts: list[list[int]] = PROMPTS, **kwargs: Any
) -> tuple[list[list[int]], dict[int, int]]:
    """Greedy tokens of `prompts` through LLM(**COMMON, **kwargs), and the worker pids it had."""
    llm = LLM(str(model), **{**COMMON, **kwargs})
    try:
        outs = llm.generate(prompts, GREEDY)
        pids = dict(getattr(llm.engine.executor, "worker_pids", {}))
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], pids


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        import psutil
    except ImportError:  # the GPU machine may lack psutil: /proc tells the same on Linux
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: Iterable[int], timeout_s: float = 15.0) -> list[int]:
    """The pids still alive after `timeout_s` (an empty list when every one exited)."""
    pids = list(pids)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if pid_alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if pid_alive(p)]

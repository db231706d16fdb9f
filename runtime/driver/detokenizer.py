"""Incremental detokenization of one sequence's output.

Decoding token by token breaks words (leading-space rules) and multi-byte characters (byte
fallback tokens decode to U+FFFD until the character is complete). We decode a short window
instead: `prefix_offset..read_offset` are tokens already turned into text, kept as left context;
each step decodes `prefix_offset..end` and emits what it adds to the context's text, unless that
ends in U+FFFD (an unfinished character), in which case we wait for more tokens.

Where the tokenizer's decode is the Rust tokenizer's own (`plain_rust_tokenizer`), the same
window runs inside a `tokenizers` DecodeStream primed with those prompt tokens: one call per read
instead of two decodes and their Python (Llama 3's tokenizer, 64 streamed rows: 2.1 against 3.0
us a row and step on a 2-core CPU). A prompt whose context ends inside a character or has no
text, or a window the stream cannot continue, falls back to the decodes here.

Streaming also holds back a tail of the text that could be the start of a stop string, so a
client never sees text that a later token turns into a stop (and is cut off).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, Optional

from atomrt.workers.loading.tokenizer import plain_rust_tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context for the first output token (spacing rules need some).
_CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Seq[int],
        skip_special_tokens: bool = True,
        stop: Seq[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.token_ids = list(prompt_token_ids)  # prompt + output, our own copy
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        self._text = ""  # all complete text decoded so far (cut before a stop string)
        self.num_streamed_chars = 0  # how much of output_text `take_stream_delta` has returned
        self._rust: Any = None  # with `_stream`: the Rust tokenizer it decodes with
        self._stream: Optional[Any] = None  # a tokenizers DecodeStream over the same window
        self._fed = self.read_offset  # the tokens the stream holds, whose text may be pending
        rust = plain_rust_tokenizer(tokenizer)
        context = self.token_ids[self.prefix_offset :]
        if rust is not None and context:
            try:
                from tokenizers.decoders import DecodeStream
            except ImportError:  # tokenizers before 0.21
                return
            stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            # the prompt's text comes back (not ours to emit); None: it ends inside a character,
            # whose first bytes the stream would emit with the output's: keep to the decodes
            if stream.step(rust, context) is not None:
                self._rust, self._stream = rust, stream

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def append_token(self, token_id: int) -> None:
        """Append one output token without decoding: text is made when it is asked for
        (`output_text`, `add_token`, `take_stream_delta`), in one decode for all pending tokens."""
        self.token_ids.append(int(token_id))

    def add_token(self, token_id: int) -> str:
        """Append one output token; return the new complete text it (and any pending tokens)
        yields ("" while a multi-byte character is unfinished)."""
        self.append_token(token_id)
        return self._catch_up()

    def _catch_up(self) -> str:
        """Decode the tokens past read_offset against the context window; append their text."""
        if self.read_offset == len(self.token_ids):
            return ""
        if self._stream is not None:
            if self._fed == len(self.token_ids):  # held in the stream already: nothing new
                return ""
            fed = self._fed
            # one token as an int: the list form costs about 0.9 us more a call
            new = self.token_ids[fed] if fed + 1 == len(self.token_ids) else self.token_ids[fed:]
            try:
                new_text = self._stream.step(self._rust, new)
            except Exception:  # noqa: BLE001 - the stream's own prefix check: decode the window
                self._stream = None
            else:
                self._fed = len(self.token_ids)
                if new_text is None:  # an unfinished character (or text-less tokens): wait
                    return ""
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
                self._text += new_text
                return new_text
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if full_text.endswith(_REPLACEMENT):
            return ""  # an unfinished character: wait for the bytes that complete it
        # What the new tokens add past the context's text; text already emitted is never rewritten.
        new_text = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        if new_text:  # tokens without text (skipped special ones) are no context for the next:
            self.prefix_offset = self.read_offset  # spacing rules would see a start of text
        self.read_offset = len(self.token_ids)
        self._text += new_text
        return new_text

    @property
    def output_text(self) -> str:
        self._catch_up()
        return self._text

    def truncate(self, num_chars: int) -> None:
        """Cut output_text to its first num_chars characters (at a stop string)."""
        self._text = self.output_text[:num_chars]
        self.num_streamed_chars = min(self.num_streamed_chars, num_chars)

    def take_stream_delta(self, finished: bool) -> str:
        """Text not yet streamed. While running, a tail that could begin a stop string is held
        back; once finished, everything left is released."""
        text = self.output_text
        end = len(text)
        if not finished and self.stop:
            end -= held_back_len(text, self.stop)
        end = max(end, self.num_streamed_chars)
        delta = text[self.num_streamed_chars : end]
        self.num_streamed_chars = end
        return delta


def held_back_len(text: str, stop: Seq[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best

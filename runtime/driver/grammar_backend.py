"""The grammar-backend interface: what structured outputs ask of a grammar library.

A backend (`GrammarBackend`) turns a request's constraint (`StructuredOutputsParams`) into a
compiled grammar and gives each constrained sequence a matcher (`GrammarMatcher`): where its output
stands in that grammar. Everything else (the compile threads and cache: grammar_compiler.py; the
held requests, the step's constrained rows and their masks: structured_outputs.py) is the same for
every backend. The backends, by `structured_outputs_config.backend`: `BACKENDS` in
grammar_compiler.py; xgrammar (xgrammar_backend.py) is the one today.

A mask is the backends' common form: packed int32 rows, bit `t % 32` of word `t // 32` set for an
allowed token `t` (a torch int32 CPU tensor `[rows, ceil(vocab / 32)]`), applied on the sampling
worker (workers/runner/logit_additions.py) whatever backend filled it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from atomrt.runtime.sampling_params import StructuredOutputsParams


class GrammarMatcher(ABC):
    """One sequence's place in its compiled grammar (`Sequence.grammar`). A backend implements
    the four primitives; the speculative-decoding helpers are built on them."""

    vocab_size: int  # the model's (its logits' width)

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance on an emitted token; False if the grammar refuses it (the matcher stays)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar accepted its end (a stop token after a complete output)."""

    @abstractmethod
    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a packed mask."""

    def fill_verify(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows `row .. row + len(drafts)`: the mask before each draft and after the last, each
        with the drafts before it accepted; the matcher is left where it was."""
        self.fill(bitmask, row)
        accepted = 0
        for i, token in enumerate(drafts):
            if not self.accept(int(token)):  # cannot happen: drafts were checked
                bitmask[row + i + 1 : row + len(drafts) + 1] = -1  # unreachable rows
                break
            accepted += 1
            self.fill(bitmask, row + i + 1)
        if accepted:
            self.rollback(accepted)

    def settle(self) -> bool:
        """A token the backend accepted ahead (`GrammarBackend.accept_ahead`) that the stop rules
        never asked about is undone; whether that changed the matcher (none by default)."""
        return False

    def valid_drafts(self, proposal: list[int], pad_to: int = 0) -> list[int]:
        """`proposal` cut before its first token the grammar refuses, then (with `pad_to`) padded to
        that many with tokens it allows (the lowest id each mask allows): a verify step whose rows
        all follow the grammar."""
        drafts: list[int] = []
        for token in proposal:
            if self.is_terminated or not self.accept(int(token)):
                break
            drafts.append(int(token))
        if len(drafts) < pad_to:
            mask = torch.full((1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
            while len(drafts) < pad_to and not self.is_terminated:
                self.fill(mask, 0)
                allowed = np.flatnonzero(allowed_tokens(mask.numpy()[0]))
                if not allowed.size or not self.accept(int(allowed[0])):
                    break
                drafts.append(int(allowed[0]))
        if drafts:
            self.rollback(len(drafts))
        return drafts


class MaskBuffers:
    """The arrays a DP rank's masks are filled into, reused step after step rather than allocated
    (a megabyte a step at 64 rows of Llama-3's vocabulary). `SLOTS` arrays take turns per rank: a
    mask is sent (copied to the device or encoded) as soon as it is filled, and at most two steps'
    masks of a rank are filled before they are sent."""

    SLOTS = 4

    def __init__(self, words: int) -> None:
        self.words = words
        self._rings: dict[int, list[np.ndarray]] = {}
        self._turns: dict[int, int] = {}

    def take(self, dp_rank: int, rows: int) -> np.ndarray:
        """int32 [rows, words] of DP rank `dp_rank`, its contents stale: every row is to be
        written."""
        ring = self._rings.get(dp_rank)
        if ring is None:
            ring = self._rings[dp_rank] = [np.empty((0, self.words), np.int32)] * self.SLOTS
        turn = self._turns.get(dp_rank, 0)
        self._turns[dp_rank] = (turn + 1) % self.SLOTS
        if ring[turn].shape[0] < rows:
            ring[turn] = np.empty((max(rows, 2 * ring[turn].shape[0]), self.words), np.int32)
        return ring[turn][:rows]


def allowed_tokens(packed: np.ndarray) -> np.ndarray:
    """bool [words * 32]: which tokens one packed int32 mask row allows (bit t % 32 of word
    t // 32)."""
    return np.unpackbits(packed.astype("<i4").view(np.uint8), bitorder="little").astype(bool)


class GrammarBackend(ABC):
    """One engine's grammar library, over its tokenizer's vocabulary. Built off the step loop on
    the first constrained request (indexing the vocabulary takes a moment); `compile` runs on the
    compile threads, the rest on the step loop. `validate` and `parse` need no vocabulary."""

    @abstractmethod
    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        """`vocab_size`: the model's (its logits' width, which may exceed the tokenizer's);
        `stop_token_ids`: the tokens a finished grammar allows (the engine's EOS ids). An error
        here (a tokenizer the library cannot read) fails every constrained request."""

    @staticmethod
    @abstractmethod
    def validate(so: StructuredOutputsParams) -> Any:
        """The constraint as `parse` takes it, or a ValueError naming the field (or the schema
        keyword and its place) when the backend would not enforce it exactly."""

    @staticmethod
    @abstractmethod
    def parse(so: StructuredOutputsParams, checked: Any) -> Any:
        """The backend's grammar of a constraint (`checked`: what `validate` made of it); a
        ValueError naming the field when it does not parse."""

    @abstractmethod
    def compile(self, grammar: Any) -> Any:
        """A parsed grammar against the vocabulary (on a compile thread; may take seconds)."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A new sequence's matcher, at the start of the compiled grammar."""

    def fill_rows(
        self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]
    ) -> None:
        """Each matcher's next-token mask into its row (a backend may batch them)."""
        for m, row in zip(matchers, rows):
            m.fill(bitmask, row)

    def accept_ahead(self, matchers: list[GrammarMatcher], tokens: list[int]) -> bool:
        """A step's tokens, before the stop rules apply them: a backend may advance each matcher
        on its token now, in one batch, the matcher keeping the answer for the stop rules'
        `accept` of that token, which then calls nothing of the library; whether it did. By
        default nothing is done ahead: each `accept` advances."""
        return False

    def shutdown(self) -> None:
        """Threads the backend started are let go."""

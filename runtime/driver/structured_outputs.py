"""`StructuredOutputs`: the driver's grammar state for constrained requests
(`SamplingParams.structured_outputs`). The workers only apply masks.

- **add_request** (`prepare`): the constraint is parsed and compiled on a thread
  (runtime/driver/grammar_compiler.py); one that can never compile fails its request with the
  error naming the field (or the schema keyword), like a compile that misses the budget. Until
  its grammar is compiled the request's sequences wait here, not in a scheduler, so they hold up
  nobody; `release` hands them to their scheduler with a matcher each (`Sequence.grammar`, the
  backend's `GrammarMatcher`) once it is, and fails the request (`Failed`) once it waited longer
  than `structured_outputs_config.grammar_compile_timeout_s`. The backend (grammar_backend.py) is
  built on the first constrained request: an engine that never sees one never loads its library.
- **each step** (`plan`): the logits rows a grammar constrains (each sampled constrained
  sequence's row, and with speculative decoding its verify rows) go into the `RankBatch` as
  `grammar_rows`; their masks (`GrammarBitmask`, to each DP rank's sampling worker) are filled in
  one batch as soon as every row's grammar state is known: at once, or, under async scheduling
  when a row's token is still in flight, right after the previous step's tokens have advanced the
  grammars (`fill_ready(final=True)`).
- **postprocess**: the stop rules advance a sequence's matcher on each token it emits
  (runtime/driver/stop_checker.py); a grammar that has accepted its end finishes the request
  ("stop").
- **speculative decoding**: an n-gram proposal is cut at its first token the grammar refuses
  (`GrammarMatcher.valid_drafts`); each verify row gets the mask of the grammar advanced through the
  drafts before it, which are then rolled back: the matcher moves on the accepted tokens only.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from atomrt.distributed.messages import GrammarBitmask, RankBatch
from atomrt.runtime.config import StructuredOutputsConfig
from atomrt.runtime.driver.grammar_backend import GrammarMatcher, allowed_tokens
from atomrt.runtime.driver.grammar_compiler import COMPILE_TIMEOUT, GrammarCompiler
from atomrt.runtime.driver.xgrammar_backend import XgrammarMatcher
from atomrt.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atomrt.runtime.driver.scheduler import Scheduler, SchedulerOutput
    from atomrt.runtime.driver.sequence import Sequence

__all__ = ["Failed", "GrammarMatcher", "SeqGrammar", "StructuredOutputs", "allowed_tokens"]

logger = logging.getLogger(__name__)

INIT_TIMEOUT_S = 120.0  # the bound on building the backend: its library's import, the vocabulary

# A matcher of the default backend built from its compiled grammar: `SeqGrammar(compiled,
# stop_token_ids, vocab_size)`, for code that holds an xgrammar `CompiledGrammar` (tests).
SeqGrammar = XgrammarMatcher


@dataclass
class _Entry:
    seq: Sequence
    row: int  # its first mask row (and logits row)
    drafts: list[int]


@dataclass
class _RankMasks:
    dp_rank: int
    entries: list[_Entry]
    num_rows: int


@dataclass
class StepMasks:
    """One step's constrained rows, per DP rank, until their masks are filled."""

    step: int
    ranks: list[_RankMasks]
    deferred: bool  # a row's token is still in flight: fill after the previous step's results


@dataclass
class Failed:
    """A request that never ran: its grammar did not compile, or not within the budget."""

    request_id: str
    seqs: list[Sequence]
    error: str


@dataclass
class _Held:
    request_id: str
    seqs: list[Sequence]
    future: Future
    since: float  # time.monotonic() at add_request
    hit: bool  # compiled already when the request came
    scheduler: Scheduler  # the one its sequences join once the grammar is compiled


@dataclass
class MaskStats:
    """Mask fills since start: rows filled and the seconds it took (the driver's host time)."""

    rows: int = 0
    seconds: float = 0.0


@dataclass
class StructuredOutputs:
    """The engine's structured-output state (module docstring). `tokenizer` None: a model without
    one, whose constrained requests are refused."""

    tokenizer: Any
    vocab_size: int
    stop_token_ids: list[int]
    config: StructuredOutputsConfig
    held: list[_Held] = field(default_factory=list)
    pending: list[StepMasks] = field(default_factory=list)  # planned, not yet filled and sent
    mask_stats: MaskStats = field(default_factory=MaskStats)

    num_live: int = 0  # sequences with a matcher that have not finished

    def __post_init__(self) -> None:
        self._starter: Optional[ThreadPoolExecutor] = None
        self._compiler: Optional[Future] = None  # started by the first constrained request
        self._words = (self.vocab_size + 31) // 32

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler, built (on a thread, waited for) on first use; a ValueError when it
        cannot be."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs: this model has no tokenizer to compile with")
        if self._compiler is None:
            self._starter = ThreadPoolExecutor(1, thread_name_prefix="atomrt-grammar-init")
            self._compiler = self._starter.submit(
                GrammarCompiler,
                self.tokenizer.hf,
                self.vocab_size,
                self.stop_token_ids,
                self.config,
            )
        try:
            return self._compiler.result(timeout=INIT_TIMEOUT_S)
        except FutureTimeout:
            raise ValueError(
                f"structured_outputs: the grammar backend did not index the tokenizer's vocabulary "
                f"within {INIT_TIMEOUT_S:.0f} s"
            ) from None
        except Exception as e:  # noqa: BLE001 - what the backend raised, told to the client
            raise ValueError(
                f"structured_outputs: the grammar backend cannot read this tokenizer: {e}"
            ) from None

    # ---------------------------------------------------------------- requests

    def prepare(self, params: SamplingParams) -> Optional[Future]:
        """Start parsing and compiling a request's constraint on a compile thread (None: the
        request has none)."""
        if params.structured_outputs is None:
            return None
        return self.compiler.compile(params.structured_outputs)

    def admit(
        self, request_id: str, seqs: list[Sequence], future: Future, scheduler: Scheduler
    ) -> bool:
        """True: the grammar was compiled already (a cache hit), the matchers are attached and the
        sequences may be scheduled; False: they are held until it compiles (`release` adds them
        to `scheduler`)."""
        if future.done() and future.exception() is None:
            self.attach(seqs, future)
            self.compiler.record(0.0, hit=True)
            return True
        self.held.append(
            _Held(request_id, seqs, future, time.monotonic(), future.done(), scheduler)
        )
        return False

    def attach(self, seqs: list[Sequence], future: Future) -> None:
        """Give each sequence its matcher (the grammar is compiled: `future` is done)."""
        compiled = future.result()
        backend = self.compiler.backend
        for seq in seqs:
            seq.grammar = backend.matcher(compiled)
        self.num_live += len(seqs)

    def finished(self, seqs: list[Sequence]) -> None:
        """These sequences ended (finished or aborted)."""
        self.num_live -= sum(1 for s in seqs if s.grammar is not None)

    def abort(self, request_id: str, aborted: list[Sequence]) -> list[Sequence]:
        """A request is aborted: `aborted` (its sequences its scheduler dropped) and those held
        here for their grammar, which end ("abort")."""
        for i, h in enumerate(self.held):
            if h.request_id == request_id:
                del self.held[i]
                for seq in h.seqs:
                    seq.finish("abort")
                aborted = aborted + h.seqs
                break
        self.finished(aborted)
        return aborted

    def release(self) -> list[Failed]:
        """Held requests whose grammar is now compiled join their scheduler (matchers attached);
        returns those that failed, their sequences ended ("abort"): a grammar that did not
        compile, or one still compiling after the budget."""
        if not self.held:
            return []
        failed: list[Failed] = []
        keep: list[_Held] = []
        now = time.monotonic()
        compiler = self.compiler
        for h in self.held:
            if h.future.done():
                error = h.future.exception()
                if error is not None:
                    text = str(error)
                    if not text.startswith("structured_outputs"):
                        text = f"structured_outputs: {text}"
                    failed.append(Failed(h.request_id, h.seqs, text))
                    continue
                compiler.record(now - h.since, h.hit)
                self.attach(h.seqs, h.future)
                for seq in h.seqs:
                    h.scheduler.add(seq)
            elif now - h.since > compiler.timeout_s:
                compiler.stats.timeouts += 1
                failed.append(
                    Failed(
                        h.request_id,
                        h.seqs,
                        f"structured_outputs: the grammar {COMPILE_TIMEOUT} "
                        f"{compiler.timeout_s:g} s (structured_outputs_config."
                        "grammar_compile_timeout_s) on a busy machine; retry (the compile goes "
                        "on and is kept), simplify the schema or raise the budget",
                    )
                )
            else:
                keep.append(h)
        self.held = keep
        for f in failed:
            for seq in f.seqs:
                seq.finish("abort")
        return failed

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for a held grammar to compile (an engine with nothing else to
        run)."""
        if self.held:
            wait([h.future for h in self.held], timeout=timeout_s, return_when="FIRST_COMPLETED")

    # ---------------------------------------------------------------- each step

    def plan(self, step: int, outs: list[SchedulerOutput], batches: list[RankBatch]) -> None:
        """Set each rank's `grammar_rows` and remember the step's masks to fill."""
        if not self.num_live:  # no constrained sequence: the step pays nothing
            return
        ranks: list[_RankMasks] = []
        deferred = False
        for dp_rank, (out, batch) in enumerate(zip(outs, batches)):
            entries: list[_Entry] = []
            rows: list[int] = []
            at = 0  # the step's logits rows: each sampled sequence's verify rows, then its own
            for s in out.scheduled:
                if not s.is_sampled:
                    continue
                n = 1 + s.num_draft_tokens
                if s.seq.grammar is not None:
                    entries.append(_Entry(s.seq, len(rows), s.draft_token_ids))
                    rows.extend(range(at, at + n))
                    deferred = deferred or s.seq.num_pending > 0
                at += n
            if entries:
                batch.grammar_rows = np.asarray(rows, dtype=np.int32)
                ranks.append(_RankMasks(dp_rank, entries, len(rows)))
        if ranks:
            self.pending.append(StepMasks(step, ranks, deferred))

    def fill_ready(self, final: bool = False) -> list[GrammarBitmask]:
        """The masks of planned steps whose grammar states are known: those planned without a
        token in flight, or (`final`: the previous step's tokens are in) every one."""
        out: list[GrammarBitmask] = []
        keep: list[StepMasks] = []
        for sm in self.pending:
            if sm.deferred and not final:
                keep.append(sm)
                continue
            out += [self._fill(sm.step, r) for r in sm.ranks]
        self.pending = keep
        return out

    def _fill(self, step: int, rank: _RankMasks) -> GrammarBitmask:
        start = time.perf_counter()
        bitmask = np.full((rank.num_rows, self._words), -1, dtype=np.int32)
        view = torch.from_numpy(bitmask)  # the backend fills the numpy array through it
        plain: list[GrammarMatcher] = []
        rows: list[int] = []
        for e in rank.entries:
            grammar = e.seq.grammar
            if e.seq.is_finished or grammar.is_terminated:  # a wasted row: any mask does
                continue
            if e.drafts:
                grammar.fill_verify(view, e.row, e.drafts)
            else:
                plain.append(grammar)
                rows.append(e.row)
        if plain:
            self.compiler.backend.fill_rows(plain, view, rows)
        stats = self.mask_stats
        stats.rows += rank.num_rows
        stats.seconds += time.perf_counter() - start
        return GrammarBitmask(dp_rank=rank.dp_rank, step=step, bitmask=bitmask)

    def forget_pending(self) -> None:
        """The steps in flight were discarded: their masks are never sent."""
        self.pending.clear()

    def stats(self) -> dict[str, Any]:
        """Compiles and mask fills since start, under CoreStats' names."""
        out: dict[str, Any] = {
            "grammar_mask_rows": self.mask_stats.rows,
            "grammar_mask_seconds": self.mask_stats.seconds,
        }
        if self._built():
            c = self._compiler.result().stats
            out.update(
                grammar_compiles=c.misses,
                grammar_compile_seconds=c.miss_seconds,
                grammar_cache_hits=c.hits,
                grammar_cache_hit_seconds=c.hit_seconds,
            )
        return out

    def _built(self) -> bool:
        return (
            self._compiler is not None
            and self._compiler.done()
            and self._compiler.exception() is None
        )

    def shutdown(self) -> None:
        if self._starter is not None:
            self._starter.shutdown(wait=False, cancel_futures=True)
        if self._built():
            self._compiler.result().shutdown()

"""`StructuredOutputs`: the driver's grammar state for constrained requests
(`SamplingParams.structured_outputs`). The workers only apply masks.

The engine's step calls it at two points: `plan` once a step is scheduled and submitted (the masks
of its constrained rows, the requests whose grammar failed, the wait of an engine with nothing but
grammars to compile) and `took_results` once the schedulers applied a step's tokens, before its
outputs are built (the masks of a planned step that waited for them; under async scheduling the
engine submits the next plan right after them). The scheduler asks `ready` of each waiting sequence; `prepare`,
`admit` and `abort` follow a request's life.

- **add_request** (`prepare`, `admit`): the constraint is parsed and compiled on a thread
  (runtime/driver/grammar_compiler.py); one that can never compile fails its request with the
  error naming the field (or the schema keyword), like a compile that misses the budget. The
  request's sequences join their scheduler's waiting queue at once, but until the grammar is
  compiled `ready` says no and the scheduler passes them over, so they hold up nobody. Whichever
  of `ready` and `plan` sees the compile done first gives each sequence its matcher
  (`Sequence.grammar`, the backend's `GrammarMatcher`). `plan` fails the request (`Failed`) once
  its grammar did not compile, or waited longer than
  `structured_outputs_config.grammar_compile_timeout_s`. The backend (grammar_backend.py) is built
  on the first constrained request: an engine that never sees one never loads its library.
- **each step** (`plan`): the logits rows a grammar constrains (each sampled constrained
  sequence's row, and with speculative decoding its verify rows) are in the `RankBatch` as
  `grammar_rows` (the planner, runtime/driver/planner.py); their masks (`GrammarBitmask`, to each
  DP rank's sampling worker) are filled in one batch as soon as every row's grammar state is known:
  at once, or, under async scheduling when a row's token is still in flight, right after the
  previous step's tokens have advanced the grammars (`took_results`).
- **postprocess**: the stop rules advance a sequence's matcher on each token it emits
  (runtime/driver/stop_checker.py); a grammar that has accepted its end finishes the request
  ("stop"). Before them `advance` has the backend accept the step's tokens in one batch (on
  threads on a machine with the cores), each matcher keeping its answer for the stop rules;
  one they did not ask about is undone in `took_results`. With `FILL_ON_THREAD` (on) the masks
  waiting for those tokens then fill on a thread while the stop rules run and the next step is
  planned, and `took_results` takes them.
- **speculative decoding**: an n-gram proposal is cut at its first token the grammar refuses
  (`GrammarMatcher.valid_drafts`); each verify row gets the mask of the grammar advanced through the
  drafts before it, which are then rolled back: the matcher moves on the accepted tokens only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from atomrt.distributed.messages import GrammarBitmask, StepPlan
from atomrt.runtime.config import StructuredOutputsConfig
from atomrt.runtime.config_sections import usable_cpu_count
from atomrt.runtime.driver.grammar_backend import GrammarMatcher, MaskBuffers, allowed_tokens
from atomrt.runtime.driver.grammar_compiler import COMPILE_TIMEOUT, GrammarCompiler
from atomrt.runtime.driver.xgrammar_backend import XgrammarMatcher
from atomrt.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atomrt.runtime.driver.scheduler import SchedulerOutput
    from atomrt.runtime.driver.sequence import Sequence

__all__ = ["Failed", "GrammarMatcher", "SeqGrammar", "StructuredOutputs", "allowed_tokens"]

logger = logging.getLogger(__name__)

INIT_TIMEOUT_S = 120.0  # the bound on building the backend: its library's import, the vocabulary
IDLE_GRAMMAR_WAIT_S = 0.02  # an engine with only grammars compiling waits this long per step
# the masks that wait for a step's tokens fill on a thread beside the step loop (`advance`). On
# an H100 host (16 cores; `atomrt bench serve` on Llama-3.2-1B's shape, user_profiles.json), with
# GRAMMAR_MASK_KERNEL, constrained over unconstrained tokens/s went 0.469 -> 0.560 at c=64 and
# 0.709 -> 0.742 at c=16; on 2 busy cores the step loop's CPU time fell by the fill's (about
# 0.5 ms at 64 rows), its wall time did not (benchmarks/bench_grammar_step.py --fill-on-thread)
# Building the step's outputs while the fill runs, the masks sent after them, did not pay: on an
# H100 host (bench_grammar_step.py --device cuda --bs 64 --forward-ms 1.2, Llama 3's vocabulary)
# the step took 2634 / 3708 us at 16 / 64 constrained rows that way round against 2612 / 3740
# this way, and the masks went out 450-650 us later
FILL_ON_THREAD = True

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
class _FillJob:
    """A rank's mask as the step loop prepared it; what is left to fill (`_fill_plain`)."""

    mask: GrammarBitmask
    view: torch.Tensor  # the mask's array, as the backend fills it
    matchers: list[GrammarMatcher]
    rows: list[int]
    seconds: float  # spent preparing it


@dataclass
class Failed:
    """A request that never ran: its grammar did not compile, or not within the budget."""

    request_id: str
    error: str


@dataclass
class _Held:
    seqs: list[Sequence]
    future: Future
    since: float  # time.monotonic() at add_request
    hit: bool  # compiled already when the request came


@dataclass
class MaskStats:
    """Mask fills since start: rows filled and the seconds it took (the driver's host time); and
    the seconds the grammars took to accept steps' tokens ahead of the stop rules (`advance`)."""

    rows: int = 0
    seconds: float = 0.0
    accept_seconds: float = 0.0


@dataclass
class StructuredOutputs:
    """The engine's structured-output state (module docstring). `tokenizer` None: a model without
    one, whose constrained requests are refused."""

    tokenizer: Any
    vocab_size: int
    stop_token_ids: list[int]
    config: StructuredOutputsConfig
    # requests whose grammar is compiling, by request id (their sequences wait in a scheduler)
    held: dict[str, _Held] = field(default_factory=dict)
    pending: list[StepMasks] = field(default_factory=list)  # planned, not yet filled and sent
    mask_stats: MaskStats = field(default_factory=MaskStats)

    def __post_init__(self) -> None:
        self._starter: Optional[ThreadPoolExecutor] = None
        self._compiler: Optional[Future] = None  # started by the first constrained request
        self._buffers = MaskBuffers((self.vocab_size + 31) // 32)  # the masks' arrays
        self._ahead: list[GrammarMatcher] = []  # accepted a token ahead of the stop rules
        self._constrained: deque[bool] = deque()  # the steps in flight: whether any row is
        self._filler: Optional[ThreadPoolExecutor] = None  # masks filled beside the step loop
        self._cores = usable_cpu_count()  # a fill thread needs a core beside the step loop's
        self._filling: Optional[Future] = None  # each pending step's masks, until took_results

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

    def admit(self, request_id: str, seqs: list[Sequence], future: Future) -> None:
        """A constrained request's sequences, before they join their scheduler: given their
        matchers now when the grammar was compiled already (a cache hit), else held until it is
        (`ready`)."""
        if future.done() and future.exception() is None:
            self.attach(seqs, future)
            self.compiler.record(0.0, hit=True)
        else:
            self.held[request_id] = _Held(seqs, future, time.monotonic(), future.done())

    def attach(self, seqs: list[Sequence], future: Future) -> None:
        """Give each sequence its matcher (the grammar is compiled: `future` is done)."""
        compiled = future.result()
        backend = self.compiler.backend
        for seq in seqs:
            seq.grammar = backend.matcher(compiled)

    def ready(self, seq: Sequence) -> bool:
        """The scheduler's question of a waiting sequence: False while its grammar compiles (or
        failed to: `plan` ends the request). Its request's sequences get their matchers here or
        in `plan`, whichever sees the compile done first."""
        if not self.held:
            return True
        h = self.held.get(seq.request_id)
        if h is None:
            return True
        if not h.future.done() or h.future.exception() is not None:
            return False
        self._take(seq.request_id, h, time.monotonic())
        return True

    def _take(self, request_id: str, h: _Held, now: float) -> None:
        """A held request's grammar compiled: its sequences get their matchers."""
        del self.held[request_id]
        self.compiler.record(now - h.since, h.hit)
        self.attach(h.seqs, h.future)

    def abort(self, request_id: str) -> None:
        """A request is aborted (its scheduler dropped its sequences): a grammar it waits for is
        no longer its (the compile goes on, and is cached)."""
        self.held.pop(request_id, None)

    # ---------------------------------------------------------------- each step

    def plan(
        self, plan: Optional[StepPlan], outs: list[SchedulerOutput], idle: bool
    ) -> tuple[list[GrammarBitmask], list[Failed]]:
        """A step was scheduled and submitted (`plan`, None: nothing to run): the masks of its
        constrained rows whose grammar states are known (send them now), and the requests whose
        grammar failed, or outlived the compile budget (end them). `idle`: nothing runs and
        nothing is in flight, so an engine waiting only for grammars blocks a moment here rather
        than spin."""
        failed = self._check_held() if self.held else []
        if idle and self.held:
            wait(
                [h.future for h in self.held.values()],
                timeout=IDLE_GRAMMAR_WAIT_S,
                return_when="FIRST_COMPLETED",
            )
        constrained = plan is not None and any(batch.grammar_rows.size for batch in plan.ranks)
        if plan is not None:  # its results come to `advance` in this order
            self._constrained.append(constrained)
        if not constrained:
            return [], failed  # no constrained row: the step pays nothing
        ranks: list[_RankMasks] = []
        deferred = False
        for dp_rank, (out, batch) in enumerate(zip(outs, plan.ranks)):
            if not batch.grammar_rows.size:
                continue
            entries: list[_Entry] = []
            num_rows = 0  # the mask rows: each sampled sequence's verify rows, then its own
            for s in out.scheduled:
                if s.is_sampled and s.seq.grammar is not None:
                    entries.append(_Entry(s.seq, num_rows, s.draft_token_ids))
                    num_rows += 1 + s.num_draft_tokens
                    # tokens in flight when it was scheduled (async scheduling)
                    deferred = deferred or s.num_tokens > s.seq.num_tokens
            assert num_rows == batch.grammar_rows.size, (num_rows, batch.grammar_rows)
            ranks.append(_RankMasks(dp_rank, entries, num_rows))
        self.pending.append(StepMasks(plan.step, ranks, deferred))
        return self._fill_ready(final=False), failed

    def advance(
        self, outs: list[SchedulerOutput], sampled: list[dict[int, Any]], speculative: bool
    ) -> None:
        """A step's tokens are in (`sampled`: each DP rank's seq_id -> token, or tokens), before
        the stop rules apply them: each constrained sequence's grammar advances on its one token
        now, all in one batch (the backend's `accept_ahead`), and keeps the answer for the stop
        rules' `accept`. Rows the stop rules may not ask about, or ask in another order, are
        left to them: several tokens (speculative decoding), or allowed_token_ids or bad_words,
        which the stop rules check before the grammar.

        When every constrained row was accepted here, the masks waiting for these tokens are
        then filled on a thread (`FILL_ON_THREAD`), while the step loop applies the stop rules
        and plans the next step: until `took_results` takes them, nothing on the step loop calls
        into those matchers' library (the stop rules read the answers kept; `speculative`: an
        engine whose proposers advance matchers while it plans fills on the step loop)."""
        constrained = self._constrained.popleft() if self._constrained else True
        if self._compiler is None or not constrained:  # no constrained row: nothing to walk
            return
        matchers: list[GrammarMatcher] = []
        tokens: list[int] = []
        left = False  # a constrained row the stop rules advance themselves
        for out, by_seq in zip(outs, sampled):
            for s in out.scheduled:
                seq = s.seq
                grammar = seq.grammar
                if grammar is None or not s.is_sampled or seq.is_finished:
                    continue
                token = by_seq.get(seq.seq_id)
                if (
                    isinstance(token, int)
                    and not grammar.is_terminated
                    and not seq.sampling_params.allowed_token_ids
                    and not seq.bad_words_token_ids
                ):
                    matchers.append(grammar)
                    tokens.append(token)
                else:
                    left = True
        if matchers:
            start = time.perf_counter()
            if self.compiler.backend.accept_ahead(matchers, tokens):
                self._ahead = matchers
            else:
                left = True
            self.mask_stats.accept_seconds += time.perf_counter() - start
        if FILL_ON_THREAD and self.pending and not left and not speculative and self._cores > 1:
            if self._filler is None:
                self._filler = ThreadPoolExecutor(1, thread_name_prefix="atomrt-grammar-fill")
            # every pending step's states are known now; they stay pending (the engine plans the
            # next step ahead of their masks) until took_results takes the masks
            jobs = [[self._fill_job(sm.step, r) for r in sm.ranks] for sm in self.pending]
            started = threading.Event()
            self._filling = self._filler.submit(self._fill_steps, jobs, started)
            # a thread waiting for the GIL gets it only when the holder blocks, or after the
            # switch interval (5 ms): the step loop lets it through to the fill, which releases it
            started.wait()

    def took_results(self) -> list[GrammarBitmask]:
        """A step's results were applied (the stop rules advanced each matcher on its tokens):
        the masks of planned steps that waited for them (send them now)."""
        filled = self._join_fill()
        out: list[GrammarBitmask] = []
        if not self._settle() and filled:  # else a state they were filled from was undone
            del self.pending[: len(filled)]  # the steps pending at `advance`, in order
            out = [mask for masks in filled for mask in masks]
        return out + (self._fill_ready(final=True) if self.pending else [])

    def _join_fill(self) -> list[list[GrammarBitmask]]:
        """Each step's masks filled on the thread since `advance` (none: nothing was)."""
        filling, self._filling = self._filling, None
        return [] if filling is None else filling.result()

    def _fill_steps(
        self, jobs: list[list[_FillJob]], started: threading.Event
    ) -> list[list[GrammarBitmask]]:
        """On the fill thread: each step's masks (`jobs`: its ranks' `_fill_job`s)."""
        started.set()  # the step loop waits for this thread to get this far
        return [[self._fill_plain(job) for job in step] for step in jobs]

    def _settle(self) -> bool:
        """Tokens accepted ahead that the stop rules did not ask about are undone; whether one
        was."""
        undone = False
        for m in self._ahead:
            undone = m.settle() or undone
        self._ahead = []
        return undone

    def _check_held(self) -> list[Failed]:
        """Held requests whose grammar compiled get their matchers (their wait is counted now,
        not when a busy scheduler gets to them); returns those whose grammar did not compile, or
        is still compiling after the budget, no longer held."""
        failed: list[Failed] = []
        now = time.monotonic()
        compiler = self.compiler
        for request_id, h in list(self.held.items()):
            if h.future.done():
                error = h.future.exception()
                if error is None:
                    self._take(request_id, h, now)
                    continue
                text = str(error)
                if not text.startswith("structured_outputs"):
                    text = f"structured_outputs: {text}"
                failed.append(Failed(request_id, text))
            elif now - h.since > compiler.timeout_s:
                compiler.stats.timeouts += 1
                failed.append(
                    Failed(
                        request_id,
                        f"structured_outputs: the grammar {COMPILE_TIMEOUT} "
                        f"{compiler.timeout_s:g} s (structured_outputs_config."
                        "grammar_compile_timeout_s) on a busy machine; retry (the compile goes "
                        "on and is kept), simplify the schema or raise the budget",
                    )
                )
            else:
                continue
            del self.held[request_id]
        return failed

    def _fill_ready(self, final: bool) -> list[GrammarBitmask]:
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
        return self._fill_plain(self._fill_job(step, rank))

    def _fill_job(self, step: int, rank: _RankMasks) -> _FillJob:
        """A rank's mask, its verify rows filled (speculative decoding), its other rows to fill
        (`_fill_plain`)."""
        start = time.perf_counter()
        bitmask = self._buffers.take(rank.dp_rank, rank.num_rows)
        view = torch.from_numpy(bitmask)  # the backend fills the numpy array through it
        job = _FillJob(GrammarBitmask(rank.dp_rank, step, bitmask), view, [], [], 0.0)
        for e in rank.entries:
            grammar = e.seq.grammar
            if e.seq.is_finished or grammar.is_terminated:  # a wasted row: any mask does
                bitmask[e.row : e.row + 1 + len(e.drafts)] = -1
                continue
            if e.drafts:
                grammar.fill_verify(view, e.row, e.drafts)
            else:
                job.matchers.append(grammar)
                job.rows.append(e.row)
        job.seconds = time.perf_counter() - start
        return job

    def _fill_plain(self, job: _FillJob) -> GrammarBitmask:
        start = time.perf_counter()
        if job.matchers:
            self.compiler.backend.fill_rows(job.matchers, job.view, job.rows)
        stats = self.mask_stats
        stats.rows += job.mask.bitmask.shape[0]
        stats.seconds += job.seconds + time.perf_counter() - start
        return job.mask

    def forget_pending(self) -> None:
        """The steps in flight were discarded: their masks are never sent."""
        filling, self._filling = self._filling, None
        if filling is not None:  # its matchers are let be before the rollbacks below
            wait([filling])
        self.pending.clear()
        self._constrained.clear()
        self._settle()

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
        if self._filler is not None:
            self._filler.shutdown(wait=True)
        if self._starter is not None:
            self._starter.shutdown(wait=False, cancel_futures=True)
        if self._built():
            self._compiler.result().shutdown()

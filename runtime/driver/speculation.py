"""`Speculation`: the driver's side of speculative decoding (`speculative_config`).

Each step, a running sequence that decodes and may speculate verifies up to
`num_speculative_tokens` (k) draft tokens: the scheduler asks `drafts(seq, room)` for them and
schedules them as extra query rows after the sequence's last token, from the method's proposer
(runtime/driver/proposers.py). The n-gram proposer runs on the driver, on the sequence's own
tokens; a draft model runs on the workers within the step, so its rows go out
as `DRAFT_TOKEN` and the worker fills them in; the MTP layers run on the workers after a step's
tokens are sampled, and the step's result brings each sequence's drafts for its next step
(`StepResult.draft_token_ids`, kept on the sequence). The workers return how many drafts each sequence
accepted (`StepResult.num_accepted`); the scheduler then rolls the rejected rows' KV back (their
slots are rewritten by the next step) and appends the accepted tokens one by one under the stop
rules. `observe` counts drafts and acceptances per position (`SpecDecodeStats`, on `EngineStats`).

- A sequence speculates unless its sampling reads its history or returns logprobs (penalties,
  bad words of several tokens, `logprobs`): those decode one row per step. `logit_bias`,
  `allowed_token_ids` and one-token bad words apply to every verify row.
- A structured-output sequence's n-gram proposal is cut at its first token the grammar refuses
  (padded, where verify steps must be uniform, with tokens it allows); each verify row gets the
  mask of the grammar advanced through the drafts before it (runtime/driver/structured_outputs.py).
  With a draft model it decodes without drafts: the driver cannot check drafts it never sees.
- With request graphs recorded for verify steps (FULL), an n-gram proposal shorter than k is padded
  to k: a uniform batch replays its graph, where a ragged one would run eagerly; a padding token is
  verified like any draft (the target decides; correctness does not depend on what is proposed).
- Under async scheduling the scheduler waits for the step in flight before it schedules the next:
  how many drafts a verify step accepts decides where each sequence's next rows start. A verify
  step therefore costs a synchronous step, which can outweigh the tokens it gains (a small model,
  a workload whose drafts are seldom accepted). With n-gram drafts `SpecPolicy` measures both and
  speculates only while it pays: between phases of speculation, steps without drafts run ahead as
  plain async steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

from atomrt.distributed.messages import StepResult
from atomrt.runtime.config import Config, SpeculativeConfig
from atomrt.runtime.driver.proposers import make_proposer

if TYPE_CHECKING:
    from atomrt.runtime.driver.scheduler import SchedulerOutput
    from atomrt.runtime.driver.sequence import Sequence

logger = logging.getLogger(__name__)

LOG_PERIOD_S = 10.0  # how often the acceptance figures are logged while speculating


@dataclass
class SpecDecodeStats:
    """Counters since start. A *draft* is one sequence's verify step; its k_s draft tokens are
    judged in order, and position i is accepted when the first i + 1 are."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]
    num_eager_draft_passes: int = 0  # drafter passes that ran eagerly with graphs on
    draft_seconds: float = 0.0  # device time of the drafters' passes (TP rank 0 of each DP rank)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step emits per sequence: 1 + accepted drafts (1.0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / max(self.num_drafts, 1)

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / max(self.num_drafts, 1) for a in self.accepted_per_position]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    def summary(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.acceptance_rate_per_position)
        return (
            f"mean acceptance length {self.mean_acceptance_length:.2f}, per-position acceptance "
            f"[{rates}], drafted {self.num_draft_tokens}, accepted {self.num_accepted_tokens}"
        )


@dataclass
class PhaseTotals:
    """SpecPolicy's finished phases of one kind: their results (the switch's included), and the
    tokens (per sequence) and seconds their rates counted."""

    phases: int = 0
    results: int = 0
    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, results: int, tokens: float, seconds: float) -> None:
        self.phases += 1
        self.results += results
        self.tokens += tokens
        self.seconds += seconds


class SpecPolicy:
    """When to speculate under async scheduling: phases of speculating steps and of plain (async)
    steps alternate, and each phase's output tokens per second per sequence (each step result's
    tokens over the sequences that emitted them, summed over the results that arrive in the phase,
    over the wall time between them) decide the next two lengths: a phase that runs while
    requests finish or join is weighed by what each sequence gained, not by how many ran. While
    speculation emits more per second, its phases are long and the plain ones short probes;
    while it emits less, speculation is a short probe and the plain phases double, to
    `MAX_PLAIN` steps. A long speculating phase ends early once `PROBE` counted results of it
    emit less per second than the last plain phase did (the workload changed under it). Starts
    with a speculating phase. The first `SWITCH` results of a phase carry the switch (a plain
    phase starts with no step in flight, a speculating one waits for the plain step in flight)
    and are left out of its rate: a short probe would otherwise bear a cost that the winning mode
    pays once per long phase, and lose to it for that alone."""

    PROBE = 8  # steps in a probing phase
    LONG = 64  # steps in a winning phase
    MAX_PLAIN = 256
    SWITCH = 2  # results at the start of a phase that its rate leaves out
    IDLE_S = 1.0  # a longer gap between two results is the engine idling, not a step

    def __init__(self) -> None:
        self.speculating = True
        self.spec_len, self.plain_len = self.PROBE, self.PROBE
        self.left = self.spec_len  # results left in this phase
        self.seen = 0  # results of this phase so far
        self.tokens, self.seconds = 0.0, 0.0  # this phase's counted ones (tokens per sequence)
        self.last: Optional[float] = None  # the previous result's time
        self.spec_rate: Optional[float] = None  # tokens/s per sequence, last phase of each kind
        self.plain_rate: Optional[float] = None
        # every finished phase's counted figures, per kind (True: speculating): what the rates
        # were made of, for benchmarks to read
        self.totals = {kind: PhaseTotals() for kind in (True, False)}

    def step_done(self, num_tokens: float, now: float) -> None:
        """A step's results arrived at `now` (perf_counter seconds), emitting `num_tokens` per
        sequence."""
        self.seen += 1
        if self.seen > self.SWITCH:
            self.tokens += num_tokens
            if self.last is not None and now - self.last < self.IDLE_S:
                self.seconds += now - self.last
        self.last = now
        self.left -= 1
        if self.left > 0 and not self._losing_long_phase():
            return
        rate = self.tokens / self.seconds if self.seconds > 0 else None
        self.totals[self.speculating].add(self.seen, self.tokens, self.seconds)
        if self.speculating:
            self.spec_rate = rate
        else:
            self.plain_rate = rate
            self._decide()
        self.speculating = not self.speculating
        self.left = self.spec_len if self.speculating else self.plain_len
        self.seen, self.tokens, self.seconds = 0, 0.0, 0.0

    def _losing_long_phase(self) -> bool:
        """A long speculating phase whose counted results so far run slower than plain steps."""
        if not self.speculating or self.spec_len <= self.PROBE or self.plain_rate is None:
            return False
        if self.seen < self.SWITCH + self.PROBE or self.seconds <= 0:
            return False
        return self.tokens / self.seconds < self.plain_rate

    def _decide(self) -> None:
        """After a cycle (a speculating phase, then a plain one): the next cycle's lengths."""
        if self.spec_rate is None or self.plain_rate is None:
            return
        if self.spec_rate > self.plain_rate:
            self.spec_len, self.plain_len = self.LONG, self.PROBE
        else:
            self.spec_len = self.PROBE
            self.plain_len = min(2 * self.plain_len, self.MAX_PLAIN)


def speculates(seq: Sequence) -> bool:
    """Whether a sequence's rows may verify drafts (penalties, logprobs and bad words of several
    tokens, which read the output before each row, keep it one row a step)."""
    p = seq.sampling_params
    return (
        p.logprobs is None
        and not p.has_penalties
        and all(len(w) == 1 for w in seq.bad_words_token_ids)
    )


class Speculation:
    def __init__(
        self, config: SpeculativeConfig, pad: bool = False, async_scheduling: bool = False
    ) -> None:
        """`pad`: pad n-gram proposals to k (request graphs serve only uniform verify steps);
        `async_scheduling`: with n-gram drafts and `config.adaptive`, a SpecPolicy decides which
        steps speculate."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = make_proposer(config, pad)
        self.pad = pad
        # capture records plain buckets for it too (the same `may_pause`: Config.capture_q_lens)
        self.policy: Optional[SpecPolicy] = None
        if config.may_pause(async_scheduling):
            self.policy = SpecPolicy()
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.k)
        self._last_log = time.monotonic()

    def wants_drafts(self) -> bool:
        """Whether the next step proposes drafts: always without a policy, else when the policy
        says so. While it does not, the scheduler may run steps ahead as async scheduling does
        (a seeded request's tokens do not depend on which of its steps verify drafts: see
        workers/spec_decode/rejection_sampler.py)."""
        return self.policy is None or self.policy.speculating

    def step_done(self, num_tokens: int, num_seqs: int) -> None:
        """One step's results are in (every DP rank's): `num_seqs` sequences emitted
        `num_tokens` tokens."""
        if self.policy is not None:
            was = self.policy.speculating
            per_seq = num_tokens / num_seqs if num_seqs else 0.0
            self.policy.step_done(per_seq, time.perf_counter())
            if was != self.policy.speculating and logger.isEnabledFor(logging.DEBUG):
                p = self.policy
                logger.debug(
                    "speculative decoding %s (tokens/s per sequence speculating %s, plain %s)",
                    "resumes" if p.speculating else "pauses",
                    f"{p.spec_rate:.1f}" if p.spec_rate else "-",
                    f"{p.plain_rate:.1f}" if p.plain_rate else "-",
                )

    def drafts(self, seq: Sequence, room: int) -> list[int]:
        """The draft tokens `seq` verifies this step (one that `wants_drafts`), at most
        `min(k, room)`; [] when it does not speculate. `room`: how many rows past its last token
        fit (budget, max_model_len)."""
        n = min(self.k, room)
        if n <= 0 or not speculates(seq) or seq.num_pending:
            return []
        return self.proposer.propose(seq, n)

    def observe(self, out: SchedulerOutput, res: StepResult) -> None:
        """Count one step's drafts and acceptances (and log them every LOG_PERIOD_S); hand the
        result to the proposer (before `Scheduler.postprocess` appends the step's tokens: MTP
        drafts follow them)."""
        stats = self.stats
        stats.num_eager_draft_passes += res.num_eager_draft_passes
        stats.draft_seconds += res.draft_seconds
        if not len(res.num_accepted):
            return
        accepted = dict(zip(res.seq_ids.tolist(), res.num_accepted.tolist()))
        self.proposer.after_step(out, res, accepted)
        for row in out.scheduled:
            k_s = row.num_draft_tokens
            if not k_s or row.seq.seq_id not in accepted:
                continue
            a = accepted[row.seq.seq_id]
            stats.num_drafts += 1
            stats.num_draft_tokens += k_s
            stats.num_accepted_tokens += a
            for i in range(a):
                stats.accepted_per_position[i] += 1
        now = time.monotonic()
        if now - self._last_log >= LOG_PERIOD_S and stats.num_drafts:
            self._last_log = now
            logger.info("speculative decoding: %s", stats.summary())


def make_speculation(
    config: Config, req_keys: tuple[tuple[int, int], ...]
) -> Optional[Speculation]:
    """The driver's Speculation, or None without `speculative_config`. `req_keys`: the request
    graphs the workers recorded (n-gram proposals are padded when verify steps replay them)."""
    spec = config.speculative_config
    if spec is None:
        return None
    pad = any(d == spec.num_speculative_tokens for _, d in req_keys)
    return Speculation(spec, pad=pad, async_scheduling=config.scheduler_config.async_scheduling)


def sampled_tokens(res: StepResult) -> dict[int, Union[int, list[int]]]:
    """seq_id -> its token, or (speculative decoding) its tokens in order."""
    seq_ids, first = res.seq_ids.tolist(), res.sampled_token_ids.tolist()
    if not len(res.num_accepted):
        return dict(zip(seq_ids, first))
    more, out, at = res.more_token_ids.tolist(), {}, 0
    for seq_id, token, n in zip(seq_ids, first, res.num_accepted.tolist()):
        out[seq_id] = [token, *more[at : at + n]]
        at += n
    return out

"""`Speculation`: the driver's side of speculative decoding (`speculative_config`).

Each step, a running sequence that decodes and may speculate verifies up to
`num_speculative_tokens` (k) draft tokens: the scheduler asks `drafts(seq, room)` for them and
schedules them as extra query rows after the sequence's last token. The n-gram proposer runs here,
on the sequence's own tokens; a draft model runs on the workers within the step, so its rows go out
as `DRAFT_TOKEN` and the worker fills them in. The workers return how many drafts each sequence
accepted (`StepResult.num_accepted`); the scheduler then rolls the rejected rows' KV back (their
slots are rewritten by the next step) and appends the accepted tokens one by one under the stop
rules. `observe` counts drafts and acceptances per position (`SpecDecodeStats`, on `EngineStats`).

- A sequence speculates unless its sampling reads its history or returns logprobs (penalties,
  `logprobs`): those decode one row per step.
- With request graphs recorded for verify steps (FULL), an n-gram proposal shorter than k is padded
  to k: a uniform batch replays its graph, where a ragged one would run eagerly; a padding token is
  verified like any draft (the target decides; correctness does not depend on what is proposed).
- Under async scheduling the scheduler waits for the step in flight before it schedules the next:
  how many drafts a verify step accepts decides where each sequence's next rows start.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from atomrt.distributed.messages import DRAFT_TOKEN, StepResult
from atomrt.runtime.config import Config, ConfigError, SpeculativeConfig
from atomrt.workers.loading.loader import read_arch
from atomrt.workers.spec_decode.draft_model import draft_config
from atomrt.workers.spec_decode.ngram import ngram_propose

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
    num_eager_draft_passes: int = 0  # draft-model passes that ran eagerly with graphs on

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


def speculates(seq: Sequence) -> bool:
    """Whether a sequence's rows may verify drafts (penalties and logprobs keep it one row a step)."""
    p = seq.sampling_params
    return p.logprobs is None and not p.has_penalties


class Speculation:
    def __init__(self, config: SpeculativeConfig, pad: bool = False) -> None:
        """`pad`: pad n-gram proposals to k (request graphs serve only uniform verify steps)."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.is_ngram = config.method == "ngram"
        self.pad = pad
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.k)
        self._last_log = time.monotonic()

    def drafts(self, seq: Sequence, room: int) -> list[int]:
        """The draft tokens `seq` verifies this step, at most `min(k, room)`; [] when it does not
        speculate. `room`: how many rows past its last token fit (budget, max_model_len)."""
        n = min(self.k, room)
        if n <= 0 or not speculates(seq):
            return []
        if not self.is_ngram:
            return [DRAFT_TOKEN] * n
        c = self.config
        proposal = ngram_propose(seq.token_ids, n, c.prompt_lookup_min, c.prompt_lookup_max)
        if self.pad and len(proposal) < n:
            proposal += [proposal[-1] if proposal else seq.token_ids[-1]] * (n - len(proposal))
        return proposal

    def observe(self, out: SchedulerOutput, res: StepResult) -> None:
        """Count one step's drafts and acceptances (and log them every LOG_PERIOD_S)."""
        stats = self.stats
        stats.num_eager_draft_passes += res.num_eager_draft_passes
        if not len(res.num_accepted):
            return
        accepted = dict(zip(res.seq_ids.tolist(), res.num_accepted.tolist()))
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
    return Speculation(spec, pad=pad)


def check_draft_model(config: Config, arch: Any) -> None:
    """The draft model must exist, share the target's vocabulary and cover its context (checked
    before launch)."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return
    try:
        draft = read_arch(draft_config(config))
    except ValueError as e:
        raise ConfigError(f"speculative_config.model: {e}") from None
    if draft.vocab_size != arch.vocab_size:
        raise ConfigError(
            f"speculative_config.model: the draft model's vocabulary ({draft.vocab_size} tokens) "
            f"differs from the target's ({arch.vocab_size}); a draft model must share it"
        )
    max_len = config.model_config.max_model_len or arch.max_position
    if draft.max_position < max_len:
        raise ConfigError(
            f"speculative_config.model: the draft model's context ({draft.max_position} tokens) "
            f"is shorter than the engine's ({max_len}); lower model_config.max_model_len"
        )


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

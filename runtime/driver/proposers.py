"""The driver's half of each speculative method, one class per method: the drafts a sequence
verifies this step, what a step's result leaves for the next, and whether the model can serve it.
Each subclasses its method's class in runtime/config.py (`SpecMethod`: the fields it takes, its
lookahead, what the block manager and the planner must do for it), so the engine asks one object
what configuration asked before. `make_proposer` builds the one `speculative_config.method`
names, from `PROPOSERS`; the worker's half of each lives in workers/spec_decode/.

- `NgramProposer`: prompt lookup on the sequence's own tokens, here on the driver.
- `DraftModelProposer`: a draft model on the workers proposes within the step, so its rows go out
  as `DRAFT_TOKEN` and the worker fills them in.
- `MTPProposer`: the target's MTP layers run on the workers after a step's tokens are sampled; the
  step's result brings each sequence's drafts for its next step, kept on the sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from atomrt.distributed.messages import DRAFT_TOKEN, StepResult
from atomrt.runtime.config import (
    Config,
    ConfigError,
    DraftModelMethod,
    MTPMethod,
    NgramMethod,
    SpecMethod,
    SpeculativeConfig,
)
from atomrt.workers.loading.loader import read_arch
from atomrt.workers.spec_decode.draft_model import draft_config
from atomrt.workers.spec_decode.ngram import ngram_propose

if TYPE_CHECKING:
    from atomrt.runtime.driver.scheduler import SchedulerOutput
    from atomrt.runtime.driver.sequence import Sequence


class Proposer(SpecMethod):
    """One speculative method's driver half; its flags are its `SpecMethod`'s."""

    def __init__(self, config: SpeculativeConfig, pad: bool = False) -> None:
        """`pad`: pad proposals to k where the method can (request graphs serve only uniform
        verify steps)."""
        self.config = config
        self.pad = pad

    @classmethod
    def check(cls, config: Config, arch: Any) -> None:
        """Raise ConfigError where the model cannot serve this method (checked before launch)."""

    def propose(self, seq: Sequence, n: int) -> list[int]:
        """At most `n` (> 0) drafts for a sequence that speculates this step."""
        raise NotImplementedError

    def after_step(self, out: SchedulerOutput, res: StepResult, accepted: dict[int, int]) -> None:
        """A step's result is in, before its tokens are appended; `accepted`: seq_id -> how many
        of its drafts were accepted."""


class NgramProposer(NgramMethod, Proposer):
    def propose(self, seq: Sequence, n: int) -> list[int]:
        c = self.config
        proposal = ngram_propose(seq.token_ids, n, c.prompt_lookup_min, c.prompt_lookup_max)
        if seq.grammar is not None:  # cut at the first draft its grammar refuses
            return seq.grammar.valid_drafts(proposal, pad_to=n if self.pad else 0)
        if self.pad and len(proposal) < n:
            proposal += [proposal[-1] if proposal else seq.token_ids[-1]] * (n - len(proposal))
        return proposal


class DraftModelProposer(DraftModelMethod, Proposer):
    @classmethod
    def check(cls, config: Config, arch: Any) -> None:
        """The draft model must exist, share the target's vocabulary and cover its context."""
        try:
            draft = read_arch(draft_config(config))
        except ValueError as e:
            raise ConfigError(f"speculative_config.model: {e}") from None
        if draft.vocab_size != arch.vocab_size:
            raise ConfigError(
                f"speculative_config.model: the draft model's vocabulary ({draft.vocab_size} "
                f"tokens) differs from the target's ({arch.vocab_size}); a draft model must share it"
            )
        max_len = config.model_config.max_model_len or arch.max_position
        if draft.max_position < max_len:
            raise ConfigError(
                f"speculative_config.model: the draft model's context ({draft.max_position} "
                f"tokens) is shorter than the engine's ({max_len}); lower "
                "model_config.max_model_len"
            )

    def propose(self, seq: Sequence, n: int) -> list[int]:
        # a constrained sequence's verify rows need its drafts' masks, which the driver never sees
        return [DRAFT_TOKEN] * n if seq.grammar is None else []


class MTPProposer(MTPMethod, Proposer):
    @classmethod
    def check(cls, config: Config, arch: Any) -> None:
        """MTP drafting needs a DeepSeek-family model whose checkpoint has MTP layers."""
        if not (arch.is_mla or arch.v4 is not None) or arch.num_nextn_predict_layers < 1:
            raise ConfigError(
                f"speculative_config.method 'mtp': {config.model} has no multi-token-prediction "
                f"layers (architecture {arch.architecture}, num_nextn_predict_layers "
                f"{arch.num_nextn_predict_layers}); use 'ngram' or 'draft_model'"
            )

    def propose(self, seq: Sequence, n: int) -> list[int]:
        # what the workers proposed after its last token, if it still ends there
        proposal = seq.proposed_drafts[:n] if seq.proposed_at == seq.num_tokens else []
        if seq.grammar is not None:  # cut at the first draft its grammar refuses
            return seq.grammar.valid_drafts(proposal, pad_to=0)
        return proposal

    def after_step(self, out: SchedulerOutput, res: StepResult, accepted: dict[int, int]) -> None:
        """Each sampled sequence's k drafts, valid once its 1 + accepted tokens are appended."""
        if not len(res.draft_token_ids):
            return
        drafts = res.draft_token_ids.reshape(-1, self.config.num_speculative_tokens).tolist()
        at = {s: i for i, s in enumerate(res.seq_ids.tolist())}
        for row in out.scheduled:
            i = at.get(row.seq.seq_id)
            if i is None or not row.is_sampled:
                continue
            seq = row.seq
            seq.proposed_drafts = drafts[i]
            seq.proposed_at = seq.num_tokens + 1 + accepted[seq.seq_id]


PROPOSERS: dict[str, type[Proposer]] = {
    cls.method: cls for cls in (NgramProposer, DraftModelProposer, MTPProposer)
}


def make_proposer(config: SpeculativeConfig, pad: bool = False) -> Proposer:
    """The driver half of `config.method` (validated by SpeculativeConfig)."""
    return PROPOSERS[config.method](config, pad)


def check_speculation(config: Config, arch: Any) -> None:
    """Whether the model can serve `speculative_config`'s method (before launch); none: nothing."""
    spec = config.speculative_config
    if spec is not None:
        PROPOSERS[spec.method].check(config, arch)

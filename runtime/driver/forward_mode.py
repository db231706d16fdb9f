# Hot path (driver, once per step): only the graph/eager/bucket decision lives here -- pure
# arithmetic over the DP ranks' batch shapes and the buckets capture recorded. No torch, no I/O.
"""`ForwardMode`: the one owner of the step's graph / eager / bucket decision, on the driver.

`ForwardMode(config, captured).decide(batches)` looks at every DP rank's batch at once and returns
one frozen `ForwardDecision` that every rank follows, so the ranks' collectives match:

- `enforce_eager`, or mode NONE: eager.
- A step is *decode* when every rank with work is pure decode, each sequence running
  `1 + draft` query rows (`max_seqlen_q == 1 + draft`, `num_tokens == num_seqs * (1 + draft)`);
  otherwise it is a *prefill* step (prefill or mixed on any rank). `draft` is the speculative
  width, or 0 for a step without drafts where capture records plain decode buckets beside the
  verify ones (`config.capture_q_lens`: adaptive n-gram speculation under async scheduling).
- FULL: a decode step replays the request graph at the smallest recorded bucket
  `(running_bs, draft)` with `running_bs >=` the group's largest `num_seqs`; prefill and mixed steps,
  and decode steps beyond the recorded ladder, run eagerly.
- FULL_DECODE_ONLY: FULL for decode, eager for prefill / mixed.
- TR_HYBRID, and FULL_AND_TR_HYBRID (recorded and run exactly as TR_HYBRID): the step replays the
  token graph at the smallest token bucket recorded for its phase that holds the group's largest
  `num_tokens`; none holds it: eager. A decode step whose bucket is a request bucket joined as a
  whole step (`captured.token_req_keys`) also gets that `req_key`: it is staged as the request
  bucket's (graph-safe metadata) and runs as one launch, as a request graph does.
- If one rank must run eagerly, every rank does. Every rank gets the same bucket; a rank with no
  work (`num_seqs == 0`) runs a dummy batch of the decision's shape (`dummy_batch`).
- Two-batch overlap (`parallel_config.enable_tbo`): `UbatchPolicy` (ubatch_policy.py) splits the
  decision into two microbatches, the same split on every rank (`ubatch_split_bs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

from atomrt.graphs.buckets import bucket_for
from atomrt.runtime.config import Config, CUDAGraphMode
from atomrt.runtime.decision import BatchShape, CapturedBuckets, ForwardDecision, ForwardKind
from atomrt.runtime.driver.ubatch_policy import UbatchPolicy


class ForwardMode:
    """Decides, once per step on the driver, how every DP rank runs the step (see the module docstring)."""

    def __init__(
        self, config: Config, captured: CapturedBuckets, num_draft_tokens: int = 0
    ) -> None:
        assert num_draft_tokens >= 0
        self.mode: CUDAGraphMode = config.cudagraph_mode or CUDAGraphMode.NONE
        self.enforce_eager = bool(config.enforce_eager) or self.mode == CUDAGraphMode.NONE
        self.tr_hybrid = self.mode.uses_tr_hybrid()  # FULL_AND_TR_HYBRID runs as TR_HYBRID
        self.captured = captured
        self._token_req_keys = frozenset(captured.token_req_keys)
        self.draft_num = num_draft_tokens
        # a step without drafts is a plain decode step where capture records plain buckets too
        self.plain_decode = num_draft_tokens > 0 and 1 in config.capture_q_lens
        self.ubatch = UbatchPolicy(config.parallel_config.enable_tbo, captured)
        # The decision is a pure function of the shapes: a steady decode repeats the last one.
        self._last: tuple[tuple[tuple[BatchShape, ...], bool], Optional[ForwardDecision]] = (
            ((), False),
            None,
        )

    def decide(self, batches: Sequence[BatchShape], eager: bool = False) -> ForwardDecision:
        """`eager`: the step runs eagerly whatever capture recorded (a probed step: its probe
        reads it in Python, workers/probes.py)."""
        key = (tuple(batches), eager)
        last_key, last_decision = self._last
        if key == last_key:
            return last_decision
        decision = self._decide(*key)
        self._last = (key, decision)
        return decision

    @property
    def last_decision(self) -> Optional[ForwardDecision]:
        """The decision of the last step decided (None before the first)."""
        return self._last[1]

    @property
    def ubatch_split_bs(self) -> Optional[int]:
        """The last decided step's TBO split: the requests of its first microbatch (decode)."""
        decision = self._last[1]
        return decision.ubatch_split_bs if decision is not None else None

    def _decide(self, batches: tuple[BatchShape, ...], eager: bool) -> ForwardDecision:
        assert batches, "decide needs one BatchShape per DP rank"
        for b in batches:
            assert b.num_seqs >= 0 and b.num_tokens >= b.num_seqs, f"bad batch shape {b}"
        busy = [b for b in batches if b.num_seqs > 0]
        dp_num_tokens = tuple(b.num_tokens for b in batches)
        max_seqs = max((b.num_seqs for b in busy), default=0)
        max_tokens = max(dp_num_tokens)
        draft = self.draft_num
        if self.plain_decode and busy and all(b.max_seqlen_q == 1 for b in busy):
            draft = 0
        is_decode = bool(busy) and all(self._is_decode(b, draft) for b in busy)
        decision = None
        if busy and not self.enforce_eager and not eager:
            if self.tr_hybrid:
                decision = self._pad_to_token_graph(is_decode, max_seqs, max_tokens, draft)
            elif is_decode and self.mode.decode_mode() == CUDAGraphMode.FULL:
                decision = self._pad_to_req_graph(max_seqs, draft)
        if decision is None:
            is_prefill = not is_decode and bool(busy)
            decision = self._eager(is_prefill, max_seqs, max_tokens, draft)
        if busy and self.ubatch.enabled:
            decision = self.ubatch.apply(decision, busy, max_seqs, max_tokens)
        return _with_dp(decision, dp_num_tokens)

    @staticmethod
    def _is_decode(b: BatchShape, draft: int) -> bool:
        q = 1 + draft
        return not b.is_prefill and b.max_seqlen_q == q and b.num_tokens == b.num_seqs * q

    def _pad_to_req_graph(self, max_seqs: int, draft: int) -> Optional[ForwardDecision]:
        bs = bucket_for(max_seqs, self.captured.req_batch_sizes(draft))
        if bs is None:
            return None
        return ForwardDecision(
            kind=ForwardKind.REQ_GRAPH,
            running_bs=bs,
            running_tokens=bs * (1 + draft),
            is_prefill=False,
            draft_num=draft,
            req_key=(bs, draft),
        )

    def _pad_to_token_graph(
        self, is_decode: bool, max_seqs: int, max_tokens: int, draft: int
    ) -> Optional[ForwardDecision]:
        bucket = bucket_for(max_tokens, self.captured.token_sizes(not is_decode))
        if bucket is None:
            return None
        req_key = None
        if is_decode and bucket % (1 + draft) == 0:
            key = (bucket // (1 + draft), draft)
            req_key = key if key in self._token_req_keys else None
        return ForwardDecision(
            kind=ForwardKind.TOKEN_GRAPH,
            running_bs=bucket // (1 + draft) if is_decode else max_seqs,
            running_tokens=bucket,
            is_prefill=not is_decode,
            draft_num=draft,
            req_key=req_key,
            token_bucket=bucket,
        )

    @staticmethod
    def _eager(is_prefill: bool, max_seqs: int, max_tokens: int, draft: int) -> ForwardDecision:
        # One rank runs its real rows; DP ranks step in lockstep, padded to the group's largest count.
        return ForwardDecision(
            kind=ForwardKind.EAGER,
            running_bs=max_seqs,
            running_tokens=max_tokens,
            is_prefill=is_prefill,
            draft_num=draft,
        )


def _with_dp(d: ForwardDecision, dp_num_tokens: tuple[int, ...]) -> ForwardDecision:
    return replace(
        d, dp_num_tokens=dp_num_tokens, dp_padded_tokens=(d.running_tokens,) * len(dp_num_tokens)
    )

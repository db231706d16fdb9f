"""The n-gram proposer (prompt lookup): find the sequence's last n tokens earlier in its own history
and propose the tokens that followed them there.

`ngram_propose` is pure numpy over one sequence's token ids; the driver calls it once per
speculating sequence per step, so it must stay cheap: one vectorised comparison over the history,
then work on the places the last token occurred before. The drafts come to the workers in the plan:
the method's worker half (`NgramWorkerProposer`) has nothing to do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from atomrt.workers.spec_decode.proposer import WorkerProposer


def ngram_propose(
    token_ids: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int
) -> list[int]:
    """Up to `k` draft tokens for `token_ids` (prompt + output): the longest suffix of `min_n` to
    `max_n` tokens that also occurs earlier, at its most recent earlier occurrence, and the tokens
    that followed it there. An empty list when no suffix recurs.

    One comparison over the history finds where the last token occurred before (each such place
    ends a candidate match); the match lengths then grow backwards over the candidates only."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    num_tokens = tokens.shape[0]
    longest = min(max_n, num_tokens - 1)
    if longest < max(min_n, 1):
        return []
    ends = np.flatnonzero(tokens[: num_tokens - 1] == tokens[num_tokens - 1])
    if not ends.size:
        return []
    length = np.ones(ends.shape[0], dtype=np.int64)  # each candidate's match so far
    alive = np.ones(ends.shape[0], dtype=bool)
    for j in range(1, longest):  # does the match ending at `end` reach back j more tokens?
        at = ends - j
        alive &= at >= 0
        alive[alive] = tokens[at[alive]] == tokens[num_tokens - 1 - j]
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < min_n:
        return []
    start = int(ends[np.flatnonzero(length == best)[-1]]) + 1
    return tokens[start : start + k].tolist()


class NgramWorkerProposer(WorkerProposer):
    """Method "ngram" on the worker: the draft rows' ids are the plan's (every hook a no-op)."""

    method = "ngram"

"""The n-gram proposer (prompt lookup): find the sequence's last n tokens earlier in its own history
and propose the tokens that followed them there.

Pure numpy over one sequence's token ids; the driver calls it once per speculating sequence per
step, so it must stay cheap: one vectorised window comparison per n-gram length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_propose(
    token_ids: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int
) -> list[int]:
    """Up to `k` draft tokens for `token_ids` (prompt + output): the longest suffix of `min_n` to
    `max_n` tokens that also occurs earlier, at its most recent earlier occurrence, and the tokens
    that followed it there. An empty list when no suffix recurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    num_tokens = tokens.shape[0]
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = tokens[num_tokens - n :]
        # Windows starting before the suffix's own start, each followed by at least one token.
        windows = sliding_window_view(tokens[: num_tokens - 1], n)  # [num_tokens - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []

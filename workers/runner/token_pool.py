"""Async scheduling's token state, in one place.

Under async scheduling a sequence sampled in step N decodes in step N+1 before its token is back on
the host: the plan ships `PENDING_TOKEN` for that row, and the worker takes the token on the device
from its own step-N sample. `TokenPool` holds what that needs: the device pool rows read their
input ids from, `[the step's staged ids | the previous step's samples]`, and, on the host, which
row of the previous step's sample each sequence's token is (`prev_rows`).
"""

from __future__ import annotations

import numpy as np
import torch

from atomrt.distributed.communication_op import TPInfo, tp_broadcast


class TokenPool:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, device: torch.device) -> None:
        self.pool = torch.zeros(max_num_tokens + max_num_seqs, dtype=torch.int64, device=device)
        self.staged_ids = self.pool[:max_num_tokens]  # [max_num_tokens]: the step's own ids
        self.prev_tokens = self.pool[max_num_tokens:]  # [max_num_seqs]: the previous step's samples
        self.prev_base = max_num_tokens  # a row's source index from here on names a previous sample
        self.own_rows = np.arange(max_num_tokens, dtype=np.int64)  # every row's token is staged
        self.prev_rows: dict[int, int] = {}  # seq_id -> its row in the previous step's sample

    def record(self, sampled_seq_ids: list[int]) -> None:
        """The step just launched samples these sequences, in this order (an empty list: none)."""
        self.prev_rows = {s: j for j, s in enumerate(sampled_seq_ids)}

    def keep(self, tokens: torch.Tensor, all_greedy: bool, tp: TPInfo) -> None:
        """The step's sampled tokens become the next step's pending inputs. Every TP rank must feed
        the same ones: unless sampling was plain greedy (an argmax of the same logits), TP rank 0's
        are broadcast."""
        if not all_greedy:
            tp_broadcast(tokens, tp)
        self.prev_tokens[: tokens.shape[0]].copy_(tokens)

"""Async scheduling's token state, in one place.

Under async scheduling a sequence sampled in step N decodes in step N+1 before its token is back on
the host: the plan ships `PENDING_TOKEN` for that row, and the worker takes the token on the device
from its own step-N sample. `TokenPool` holds what that needs: the device pool rows read their
input ids from, `[the step's staged ids | the previous step's samples]`, and, on the host, which
row of the previous step's sample each sequence's token is (`prev_rows`).

With speculative decoding the pool has a third part, one entry per row of a step: a draft model
writes its proposal for a draft row there (`draft_tokens`), and the row reads it like a pending
token. Its size also lets a verify step's request graph write every row's argmax after the previous
samples (`prev_tokens` spans both parts).
"""

from __future__ import annotations

import numpy as np
import torch

from atomrt.distributed.communication_op import TPInfo, tp_broadcast


class TokenPool:
    def __init__(
        self, max_num_tokens: int, max_num_seqs: int, device: torch.device, drafts: bool = False
    ) -> None:
        """`drafts`: keep a part for draft tokens (speculative decoding), one entry per row."""
        num_drafts = max_num_tokens if drafts else 0
        size = max_num_tokens + max_num_seqs + num_drafts
        self.pool = torch.zeros(size, dtype=torch.int64, device=device)
        self.staged_ids = self.pool[:max_num_tokens]  # [max_num_tokens]: the step's own ids
        # [max_num_seqs (+ max_num_tokens)]: the previous step's samples (then the drafts)
        self.prev_tokens = self.pool[max_num_tokens:]
        self.prev_base = max_num_tokens  # a row's source index from here on names a previous sample
        self.draft_base = max_num_tokens + max_num_seqs  # row r's draft is at draft_base + r
        self.draft_tokens = self.pool[self.draft_base :]  # [max_num_tokens or 0]
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

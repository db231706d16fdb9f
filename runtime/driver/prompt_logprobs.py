"""Prompt logprobs on the driver: the workers' `PromptLogprobs` rows become each sequence's
`prompt_logprobs`, the shape vLLM users know: one entry per prompt token, the first None (nothing
precedes it), then `{token id: Logprob(logprob, rank, decoded_token)}` holding the prompt token
and the top `prompt_logprobs` alternatives.

A request that asks for them bypasses the prefix cache (runtime/driver/block_manager.py): every
prompt position is computed, so every position is scored; its blocks are still registered for
later requests. A sequence preempted part-way through its prompt recomputes it; the positions it
already holds are kept, the recomputed ones dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from atomrt.distributed.messages import PromptLogprobs
from atomrt.runtime.driver.sequence import Sequence


@dataclass
class Logprob:
    """One token's entry in a logprobs dict (vLLM's `Logprob`)."""

    logprob: float
    rank: Optional[int] = None  # 1 = the most likely token
    decoded_token: Optional[str] = None


PromptLogprobsList = list[Optional[dict[int, Logprob]]]


def apply_prompt_logprobs(
    result: Optional[PromptLogprobs], starts: dict[int, tuple[Sequence, int]], tokenizer: Any
) -> None:
    """Append a step's prompt logprobs to their sequences. `starts`: seq_id -> (the sequence, the
    position of its first row in that step); the worker's i-th entry for a sequence scores prompt
    token start + i + 1."""
    if result is None:
        return
    ranks = result.token_ranks.tolist()
    token_lps = result.token_logprobs.tolist()
    top_ids = result.top_token_ids.tolist()
    top_lps = result.top_logprobs.tolist()
    row = 0
    for seq_id, count in zip(result.seq_ids.tolist(), result.num_positions.tolist()):
        lo, row = row, row + count
        entry = starts.get(seq_id)
        if entry is None:
            continue
        seq, start = entry
        held = seq.prompt_logprobs
        if held is None or seq.is_finished:
            continue
        k = seq.sampling_params.prompt_logprobs
        prompt = seq.prompt_token_ids
        for i in range(lo, row):
            position = start + 1 + i - lo
            if position != len(held):  # scored before a preemption: keep the first
                continue
            token = prompt[position]
            ids, lps = top_ids[i][:k], top_lps[i][:k]
            scores = {t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(zip(ids, lps))}
            scores[token] = Logprob(token_lps[i], ranks[i])
            if tokenizer is not None:
                for t, lp in scores.items():
                    lp.decoded_token = tokenizer.decode([t], skip_special_tokens=False)
            held.append(scores)

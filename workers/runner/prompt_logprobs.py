# Hot path (worker, steps with prompt rows of a request that asked for prompt logprobs): logits
# and log-softmax over those rows alone. What may live here: that computation.
"""Prompt logprobs (`SamplingParams.prompt_logprobs`): from the hidden states of a step's prompt
rows, the model's raw log-softmax (no temperature, penalties or additions: the model's own
distribution, as vLLM reports it) of each row's next prompt token, its rank, and the top k.

Every TP rank computes them (the vocabulary-parallel logits gather over the TP group); TP rank 0
returns them. The rows go through the LM head in chunks, so a long prompt never holds a
[prompt length, vocab] float32 tensor at once. A step whose rows asked for none computes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atomrt.workers.runner.input_batch import PromptRows

CHUNK_ROWS = 512  # prompt rows per LM-head pass: [512, vocab] float32 at a time


@dataclass
class PromptLogprobsTensors:
    token_logprobs: torch.Tensor  # float32 [rows]: the prompt token's logprob
    token_ranks: torch.Tensor  # int32 [rows]: its rank (1 = the most likely)
    top_token_ids: torch.Tensor  # int32 [rows, k], best first
    top_logprobs: torch.Tensor  # float32 [rows, k]

    def tensors(self) -> list[torch.Tensor]:
        return [self.token_logprobs, self.token_ranks, self.top_token_ids, self.top_logprobs]


def compute_prompt_logprobs(
    model: torch.nn.Module, hidden_states: torch.Tensor, prompt: PromptRows
) -> PromptLogprobsTensors:
    """`hidden_states` [step rows, hidden]; `prompt` names the rows and the tokens they score."""
    device = hidden_states.device
    rows = torch.as_tensor(prompt.rows, device=device)
    targets = torch.as_tensor(prompt.token_ids, device=device)
    parts: list[list[torch.Tensor]] = []
    for lo in range(0, rows.shape[0], CHUNK_ROWS):
        hi = lo + CHUNK_ROWS
        lp = model.compute_logits(hidden_states[rows[lo:hi]]).float().log_softmax(dim=-1)
        token_lp = lp.gather(1, targets[lo:hi].unsqueeze(1))  # [n, 1]
        rank = (lp > token_lp).sum(dim=-1) + 1
        top = lp.topk(min(prompt.k, lp.shape[1]), dim=-1)
        parts.append(
            [token_lp.squeeze(1), rank.to(torch.int32), top.indices.to(torch.int32), top.values]
        )
    return PromptLogprobsTensors(*(torch.cat(p) for p in zip(*parts)))

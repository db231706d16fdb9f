"""Vocabulary-parallel embedding and LM head.

Each rank owns a contiguous range of ceil(vocab_size / tp_size) token rows (the last range padded
with zero rows). The embedding looks up its own ids, zeroes the others and all-reduces; the head
computes its logits slice and all-gathers the slices, dropping the padding columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atomrt.distributed.communication_op import TPInfo, tp_all_gather, tp_all_reduce
from atomrt.workers.layers.cpu_gemm import CPUPackedWeight, packed_linear
from atomrt.workers.layers.weight_utils import Sliceable, copy_checked, read_narrow, shape_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPInfo = TPInfo()) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.num_rows_per_rank = -(-vocab_size // tp.tp_size)
        self.vocab_start = tp.tp_rank * self.num_rows_per_rank
        self.vocab_end = min(self.vocab_start + self.num_rows_per_rank, vocab_size)
        self.weight = nn.Parameter(
            torch.empty(self.num_rows_per_rank, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Sliceable, shard_id: object = None
    ) -> None:
        if shape_of(loaded_weight)[0] != self.vocab_size:
            raise ValueError(
                f"vocab weight: checkpoint has {shape_of(loaded_weight)[0]} rows, model {self.vocab_size}"
            )
        num_rows = self.vocab_end - self.vocab_start
        with torch.no_grad():
            param.data[num_rows:].zero_()
        copy_checked(
            param.data[:num_rows],
            read_narrow(loaded_weight, 0, self.vocab_start, num_rows),
            "vocab shard",
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden]."""
        if self.tp.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * mine
        out = F.embedding(local_ids, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; with tied embeddings its weight is the embedding's Parameter."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPInfo = TPInfo()) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.cpu_packed = CPUPackedWeight()  # the CPU eager path's copy of the weight (cpu_gemm.py)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab_size] in the weight's dtype. A bf16 model's logits stay bf16: a
        greedy step's argmax reads them as they are (converting to float32 is exact, so the index is
        the same), and the sampler converts them where it computes (penalties, softmax, logprobs)."""
        packed = self.cpu_packed.get(self.weight, hidden_states)
        if packed is not None:
            logits = packed_linear(hidden_states, packed, None)  # [n, num_rows_per_rank]
        else:
            logits = F.linear(hidden_states, self.weight)
        logits = tp_all_gather(logits, self.tp)
        return logits[:, : self.vocab_size]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)

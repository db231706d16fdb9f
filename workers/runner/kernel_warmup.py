"""Compile the host-planned attention kernels' variants at start-up (CUDA).

An eager step (a prefill, a mixed batch, a decode step no graph covers, a TR_HYBRID eager region)
plans its attention launch from the step's lengths; a plan whose variant Triton has not compiled
yet compiles it on the spot, a second or more in which that step and every rank in step with it
stall. The first prompts of a fresh server hit exactly that (their time to first token took the
compile). Start-up runs one-sequence eager batches that between them plan every variant a step can
(kernels/attention/variants.py), after the KV cache exists and before capture. The batches read KV
block 0 and write no KV (slot -1) and sample nothing, like an idle DP rank's dummy batch; every rank
runs the same batches in the same order, so collectives match.

The batches run twice: first under `compile_ahead`, where the attention launches submit their
kernel's compile to a pool of threads and launch nothing (Triton compiles the variants side by
side), then for real, every variant compiled. The first pass also runs every capture size's warm-up
(`GraphRunner.warm_up_ahead`): one pool compiles the kernels of both start-up phases side by side,
and no pool waits for its slowest compile twice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.workers.kernels.attention.variants import warmup_decode_seqs, warmup_lengths
from atomrt.workers.kernels.device_info import sm_count
from atomrt.workers.kernels.launch import compile_ahead
from atomrt.workers.layers.attention import Attention
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.sampler import SamplingTensors

if TYPE_CHECKING:
    from atomrt.workers.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def warmup_inputs(rows: int, keys: int, block_size: int, seqs: int = 1) -> StepInputs:
    """`seqs` sequences of `rows` query rows each at the end of a `keys`-key context whose blocks
    are all block 0; no KV written, nothing sampled."""
    num_blocks = -(-keys // block_size)
    return StepInputs(
        seq_ids=np.arange(seqs, dtype=np.int64),
        input_ids=np.zeros(rows * seqs, dtype=np.int64),
        positions=np.tile(np.arange(keys - rows, keys, dtype=np.int64), seqs),
        slot_mapping=np.full(rows * seqs, -1, dtype=np.int64),
        cu_seqlens_q=np.arange(0, rows * seqs + 1, rows, dtype=np.int32),
        context_lens=np.full(seqs, keys, dtype=np.int32),
        block_tables=np.zeros((seqs, num_blocks), dtype=np.int32),
        sample_seq_idx=np.zeros(0, dtype=np.int64),
        sample_rows=np.zeros(0, dtype=np.int64),
    )


def warmup_batches(runner: ModelRunner) -> list[tuple[int, int, int]]:
    """(rows, keys, sequences) of the warm-up batches for every attention layer shape of the
    model: one sequence each, and decode batches of several where a plan needs them."""
    shape = runner.shape
    heads = {
        (a.num_kv_heads, a.num_heads // a.num_kv_heads, a.head_dim)
        for a in runner.attn_layers.values()
        if isinstance(a, Attention)  # latent attention plans its launches from shapes alone
    }
    fp8_cache = runner.kv_cache_dtype == torch.float8_e4m3fn
    num_sms = sm_count(runner.device)
    max_seqs = min(shape.max_num_seqs, shape.max_num_tokens)
    batches: set[tuple[int, int, int]] = set()
    for kv, group, head_dim in sorted(heads):
        one = warmup_lengths(
            kv, group, head_dim, num_sms, shape.max_num_tokens, shape.max_model_len, fp8_cache
        )
        batches.update((rows, keys, 1) for rows, keys in one)
        several = warmup_decode_seqs(
            kv, group, head_dim, num_sms, max_seqs, shape.max_model_len, fp8_cache
        )
        batches.update((1, keys, seqs) for seqs, keys in several)
    return sorted(batches)


def run_batches(runner: ModelRunner, batches: list[tuple[int, int, int]]) -> None:
    """Run one eager step per (rows, keys, sequences) batch, on every DP rank alike."""
    nothing = SamplingTensors.from_params([], [], [], runner.arch.vocab_size, runner.device)
    dp_size = runner.dp.dp_size
    with torch.inference_mode():
        for rows, keys, seqs in batches:
            tokens = rows * seqs
            decision = ForwardDecision(
                kind=ForwardKind.EAGER, running_bs=seqs, running_tokens=tokens, is_prefill=rows > 1
            )
            if dp_size > 1:  # every DP rank runs this batch
                decision = replace(
                    decision,
                    dp_num_tokens=(tokens,) * dp_size,
                    dp_padded_tokens=(tokens,) * dp_size,
                )
            inputs = warmup_inputs(rows, keys, runner.shape.block_size, seqs)
            runner.execute(inputs, decision, nothing)
    if runner.spec is not None:
        runner.spec.take_eager_passes()  # a drafter's passes here are start-up's, not serving's


def warm_eager_kernels(runner: ModelRunner) -> int:
    """Run the warm-up batches on a CUDA runner; returns how many ran (none off CUDA, where
    attention is the torch reference)."""
    if runner.device.type != "cuda" or not runner.attn_layers:
        return 0
    start = time.perf_counter()
    batches = warmup_batches(runner)
    buckets = 0
    with compile_ahead() as ahead:
        if ahead:
            run_batches(runner, batches)
            with torch.inference_mode():  # capture's kernels, in the same pool
                buckets = runner.graphs.warm_up_ahead(runner)
    compiled = time.perf_counter()
    run_batches(runner, batches)
    torch.cuda.synchronize(runner.device)
    logger.info(
        "rank %d: eager attention kernels warmed by %d batches in %.2f s (compiled ahead, with "
        "capture's %d warm-ups, in %.2f s)",
        runner.rank,
        len(batches),
        time.perf_counter() - start,
        buckets,
        compiled - start,
    )
    return len(batches)

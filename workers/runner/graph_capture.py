"""`ModelRunner.capture_cudagraph()`'s body: the guide's capture flow.

Sizes descending (largest first, so smaller recordings reuse the shared pool's blocks); per size a
dummy decode batch of `bs` sequences x `max_q_len` rows, the forward context with
`running_tokens` the same on every rank (capture is symmetric), a warm-up run, the recording,
`torch.cuda.synchronize()`. FULL (and FULL_DECODE_ONLY) record `ReqGraph`s, the LM head and the
greedy argmax included (the recording's outputs are the logits and their argmax); TR_HYBRID (and
FULL_AND_TR_HYBRID, recorded exactly as TR_HYBRID) record the model's token graphs, asked once
for decode and once for prefill (the same recording serves both). GC is off during capture; a
progress bar shows on rank 0. Every recording drains pending NCCL work first (graphs/region_graph).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from atomrt.graphs.buckets import capture_order, request_bucket
from atomrt.graphs.region_graph import ReqGraph, graph_pool_bytes
from atomrt.runtime.config import CUDAGraphMode
from atomrt.runtime.forward_context import set_forward_context
from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.workers.runner.input_batch import StepInputs

if TYPE_CHECKING:
    from atomrt.workers.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def dummy_decode_inputs(bs: int, max_q_len: int) -> StepInputs:
    """`bs` sequences of `max_q_len` rows at position 0.. with one cache block (0) and no KV writes."""
    n = bs * max_q_len
    cu = np.arange(0, n + 1, max_q_len, dtype=np.int32)
    return StepInputs(
        seq_ids=np.arange(bs, dtype=np.int64),
        input_ids=np.zeros(n, dtype=np.int64),
        positions=np.tile(np.arange(max_q_len, dtype=np.int64), bs),
        slot_mapping=np.full(n, -1, dtype=np.int64),
        cu_seqlens_q=cu,
        context_lens=np.full(bs, max_q_len, dtype=np.int32),
        block_tables=np.zeros((bs, 1), dtype=np.int32),
        sample_seq_idx=np.arange(bs, dtype=np.int64),
        sample_rows=cu[1:].astype(np.int64) - 1,
    )


def capture_all(runner: "ModelRunner") -> tuple[float, list[int]]:
    config = runner.config
    mode = config.cudagraph_mode
    if runner.enforce_eager or mode == CUDAGraphMode.NONE or not config.capture_sizes:
        return 0.0, []
    sizes = capture_order(config.capture_sizes)
    assert sizes[0] <= runner.max_num_seqs, f"capture size {sizes[0]} > max_num_seqs {runner.max_num_seqs}"
    record_tr = mode.uses_tr_hybrid()
    record_full = mode.records_request_graphs()
    runner.req_graph = ReqGraph()
    max_q_len = 1  # no MTP drafter: a decode row per request
    fv = runner.forward_vars
    start = time.perf_counter()
    largest_pool = 0  # the pool after the largest bucket: the whole ladder should need about this
    gc.collect()
    gc.disable()
    try:
        for bs in tqdm(sizes, desc="Capturing CUDA graphs", disable=runner.rank != 0):
            rows = bs * max_q_len
            kind = ForwardKind.TOKEN_GRAPH if record_tr else ForwardKind.REQ_GRAPH
            decision = ForwardDecision(
                kind=kind, running_bs=bs, running_tokens=rows, is_prefill=False, req_key=request_bucket(bs, max_q_len)
            )
            md, ctx = runner.prepare(dummy_decode_inputs(bs, max_q_len), decision)
            ids, pos = fv["input_ids"][:rows], fv["positions"][:rows]
            scope = dict(no_compile_layers=runner.attn_layers, kv_cache_data=runner.kv_cache)
            with set_forward_context(md, config, ctx, **scope):
                runner.unpack_step(bs, rows)
                hidden = runner.model(ids, pos)  # warm-up
                if record_full:
                    runner.greedy_tokens(runner.model.compute_logits(hidden))
            if record_full:

                def forward() -> tuple[torch.Tensor, torch.Tensor]:
                    """The request graph: unpack the staged step, run, keep the hidden states, and
                    return every row's logits (a decode step samples every row) and their argmax."""
                    runner.unpack_step(bs, rows)
                    hidden = runner.model(ids, pos)
                    fv["outputs"][:rows].copy_(hidden)
                    logits = runner.model.compute_logits(hidden)
                    return logits, runner.greedy_tokens(logits)

                with set_forward_context(md, config, ctx, **scope):
                    runner.req_graph.record(decision.req_key, forward)
            if record_tr:
                for phase_ctx in (ctx, replace(ctx, is_prefill=True)):
                    with set_forward_context(replace(md, graph_safe=False), config, phase_ctx, tr_graph="record", **scope):
                        runner.model(ids, pos)
            torch.cuda.synchronize()
            largest_pool = largest_pool or (graph_pool_bytes() or 0)
    finally:
        gc.enable()
    elapsed = time.perf_counter() - start
    pool = graph_pool_bytes() or 0
    logger.info(
        "captured %d %s graphs in %.2f s; graph pool %.1f MiB (%.1f MiB after the largest bucket)",
        len(sizes), "token" if record_tr else "request", elapsed, pool / 2**20, largest_pool / 2**20,
    )
    runner.capture_sizes = sorted(sizes)
    runner.graph_pool_bytes = pool
    runner.graph_pool_largest_bytes = largest_pool
    return elapsed, runner.capture_sizes

"""Sizing the KV cache: how many blocks fit beside the weights, the activations and the graph pool.

CPU: `cache_config.cpu_kv_cache_gib`. GPU: a profile forward of `max_num_batched_tokens` rows
(no KV cache, sequences of at most max_model_len) measures the activation peak; a forward at the
largest capture bucket measures an estimate of the graph pool (the pool is the largest recording's,
not the sum; with every row's logits where request graphs record the LM head; none without graphs);
the rest of `gpu_memory_utilization` of the device becomes KV blocks. An explicit
`cache_config.num_kv_blocks` wins. Never more than the scheduler could ever fill.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from atomrt.runtime.forward_context import (
    AttentionMetaData,
    Context,
    DPMetadata,
    set_forward_context,
)
from atomrt.workers.runner.kv_cache import (
    KVCacheSizing,
    KVKindSize,
    kv_sizes_by_kind,
    num_blocks_needed,
)
from atomrt.workers.runner.kv_scales import settle_kv_scales

if TYPE_CHECKING:
    from atomrt.workers.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def dummy_forward(runner: ModelRunner, num_tokens: int, logits_rows: int = 1) -> None:
    """A prefill of `num_tokens` rows cut into sequences of at most max_model_len, without KV cache,
    and the logits of its last `logits_rows` rows."""
    seq_len = min(num_tokens, runner.shape.max_model_len)
    cu = list(range(0, num_tokens, seq_len)) + [num_tokens]
    ids = runner.buffers.forward_vars["input_ids"][:num_tokens]
    pos = torch.from_numpy(np.concatenate([np.arange(b - a) for a, b in zip(cu, cu[1:])])).to(
        runner.device
    )
    md = AttentionMetaData(cu_seqlens_q_cpu=cu, num_seqs=len(cu) - 1, num_tokens=num_tokens)
    dp_size = runner.dp.dp_size
    ctx = Context(
        positions=pos,
        is_prefill=True,
        batch_size=len(cu) - 1,
        running_bs=len(cu) - 1,
        running_tokens=num_tokens,
    )
    with (
        torch.inference_mode(),
        set_forward_context(
            md,
            runner.config,
            ctx,
            no_compile_layers=runner.attn_layers,
            # every DP rank profiles the same rows (a MoE layer gathers across them)
            dp_metadata=DPMetadata.for_capture(dp_size, num_tokens) if dp_size > 1 else None,
        ),
    ):
        hidden = runner.model(ids, pos)
        runner.model.compute_logits(hidden[-logits_rows:])


def determine_num_blocks(runner: ModelRunner) -> KVCacheSizing:
    cc = runner.config.cache_config
    per_block = runner.kv_bytes_per_block()
    cap = num_blocks_needed(
        runner.shape.max_num_seqs, runner.shape.max_model_len, runner.shape.block_size
    )
    peak = pool_estimate = 0
    if cc.num_kv_blocks is not None:
        num_blocks = cc.num_kv_blocks
    elif runner.device.type != "cuda":
        dummy_forward(
            runner, min(runner.shape.max_num_tokens, 256)
        )  # checks the model runs; CPU has no profile
        num_blocks = int(cc.cpu_kv_cache_gib * 2**30) // per_block
    else:
        # Tensors that loading replaced (a fold or repack of weights) can sit in reference cycles
        # (a parameter's loader bound to its module) until the collector runs, which may be inside
        # the profile forward: freed there, they would count against the peak as negative bytes.
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        # The largest forward first: at levels 2-3 the first call compiles, and it must have >= 2 rows
        # (the largest capture bucket may be 1).
        torch.cuda.reset_peak_memory_stats()
        dummy_forward(runner, runner.shape.max_num_tokens)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        if runner.graphs.enabled:
            # the largest recording's rows: with speculative decoding each request verifies k drafts
            largest_bucket = max(runner.config.capture_sizes) * runner.config.max_q_len
            # A request graph records its bucket's LM head (every row's logits), and so does the
            # whole decode step TR_HYBRID joins around a token graph.
            logits_rows = largest_bucket if runner.graphs.records_logits else 1
            torch.cuda.reset_peak_memory_stats()
            dummy_forward(runner, largest_bucket, logits_rows=logits_rows)
            pool_estimate = torch.cuda.max_memory_allocated() - base
        free, total = torch.cuda.mem_get_info()
        others = total - free - torch.cuda.memory_reserved()  # other processes on this device
        budget = total * cc.gpu_memory_utilization - others - base - peak - pool_estimate
        num_blocks = max(int(budget) // per_block, 0)
        torch.cuda.empty_cache()
    num_blocks = min(num_blocks, cap)
    if num_blocks < 2:
        raise ValueError(
            f"rank {runner.rank}: only {num_blocks} KV blocks fit ({per_block} bytes each); lower "
            "scheduler_config.max_num_batched_tokens or model_config.max_model_len, or raise "
            "cache_config.gpu_memory_utilization / cpu_kv_cache_gib"
        )
    kv_scales = settle_kv_scales(runner, lambda n: dummy_forward(runner, n))
    by_kind = kv_sizes_by_kind(runner.kv_layer_specs(), runner.kv_cache_dtype)
    logger.info(
        "KV cache: %d blocks x %d tokens (%.1f MiB); per token %s; activation peak %.1f MiB; "
        "graph pool estimate %.1f MiB",
        num_blocks,
        runner.shape.block_size,
        num_blocks * per_block / 2**20,
        describe_kv_sizes(by_kind, runner.tp.tp_size),
        peak / 2**20,
        pool_estimate / 2**20,
    )
    return KVCacheSizing(num_blocks, per_block, peak, pool_estimate, by_kind, kv_scales)


def describe_kv_sizes(by_kind: tuple[KVKindSize, ...], tp_size: int) -> str:
    """Per layer kind, "attention: 24 layers, 49152 B" (bytes per token on this rank); a latent
    (mla) cache says it is whole on every TP rank, which do not split its one latent head."""
    parts = []
    for k in by_kind:
        part = f"{k.kind}: {k.num_layers} layers, {k.bytes_per_token} B"
        if k.kind == "mla" and tp_size > 1:
            part += f" (replicated on each of {tp_size} TP ranks)"
        parts.append(part)
    return "; ".join(parts) or "nothing"

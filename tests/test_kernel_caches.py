"""Kernel launch helpers keep no tensor alive: a memo (functools.cache / lru_cache) keyed by a tensor
holds it, and a KV cache held that way outlives its engine (a second engine in the same process
then finds no GPU memory for its own KV blocks)."""

from __future__ import annotations

import gc
import inspect
import weakref

import torch
from package_walk import modules_mentioning
from test_mla_kernels import make_mla_batch, run_mla


def _memoized_functions():
    for module in modules_mentioning("cache"):
        for name, value in vars(module).items():
            if hasattr(value, "cache_info") and hasattr(value, "__wrapped__"):
                yield f"{module.__name__}.{name}", value.__wrapped__


def test_no_memo_takes_a_tensor() -> None:
    memoized = dict(_memoized_functions())
    assert "atomrt.workers.kernels.attention.mla_decode.plan_mla_decode" in memoized
    takes_tensors = [
        name
        for name, fn in memoized.items()
        if any(
            p.annotation in (torch.Tensor, "torch.Tensor")
            for p in inspect.signature(fn).parameters.values()
        )
    ]
    assert not takes_tensors, f"memoized on tensors (kept alive by the memo): {takes_tensors}"


def test_mla_decode_keeps_no_reference_to_the_cache() -> None:
    batch = make_mla_batch([1, 1], [9, 20], num_heads=4, kv_lora_rank=64, rope_dim=32, seed=0)
    run_mla(batch)
    cache, q = weakref.ref(batch.kv_cache), weakref.ref(batch.q)
    del batch
    gc.collect()
    assert cache() is None and q() is None

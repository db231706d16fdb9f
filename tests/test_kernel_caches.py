"""Kernel launch helpers keep no tensor alive: a memo (functools.cache / lru_cache) keyed by a tensor
holds it, and a KV cache held that way outlives its engine (a second engine in the same process
then finds no GPU memory for its own KV blocks)."""

from __future__ import annotations

import gc
import importlib
import inspect
import pkgutil
import weakref

import torch
from test_mla_kernels import make_mla_batch, run_mla

PACKAGES = ("workers", "runtime", "compile", "graphs", "distributed")


def _memoized_functions():
    for package in PACKAGES:
        root = importlib.import_module(f"atomrt.{package}")
        for info in pkgutil.walk_packages(root.__path__, f"atomrt.{package}."):
            spec = info.module_finder.find_spec(info.name, None)
            if spec is None or not spec.origin or not spec.origin.endswith(".py"):
                continue
            with open(spec.origin, encoding="utf-8") as f:
                if "cache" not in f.read():
                    continue
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                if hasattr(value, "cache_info") and hasattr(value, "__wrapped__"):
                    yield f"{info.name}.{name}", value.__wrapped__


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

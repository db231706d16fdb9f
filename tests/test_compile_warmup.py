"""Start-up compiles every piece (levels 2-3): the general shape and every `compile_sizes` entry a
step can have, on every rank, before the first step; the start reports what it compiled and loaded.

The fast test runs level 3 without Inductor (Dynamo, the split and the per-size dispatch are real;
each piece runs as traced). The slow one compiles with Inductor, then starts again from the cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from executor_harness import COMMON, GREEDY, PROMPTS, build_tiny_llama

from atomrt.compile import PiecewiseBackend
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.workers.runner.compile_warmup import compiled_modules, prefetch_triton_key

TOO_BIG = 100_000  # above max_num_batched_tokens (8192) and every capture size: no step has it


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _pieces(llm: LLM) -> list[PiecewiseBackend]:
    (module,) = compiled_modules(llm.engine.executor.worker.runner.model)
    return [
        v for v in vars(module.compile_backend.split_gm).values() if isinstance(v, PiecewiseBackend)
    ]


def _llm(model: Path, cache_dir: Path, **kwargs) -> LLM:
    return LLM(
        str(model),
        **{**COMMON, "enforce_eager": False},
        level=3,
        compile_sizes=[3, 5, TOO_BIG],
        cache_dir=str(cache_dir),
        **kwargs,
    )


def test_start_up_compiles_every_size_before_the_first_step(tiny_model: Path, tmp_path: Path):
    llm = _llm(tiny_model, tmp_path, use_inductor=False)
    try:
        (report,) = llm.engine.info.compile_reports
        pieces = _pieces(llm)
        compiled = {
            size: [p.concrete_size_entries[size].compiled for p in pieces] for size in (3, 5)
        }
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()
    assert (
        report.rank == 0 and report.compile_sizes == (5, 3) and report.skipped_sizes == (TOO_BIG,)
    )
    assert len(pieces) == 3  # two attention calls split the backbone into three compiled pieces
    assert compiled == {3: [True] * 3, 5: [True] * 3}  # before any step ran
    assert not any(p.concrete_size_entries[TOO_BIG].compiled for p in pieces)
    assert (report.inductor_compiles, report.cache_loads) == (0, 0)  # no Inductor: no cache
    reference = LLM(str(tiny_model), **COMMON)
    try:
        assert tokens == [o.outputs[0].token_ids for o in reference.generate(PROMPTS, GREEDY)]
    finally:
        reference.shutdown()


@pytest.mark.slow
def test_a_second_start_loads_every_size_and_compiles_nothing(tiny_model: Path, tmp_path: Path):
    first = _llm(tiny_model, tmp_path)
    first.shutdown()
    second = _llm(tiny_model, tmp_path)
    second.shutdown()
    (cold,) = first.engine.info.compile_reports
    (warm,) = second.engine.info.compile_reports
    # 3 pieces x (the general shape, size 5, size 3)
    assert (cold.inductor_compiles, cold.cache_loads) == (9, 0)
    assert (warm.inductor_compiles, warm.cache_loads) == (0, 9)
    assert warm.cache_dirs == cold.cache_dirs and not warm.read_only
    assert Path(cold.cache_dirs[0]).is_relative_to(tmp_path)


def test_a_cuda_worker_hashes_tritons_installation_on_a_thread() -> None:
    """On CUDA the worker starts `triton_key` (a hash of Triton's sources and library) on a
    thread while the model loads: once it ends, the key is cached and the main thread's first ask
    is a cache hit. Off CUDA nothing starts. (Hashing needs no GPU: the CUDA device is only named.)"""
    import torch
    from triton.runtime.cache import triton_key

    assert prefetch_triton_key(torch.device("cpu")) is None
    triton_key.cache_clear()
    thread = prefetch_triton_key(torch.device("cuda"))
    assert thread is not None and thread.daemon
    thread.join(timeout=300)
    assert not thread.is_alive()
    hits = triton_key.cache_info().hits
    assert triton_key() and triton_key.cache_info().hits == hits + 1

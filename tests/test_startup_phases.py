"""A worker reports its start-up phase by phase, and the engine logs them in one line."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from atomrt.runtime.entrypoints.llm import LLM


def test_startup_phases_are_reported_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="atomrt.runtime.driver.engine"):
        llm = LLM(
            "tiny-qwen3-moe",
            load_format="dummy",
            device="cpu",
            enforce_eager=True,
            max_num_seqs=4,
            num_kv_blocks=16,
        )
    try:
        phases = llm.engine.info.startup_phases
    finally:
        llm.shutdown()
    names = [name for name, _ in phases]
    assert names == [
        "model and weights",
        "KV sizing (its profile run compiles the general shape)",
        "KV cache allocation",
        "compile sizes",
        "eager attention kernels",
        "graph capture",
    ]
    assert all(seconds >= 0 for _, seconds in phases)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("workers up"))
    assert "rank 0: model and weights" in line and "graph capture" in line


def test_an_uncompiled_engine_never_imports_dynamo_or_inductor() -> None:
    """Level 0 (the default) compiles nothing, so a process that builds an engine and generates
    never imports Dynamo, Inductor or sympy (several seconds of a start-up on a slow host)."""
    code = (
        "import sys\n"
        "from atomrt import SamplingParams\n"
        "from atomrt.runtime.entrypoints.llm import LLM\n"
        "llm = LLM('tiny-qwen3-moe', load_format='dummy', device='cpu', enforce_eager=True,\n"
        "          max_num_seqs=4, num_kv_blocks=16)\n"
        "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))\n"
        "llm.shutdown()\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'sympy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_async_scheduling_flag() -> None:
    """`--async-scheduling` (vLLM's name) turns on scheduler_config.async_scheduling; off without it."""
    from atomrt.runtime.entrypoints.cli import build_parser
    from atomrt.runtime.entrypoints.config_args import config_from_args

    parser = build_parser()
    on = parser.parse_args(["serve", "--async-scheduling"])
    off = parser.parse_args(["serve"])
    assert config_from_args(on).scheduler_config.async_scheduling is True
    assert config_from_args(off).scheduler_config.async_scheduling is False

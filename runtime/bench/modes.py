"""Benchmark modes: a graph mode name, optionally with "+async", and the LLM settings it means."""

from __future__ import annotations

from typing import Any

from atomrt.runtime.config import CUDAGraphMode

ASYNC_SUFFIX = "+async"  # a mode name ending in it runs with scheduler_config.async_scheduling


def split_mode(mode: str) -> tuple[str, bool]:
    """("FULL", True) for "FULL+async"; (mode, False) otherwise."""
    if mode.endswith(ASYNC_SUFFIX):
        return mode[: -len(ASYNC_SUFFIX)], True
    return mode, False


def mode_settings(mode: str, level: int, on_cuda: bool) -> dict[str, Any]:
    """LLM keyword settings for a benchmark mode; graph modes run eagerly without CUDA."""
    base, async_scheduling = split_mode(mode)
    if base == "eager" or not on_cuda:
        return {"enforce_eager": True, "async_scheduling": async_scheduling}
    return {
        "level": level,
        "cudagraph_mode": CUDAGraphMode.parse(base),
        "async_scheduling": async_scheduling,
    }

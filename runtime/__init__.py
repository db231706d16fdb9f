"""atomrt.runtime: config, forward context, scheduler, engine, offline `LLM`, executors, CLI.

`LLM`, `AsyncLLM`, `AsyncEngineArgs`, `EngineArgs` and `SamplingParams` are re-exported here (the
names vLLM users know); all but `SamplingParams` are imported lazily so that
`import atomrt.runtime.config` stays a leaf import.
"""

from typing import Any

from atomrt.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngineArgs", "AsyncLLM", "EngineArgs", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from atomrt.runtime.entrypoints.llm import LLM

        return LLM
    if name in ("AsyncLLM", "AsyncEngineArgs"):
        from atomrt.runtime.entrypoints import async_llm

        return getattr(async_llm, name)
    if name == "EngineArgs":
        from atomrt.runtime.entrypoints.config_args import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'atomrt.runtime' has no attribute {name!r}")

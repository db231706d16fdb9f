"""atomrt.runtime: config, forward context, scheduler, engine, offline `LLM`, executors, CLI.

`LLM` and `SamplingParams` are re-exported here (the names vLLM users know); `LLM` is imported
lazily so that `import atomrt.runtime.config` stays a leaf import.
"""

from typing import Any

from atomrt.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from atomrt.runtime.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'atomrt.runtime' has no attribute {name!r}")

"""atomrt: the names a user's script imports, as vLLM's top level has them.

    from atomrt import LLM, SamplingParams

The package's code lives in the repository's top-level folders (runtime/, workers/, compile/,
graphs/, distributed/), each installed as a subpackage of `atomrt` (pyproject.toml's package-dir);
this folder holds only this file. All names are imported on first use (PEP 562), so that
`import atomrt.runtime.config` and the worker processes' imports stay light.

`enable_bytecode_cache()` runs first: every import of an atomrt module passes through here before
torch's first import (runtime/bytecode_cache.py).

`__path__` is extended pkgutil-style over sys.path: where the subpackages are linked into an
`atomrt` folder on PYTHONPATH (tests/gpu/run_gpu_tier.sh) while the checkout's own `atomrt/`
comes first on sys.path (a process started in the repository root), the subpackages are still found.
"""

from pkgutil import extend_path
from typing import Any

__path__ = extend_path(__path__, __name__)

from atomrt.runtime.bytecode_cache import enable_bytecode_cache  # noqa: E402

enable_bytecode_cache()  # before torch's first import

# name -> the module that defines it
_EXPORTS = {
    "LLM": "atomrt.runtime.entrypoints.llm",
    "AsyncLLM": "atomrt.runtime.entrypoints.async_llm",
    "AsyncEngineArgs": "atomrt.runtime.entrypoints.async_llm",
    "EngineArgs": "atomrt.runtime.entrypoints.config_args",
    "LLMEngine": "atomrt.runtime.driver.engine",
    "SamplingParams": "atomrt.runtime.sampling_params",
    "RequestOutput": "atomrt.runtime.driver.outputs",
    "CompletionOutput": "atomrt.runtime.driver.outputs",
    "PromptType": "atomrt.runtime.inputs",
    "TextPrompt": "atomrt.runtime.inputs",
    "TokensPrompt": "atomrt.runtime.inputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'atomrt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

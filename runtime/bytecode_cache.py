"""A bytecode cache for a read-only torch without bytecode.

Python caches each module's compiled bytecode beside its source (`__pycache__/`). A torch installed
into a read-only folder without that bytecode (the GPU machines' image) makes every process compile
its ~2500 modules from source again: about 6 s of each start-up, warm or cold. Before atomrt's
first import of torch, `enable_bytecode_cache` gives Python a writable place for bytecode instead
(`sys.pycache_prefix`, as PYTHONPYCACHEPREFIX would): `<ATOMRT_CACHE_ROOT>/pycache`, default
`~/.cache/atomrt/pycache`, which later processes read. Nothing changes where torch's bytecode is
there or can be written, where PYTHONPYCACHEPREFIX already names a place, where bytecode writing is
off (PYTHONDONTWRITEBYTECODE), or once torch is imported.

A leaf module: the standard library only (it runs before anything else of atomrt's is imported).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Optional


def _writable(path: str) -> bool:
    return os.access(path, os.W_OK)


def enable_bytecode_cache(
    package: str = "torch",
    cache_root: Optional[str] = None,
    writable: Callable[[str], bool] = _writable,
) -> Optional[str]:
    """Set `sys.pycache_prefix` when `package` (not yet imported) has no bytecode for this
    interpreter and its folder takes none (module docstring); returns the prefix set, or None."""
    if sys.pycache_prefix or sys.dont_write_bytecode or package in sys.modules:
        return None
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None  # shipped with bytecode, or an earlier process wrote it there
    folder = os.path.dirname(spec.origin)
    pycache = os.path.join(folder, "__pycache__")
    if writable(pycache if os.path.isdir(pycache) else folder):
        return None  # Python caches it beside the source itself
    root = cache_root or os.environ.get("ATOMRT_CACHE_ROOT") or ""
    prefix = os.path.join(
        root or os.path.join(os.path.expanduser("~"), ".cache", "atomrt"), "pycache"
    )
    try:
        os.makedirs(prefix, exist_ok=True)
    except OSError:
        return None
    if not writable(prefix):
        return None
    sys.pycache_prefix = prefix
    return prefix

"""Where kept traces live (compile/trace_cache.py says what one is): their key, their file, and
how an entry is written (whole, under a temporary name, then renamed) and read back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import re
from pathlib import Path
from typing import Optional

import torch

from atomrt.compile.cache import compiler_factors, source_hash
from atomrt.compile.trace_cache import FORMAT, TracedForward

logger = logging.getLogger("atomrt.compile.trace_cache")

DIR_NAME = "forward"


# ---- keys and paths ---------------------------------------------------------------------------


def describe_init(args: tuple, kwargs: dict) -> Optional[str]:
    """The decorated class's constructor arguments as text, or None where the text would name an
    object by address (no two processes would share the key). A process group (a tensor-parallel
    model's) counts by its kind: the ranks and sizes beside it say what the trace depends on."""
    text = repr((args, sorted(kwargs.items())))
    text = re.sub(r"<[\w.]*ProcessGroup object at 0x[0-9a-f]+>", "<ProcessGroup>", text)
    return None if re.search(r" at 0x[0-9a-f]+", text) else text


def trace_key(
    config_hash: str, model_cls: type, init_text: str, prefix: str, device: torch.device
) -> str:
    blob = json.dumps(
        {
            "format": FORMAT,
            "config": config_hash,
            "class": f"{model_cls.__module__}.{model_cls.__qualname__}",
            "init": init_text,
            "prefix": prefix,
            "compiler": compiler_factors(device),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def entry_path(root: Path, key: str, rank: int, prefix: str) -> Path:
    return root / DIR_NAME / key / f"rank_{rank}" / f"{prefix}.pkl"


# ---- save and load ----------------------------------------------------------------------------


def save(path: Path, traced: TracedForward) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(pickle.dumps(traced))
    os.replace(tmp, path)


def load(path: Path, state: str) -> Optional[TracedForward]:
    """The entry at `path` if it is there, readable and still matches its source files and the
    model's `module_state()`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:  # e.g. a file where a directory of the path should be
        logger.warning("trace cache: %s cannot be read (%s); tracing", path, e)
        return None
    try:
        traced = pickle.loads(data)
        if not (
            isinstance(traced, TracedForward)
            and all(hasattr(traced, f.name) for f in dataclasses.fields(TracedForward))
            and traced.format == FORMAT
        ):
            raise ValueError(f"not a trace of format {FORMAT}")
    except Exception as e:  # a truncated or foreign file: trace again (and overwrite it)
        logger.warning("trace cache: %s is unreadable (%s: %s); tracing", path, type(e).__name__, e)
        return None
    try:
        current = source_hash(traced.source_files)
    except OSError:
        current = None
    if current != traced.source_hash:
        logger.info("trace cache: the model's source files changed since %s; tracing", path)
        return None
    if state != traced.state:
        logger.info("trace cache: the model's attributes differ from %s's; tracing", path)
        return None
    return traced

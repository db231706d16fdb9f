"""Where kept traces live, and which one a process may use (compile/trace_cache.py says what one is).

    <root>/forward/<key>/rank_<i>/<prefix>/modules-<modules>.json   the modules a trace covers
    <root>/forward/<key>/rank_<i>/<prefix>/<modules>-<sources>.pkl  a trace (a TracedForward)

`<key>` covers what is known before tracing: `Config.compute_hash()`, the decorated class and its
constructor arguments, torch / triton / Python versions and the device. `<modules>` names a list
of modules whose code Dynamo traced (`atomrt.workers.models.llama`, ...), `<sources>` hashes those
modules' files as the process that looks for an entry imports them (`sources()`): each process
finds the entry of the code it would trace itself. Another checkout or environment sharing the
cache root, a copy of the package first on `sys.path`, an edited file: each has entries of its own
or none, never another's. Every file is written whole under a temporary name and renamed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Optional

import torch

from atomrt.compile.cache import compiler_factors
from atomrt.compile.trace_cache import FORMAT, Sources, TracedForward
from atomrt.compile.trace_guards import Ineligible

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


def entry_dir(root: Path, key: str, rank: int, prefix: str) -> Path:
    """Where the entries of one key, rank and prefix live, one per traced source."""
    return root / DIR_NAME / key / f"rank_{rank}" / prefix


def _modules_id(modules: list[str]) -> str:
    return hashlib.sha256("\n".join(modules).encode()).hexdigest()[:16]


def entry_path(directory: Path, sources: Sources) -> Path:
    return directory / f"{_modules_id(sources.modules)}-{sources.hash[:16]}.pkl"


def sources(modules: list[str]) -> Optional[Sources]:
    """`modules` with the files this process imports them from (through its own imports: a
    copy of a package first on sys.path is that copy) and their hash; None if one is not found."""
    files = []
    for name in modules:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None) if module is not None else None
        if path is None:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                return None
            path = spec.origin if spec is not None and spec.has_location else None
        if path is None or not os.path.isfile(path):
            return None
        files.append(path)
    digest = hashlib.sha256()
    for name, path in zip(modules, files):
        digest.update(f"{name}\0".encode())
        digest.update(Path(path).read_bytes())
    return Sources(list(modules), files, digest.hexdigest())


def traced_sources(files: list[str]) -> Sources:
    """The sources of the files Dynamo traced: each file's module name, as a later process will
    look it up; Ineligible for a file that no imported module names."""
    wanted = {os.path.realpath(f): f for f in files}
    basenames = {os.path.basename(f) for f in files}
    names: dict[str, list[str]] = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and os.path.basename(path) in basenames:
            real = os.path.realpath(path)
            if real in wanted:
                names.setdefault(real, []).append(name)
    modules = []
    for real, path in sorted(wanted.items()):
        if real not in names:
            raise Ineligible(f"the traced file {path} is no imported module's")
        modules.append(min(names[real], key=lambda n: (n == "__main__", n)))
    found = sources(sorted(modules))
    if found is None or sorted(map(os.path.realpath, found.files)) != sorted(wanted):
        raise Ineligible(f"the traced modules {modules} import from other files than {files}")
    return found


# ---- save and load ----------------------------------------------------------------------------


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save(directory: Path, traced: TracedForward, sources: Sources) -> Path:
    """Write the entry and, if it is new, its module list; return the entry's path."""
    directory.mkdir(parents=True, exist_ok=True)
    listing = directory / f"modules-{_modules_id(sources.modules)}.json"
    if not listing.exists():
        _write_atomic(listing, json.dumps(sources.modules).encode())
    path = entry_path(directory, sources)
    _write_atomic(path, pickle.dumps(traced))
    return path


def find(directory: Path) -> Optional[tuple[Path, Sources]]:
    """The entry in `directory` for the sources this process would trace, with those sources:
    each module list kept there is looked up through this process's imports."""
    try:
        listings = sorted(directory.glob("modules-*.json"))
    except OSError:
        return None
    for listing in listings:
        try:
            modules = json.loads(listing.read_text())
        except (OSError, ValueError) as e:
            logger.warning("trace cache: %s is unreadable (%s); skipped", listing, e)
            continue
        if not (isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
            logger.warning("trace cache: %s is not a list of module names; skipped", listing)
            continue
        found = sources(modules)
        if found is not None and entry_path(directory, found).is_file():
            return entry_path(directory, found), found
    return None


def load(path: Path, expected: Sources) -> Optional[TracedForward]:
    """The entry at `path` if it is readable and was traced from `expected`'s sources."""
    try:
        data = path.read_bytes()
    except OSError as e:  # gone since find(), or not a file
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
    if (traced.modules, traced.source_hash) != (expected.modules, expected.hash):
        logger.warning("trace cache: %s was traced from other sources than its name says", path)
        return None
    return traced

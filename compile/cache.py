"""The on-disk compile cache: where it lives, what its hash covers, and how it stays consistent.

Layout (the guide's, under our name):

    <root>/<hash>/rank_<i>/<prefix>/
        atomrt_compile_cache.py        the index: a pprint-ed dict, read back with ast.literal_eval
        artifact_shape_<s>_subgraph_<g>/  one Inductor artifact ("unpacked"), with READY inside
        computation_graph.py           the stitching graph, for humans
        .lock                          fcntl lock taken around each compile-or-load
    <root>/forward/<key>/rank_<i>/<prefix>/       Dynamo's traces of the model (compile/trace_store.py)

`<root>` is `CompilationConfig.cache_dir` if set, else `<ATOMRT_CACHE_ROOT>/torch_compile_cache`
(runtime/envs.py; default ~/.cache/atomrt/torch_compile_cache). `<hash>` covers exactly what changes the compiled code:
`Config.compute_hash()` (graph-affecting config), the contents of the source files Dynamo traced,
torch / triton / Python versions, device type and capability. Never ports, ranks or placement.

A read-only cache (ATOMRT_COMPILE_CACHE_READ_ONLY=1, or a directory this process cannot write, such
as a volume mounted read-only into serving pods) is only loaded from: no lock, no index update, and a
piece it lacks is compiled in memory and not saved.

An artifact is valid only once its READY manifest (file sizes and sha256) is written; a missing
or mismatching manifest is a corrupt entry that the caller logs and recompiles.
"""

from __future__ import annotations

import ast
import errno
import fcntl
import hashlib
import json
import os
import pprint
import sys
import sysconfig
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any, Optional

import torch

from atomrt.runtime.envs import ENV

INDEX_FILE_NAME = "atomrt_compile_cache.py"
READY_FILE_NAME = "READY"
LOCK_FILE_NAME = ".lock"
# A compile of one piece on a loaded machine takes minutes at worst; waiting longer means a
# stuck process holds the lock.
LOCK_TIMEOUT_S = 1800.0


class CorruptCacheEntry(RuntimeError):
    """A cache entry that is partial, truncated or unreadable; the caller recompiles it."""


@dataclass(frozen=True)
class CacheHash:
    """The cache directory hash and the factors it was computed from (logged at start-up)."""

    hash: str
    factors: dict[str, Any]


def cache_root(cache_dir: str = "") -> Path:
    """The directory under which every `<hash>/` lives."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    return ENV.cache_root / "torch_compile_cache"


def cache_dir_for(root: Path, hash_str: str, rank: int, prefix: str) -> Path:
    return root / hash_str / f"rank_{rank}" / prefix


def is_read_only(path: Path) -> bool:
    """Whether the cache at `path` must not be written: ATOMRT_COMPILE_CACHE_READ_ONLY, or neither
    `path` nor (when it does not exist yet) its nearest existing parent is writable."""
    if ENV.compile_cache_read_only:
        return True
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return not os.access(existing, os.W_OK)


def device_factors(device: torch.device) -> dict[str, Any]:
    """Device type and capability: what Inductor specialises its kernels for."""
    if device.type == "cuda":
        capability: Any = list(torch.cuda.get_device_capability(device))
    elif device.type == "cpu":
        capability = torch.backends.cpu.get_cpu_capability()  # e.g. "AVX2", "AVX512"
    else:
        capability = None
    return {"device_type": device.type, "device_capability": capability}


def compiler_factors(device: torch.device) -> dict[str, Any]:
    """Versions and device: everything outside the model and config that changes compiled code."""
    try:
        import triton

        triton_version: Optional[str] = triton.__version__
    except ImportError:
        triton_version = None
    factors = {
        "torch": torch.__version__,
        "triton": triton_version,
        "python": sys.version.split()[0],
        **device_factors(device),
    }
    if not ENV.fp8_norm_prologue:  # FP8 projections trace another op (absent at the default)
        factors["fp8_norm_prologue"] = False
    return factors


def model_source_files(traced_code: Iterable[CodeType]) -> list[str]:
    """The traced files that belong to the model: torch's and the standard library's are covered
    by the torch and Python versions, and generated code ("<...>") has no file."""
    skip = (
        os.path.dirname(torch.__file__) + os.sep,
        sysconfig.get_paths()["stdlib"] + os.sep,
    )
    files = {code.co_filename for code in traced_code}
    return sorted(f for f in files if os.path.isfile(f) and not f.startswith(skip))


def source_hash(files: Iterable[str]) -> str:
    """sha256 over the files' paths' base names and contents (paths differ between checkouts)."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(os.path.basename(path).encode())
        h.update(Path(path).read_bytes())
    return h.hexdigest()


def compute_cache_hash(
    config_hash: str, source_files: Iterable[str], compiler_hash: str
) -> CacheHash:
    """The directory hash: a pure function of the three inputs (tested on its own)."""
    files = sorted(source_files)
    factors = {
        "config": config_hash,
        "source_files": [os.path.basename(f) for f in files],
        "source": source_hash(files),
        "compiler": compiler_hash,
    }
    blob = json.dumps(factors, sort_keys=True)
    return CacheHash(hashlib.sha256(blob.encode()).hexdigest()[:10], factors)


# ---- the index -----------------------------------------------------------------------------


def read_index(path: Path) -> dict:
    """The index as written by `write_index`; an unreadable one is a `CorruptCacheEntry`."""
    if not path.exists():
        return {}
    try:
        value = ast.literal_eval(path.read_text())
    except (SyntaxError, ValueError) as e:
        raise CorruptCacheEntry(f"compile cache index {path} is unreadable: {e}") from e
    if not isinstance(value, dict):
        raise CorruptCacheEntry(
            f"compile cache index {path} holds {type(value).__name__}, not a dict"
        )
    return value


def write_index(path: Path, index: dict) -> None:
    """Write atomically (temp file + rename): a reader never sees half an index."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(pprint.pformat(index) + "\n")
    os.replace(tmp, path)


# ---- READY manifest ------------------------------------------------------------------------


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_ready_marker(artifact_dir: Path) -> None:
    """Record every file's size and sha256; written last, so its presence means complete."""
    manifest = {
        str(p.relative_to(artifact_dir)): [p.stat().st_size, _file_digest(p)]
        for p in sorted(artifact_dir.rglob("*"))
        if p.is_file() and p.name != READY_FILE_NAME
    }
    if not manifest:
        raise CorruptCacheEntry(f"artifact {artifact_dir} is empty after saving")
    tmp = artifact_dir / f".{READY_FILE_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, artifact_dir / READY_FILE_NAME)


def verify_ready_marker(artifact_dir: Path) -> None:
    """Raise `CorruptCacheEntry` unless every file in the manifest is present and unchanged.

    Files added after the manifest (e.g. objects the loader compiles next to the code) are allowed.
    """
    marker = artifact_dir / READY_FILE_NAME
    if not marker.is_file():
        raise CorruptCacheEntry(
            f"artifact {artifact_dir} has no {READY_FILE_NAME} marker (partial write?)"
        )
    try:
        manifest = json.loads(marker.read_text())
    except json.JSONDecodeError as e:
        raise CorruptCacheEntry(
            f"artifact {artifact_dir}: unreadable {READY_FILE_NAME}: {e}"
        ) from e
    for rel, (size, digest) in manifest.items():
        p = artifact_dir / rel
        if not p.is_file():
            raise CorruptCacheEntry(f"artifact {artifact_dir}: {rel} is missing")
        if p.stat().st_size != size or _file_digest(p) != digest:
            raise CorruptCacheEntry(f"artifact {artifact_dir}: {rel} is truncated or changed")


# ---- lock ----------------------------------------------------------------------------------


class FileLock:
    """An exclusive fcntl lock on `path`, waited for at most `timeout_s` (then TimeoutError)."""

    def __init__(self, path: Path, timeout_s: float = LOCK_TIMEOUT_S, poll_s: float = 0.05):
        self.path = path
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._fd: Optional[int] = None

    def __enter__(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise TimeoutError(
                        f"compile cache: waited {self.timeout_s:.0f} s for the lock {self.path} held by "
                        "another process; remove it if that process is gone"
                    ) from None
                time.sleep(self.poll_s)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

"""`atomrt prewarm`: fill the compile cache for a config, record what it holds, exit.

    atomrt prewarm [--model M] [--config FILE] [--set KEY=VALUE ...] [engine flags]

It starts the engine the flags describe, which at compilation level 2-3 compiles (or loads) every
piece for the general shape and for every size in `compilation_config.compile_sizes`
(workers/runner/compile_warmup.py) on every rank, and captures the CUDA graphs of the capture sizes.
Then it prints what each rank compiled and loaded, writes the record `prewarm.json` beside the
ranks' cache directories (`<cache root>/<hash>/prewarm.json`, where that directory is on this node),
and shuts the engine down. Run it once per config where the cache is writable (a Kubernetes Job, a
`ray job submit`); every later start of the same config, serving pods with the cache mounted
read-only included, loads every piece and compiles nothing.

On a read-only cache (ATOMRT_COMPILE_CACHE_READ_ONLY=1, or a volume mounted read-only) it checks
instead: it writes nothing and exits 1 if any piece had to be compiled, 0 if every one loaded.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from atomrt.compile.cache import cache_root
from atomrt.runtime.config import CompilationLevel, Config, ConfigError

logger = logging.getLogger(__name__)

RECORD_FILE_NAME = "prewarm.json"


@dataclass
class PrewarmRecord:
    """What a prewarm left in the compile cache (written as `prewarm.json`)."""

    model: str
    config_hash: str
    level: int
    cache_root: str
    cache_hash_dirs: list[str]  # <cache root>/<hash>, one per distinct hash (normally one)
    compile_sizes: list[int]  # compiled for their exact size on every rank
    skipped_compile_sizes: list[int]  # larger than any step of this config
    capture_sizes: list[int]  # the config's CUDA-graph capture sizes
    captured: dict  # what rank 0 recorded: request-graph keys, token-graph sizes per phase
    ranks: list[dict]  # one CompileReport per rank
    read_only: bool  # a check of a read-only cache: nothing was written
    inductor_compiles: int  # over every rank
    cache_loads: int
    seconds: float
    versions: dict = field(default_factory=dict)


def check_prewarm_config(config: Config) -> None:
    """A config that compiles nothing has nothing to prewarm: say which knob to change."""
    cc = config.compilation_config
    if config.enforce_eager or cc.level < CompilationLevel.DYNAMO_ONCE:
        raise ConfigError(
            f"prewarm: compilation_config.level is {int(cc.level)}"
            f"{' (enforce_eager)' if config.enforce_eager else ''}: nothing is compiled below "
            "level 2, so there is no cache to fill; pass --level 3 (and no --enforce-eager)"
        )
    if not cc.use_inductor:
        raise ConfigError(
            "prewarm: compilation_config.use_inductor is false: pieces run as traced and nothing "
            "is cached; set it to true"
        )


def run_prewarm(config: Config) -> PrewarmRecord:
    """Start the engine (which compiles and captures), record what it did, shut it down."""
    from atomrt.runtime.entrypoints.llm import LLM

    check_prewarm_config(config)
    start = time.perf_counter()
    llm = LLM(config=config)
    try:
        info = llm.engine.info
    finally:
        llm.shutdown()
    reports = [asdict(r) for r in info.compile_reports]
    hash_dirs = sorted({str(Path(d).parents[1]) for r in reports for d in r["cache_dirs"]})
    first = info.compile_reports[0] if info.compile_reports else None
    return PrewarmRecord(
        model=config.model,
        config_hash=config.compute_hash(),
        level=int(config.compilation_config.level),
        cache_root=str(cache_root(config.compilation_config.cache_dir)),
        cache_hash_dirs=hash_dirs,
        compile_sizes=sorted(first.compile_sizes) if first else [],
        skipped_compile_sizes=list(first.skipped_sizes) if first else [],
        capture_sizes=list(config.capture_sizes or []),
        captured={
            "request_graph_keys": [list(k) for k in info.req_keys],
            "prefill_token_sizes": list(info.prefill_token_sizes),
            "decode_token_sizes": list(info.decode_token_sizes),
        },
        ranks=reports,
        read_only=any(r["read_only"] for r in reports),
        inductor_compiles=sum(r["inductor_compiles"] for r in reports),
        cache_loads=sum(r["cache_loads"] for r in reports),
        seconds=round(time.perf_counter() - start, 2),
        versions={"torch": torch.__version__, "python": platform.python_version()},
    )


def write_record(record: PrewarmRecord) -> list[str]:
    """`prewarm.json` into every hash directory on this node; returns the paths written."""
    written = []
    for d in record.cache_hash_dirs:
        if Path(d).is_dir():
            path = Path(d) / RECORD_FILE_NAME
            tmp = path.with_name(f".{RECORD_FILE_NAME}.tmp")
            tmp.write_text(json.dumps(asdict(record), indent=1) + "\n")
            tmp.replace(path)
            written.append(str(path))
        else:
            logger.warning("prewarm: %s is not on this node: %s not written", d, RECORD_FILE_NAME)
    return written


def summary(record: PrewarmRecord) -> str:
    lines = [
        f"prewarm {record.model}: level {record.level}, {len(record.ranks)} rank(s), "
        f"{record.inductor_compiles} Inductor compiles and {record.cache_loads} cache loads "
        f"in {record.seconds:.1f} s"
    ]
    for r in record.ranks:
        lines.append(
            f"  rank {r['rank']}: {r['inductor_compiles']} compiled, {r['cache_loads']} loaded, "
            f"{'built from the kept trace' if r['trace_loads'] else 'traced'}, "
            f"{r['compile_seconds']:.1f} s; {', '.join(r['cache_dirs'])}"
        )
    lines.append(
        f"  compile sizes {record.compile_sizes}; capture sizes {record.capture_sizes}; "
        f"recorded graphs {record.captured}"
    )
    if record.skipped_compile_sizes:
        lines.append(f"  compile sizes not reachable by any step: {record.skipped_compile_sizes}")
    return "\n".join(lines)


def cmd_prewarm(config: Config) -> int:
    """Fill the cache (0), or check a read-only one: 0 when every piece loaded, else 1."""
    record = run_prewarm(config)
    print(summary(record))
    if record.read_only:
        if record.inductor_compiles:
            print(
                f"prewarm: the read-only compile cache lacks {record.inductor_compiles} piece(s): "
                "run `atomrt prewarm` with this config where the cache is writable"
            )
            return 1
        print("prewarm: the read-only compile cache holds every piece of this config")
        return 0
    for path in write_record(record):
        print(f"  record: {path}")
    return 0

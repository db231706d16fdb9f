"""Bench records: one small JSON file per bench run, the data docs/perf.md is rendered from.

A record says what ran (the command line), on which code (the commit, and whether the tree differed
from it), when, on which machine, and what it measured: figures, each with its unit, the floor or
ceiling measured in the same run (its anchor) and the ratio to it, and the target a figure has (a
threshold on the figure or on that ratio, and whether the run met it). A figure belongs to a target
(one table of docs/perf.md) and a case (one row of it). `atomrt bench report`
(runtime/bench/report.py) renders the newest figure of each (target, case, machine kind).

Every `atomrt bench` subcommand, and the kept scripts in benchmarks/ with figures in docs/perf.md,
take `--record [DIR]`; without DIR the record goes to the checkout's benchmarks/results/, found from
the current directory (never next to an installed package). The schema is versioned: a reader
refuses a record of a version it does not know.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from atomrt.runtime.envs import ENV

SCHEMA_VERSION = 1
RESULTS = Path("benchmarks") / "results"  # a checkout's records, from its root
GIT_TIMEOUT_S = 10.0
# Paths whose changes leave what a bench measures as it was: not counted as a dirty tree.
NOT_MEASURED = (":(exclude)benchmarks/results", ":(exclude)docs", ":(exclude)*.md")
RATIO_TOLERANCE = 0.02  # a stated ratio against value / anchor, both rounded


class RecordError(ValueError):
    """A record that does not load or validate; the message names the file and the field."""


@dataclass(frozen=True)
class Quantity:
    value: float
    unit: str


@dataclass(frozen=True)
class Threshold:
    """A target: the figure (`of="value"`) or its ratio to the anchor (`of="ratio"`) `op` `value`."""

    op: str  # "<=" or ">="
    value: float
    of: str = "value"

    def judge(self, value: float, ratio: Optional[float]) -> Optional[bool]:
        x = value if self.of == "value" else ratio
        if x is None:
            return None
        return x <= self.value if self.op == "<=" else x >= self.value


@dataclass
class Figure:
    target: str  # the table it belongs to: "decode-step"
    case: str  # its row: "SmolLM2-135M bs=1 FULL+async"
    value: float
    unit: str
    anchor: Optional[float] = None  # floor / ceiling / baseline of the same run, in `unit`
    anchor_name: Optional[str] = None  # "true floor", "cuBLAS", "offline engine", ...
    ratio: Optional[float] = None  # value / anchor
    threshold: Optional[Threshold] = None
    met: Optional[bool] = None
    extra: dict[str, Quantity] = field(default_factory=dict)  # a few figures beside it


def figure(
    target: str,
    case: str,
    value: float,
    unit: str,
    *,
    anchor: Optional[float] = None,
    anchor_name: Optional[str] = None,
    threshold: Optional[Threshold] = None,
    extra: Optional[dict[str, Quantity]] = None,
) -> Figure:
    """A figure with its ratio to the anchor and its verdict worked out."""
    ratio = round(value / anchor, 4) if anchor else None
    met = threshold.judge(value, ratio) if threshold is not None else None
    return Figure(
        target, case, value, unit, anchor, anchor_name, ratio, threshold, met, dict(extra or {})
    )


@dataclass(frozen=True)
class Machine:
    kind: str  # what `atomrt bench report` keeps one current figure per: "H200", "2-core CPU"
    gpu: Optional[str]
    gpu_count: int
    cpu: Optional[str]
    cpu_cores: Optional[int]
    torch: Optional[str]
    triton: Optional[str]
    cuda: Optional[str]
    python: Optional[str]


@dataclass
class Record:
    bench: str  # "latency", or a script's name: "bench_prefill"
    command: str  # the command line, with the environment variables that change what it measures
    date: str  # ISO 8601, UTC ("2026-12-04T10:21:07Z"; a record moved from prose: the day)
    commit: Optional[str]  # None: the code was not in a git checkout
    dirty: Optional[bool]  # the measured code differed from the commit; None: unknown
    machine: Machine
    figures: list[Figure]
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # the bench's supporting numbers
    schema: int = SCHEMA_VERSION


def machine_kind(gpu: Optional[str], gpu_count: int, cpu_cores: Optional[int]) -> str:
    if gpu_count:
        name = (gpu or "GPU").removeprefix("NVIDIA ").strip()
        return name if gpu_count == 1 else f"{gpu_count}×{name}"
    return f"{cpu_cores or '?'}-core CPU"


def _cpu_model() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def this_machine(on_gpu: bool) -> Machine:
    """The machine the run used; `on_gpu` False: a CPU run, whatever GPUs the host has."""
    import torch

    gpu, count = None, 0
    if on_gpu and torch.cuda.is_available():
        gpu, count = torch.cuda.get_device_name(0), torch.cuda.device_count()
    cores = os.cpu_count()
    return Machine(
        kind=machine_kind(gpu, count, cores),
        gpu=gpu,
        gpu_count=count,
        cpu=_cpu_model(),
        cpu_cores=cores,
        torch=torch.__version__,
        triton=_version("triton"),
        cuda=torch.version.cuda,
        python=platform.python_version(),
    )


def _git(root: Path, *args: str) -> Optional[str]:
    try:
        proc = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def source_commit() -> tuple[Optional[str], Optional[bool]]:
    """The commit of the atomrt code this process runs and whether its tree differs from it
    (docs, *.md and benchmarks/results/ left out). ATOMRT_BENCH_COMMIT names the commit of a
    copy without git; its dirtiness is then unknown."""
    if ENV.bench_commit:
        return ENV.bench_commit, None
    root = Path(__file__).resolve().parents[2]  # runtime/bench/records.py -> the source root
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:  # an install, or inside another repository
        return None, None
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *NOT_MEASURED)
    return commit, None if status is None else bool(status)


def command_line(program: str, argv: Sequence[str]) -> str:
    env = [f"{k}={shlex.quote(v)}" for k, v in ENV.recorded_by_benches]
    return " ".join([*env, program, *(shlex.quote(a) for a in argv)])


# ------------------------------------------------------------------ the --record flag


def add_record_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--record",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="write this run's record (one JSON file) into DIR; without DIR into benchmarks/"
        "results/ of the checkout the command runs in (docs/perf.md is rendered from there)",
    )


def checkout_root(start: Optional[Path] = None) -> Optional[Path]:
    """The nearest folder at or above `start` (the current directory) holding benchmarks/results/."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / RESULTS).is_dir():
            return folder
    return None


def resolve_record_flag(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Turn `args.record` into the folder `--record` writes to (a str, so that args stay JSON),
    or None when it was not given; a bare `--record` outside a checkout is a usage error, raised
    before the run."""
    if args.record is None or args.record:
        return
    root = checkout_root()
    if root is None:
        parser.error(
            f"--record without a folder writes into {RESULTS}/ of the checkout the command runs "
            f"in, and no folder at or above {Path.cwd()} holds one: give --record DIR"
        )
    args.record = str(root / RESULTS)


def save(
    folder: str | Path,
    bench: str,
    argv: Sequence[str],
    figures: Iterable[Figure],
    *,
    on_gpu: bool,
    program: Optional[str] = None,
    notes: Iterable[str] = (),
    details: Optional[dict[str, Any]] = None,
) -> Optional[Path]:
    """Write the record of a run that measured `figures`, and say where; a run that measured
    nothing (every model failed) says so and writes none."""
    figures, notes = _finite(list(figures), list(notes))
    if not figures:
        print("record: the run measured no figure; nothing written", flush=True)
        return None
    commit, dirty = source_commit()
    record = Record(
        bench=bench,
        command=command_line(program or f"atomrt bench {bench}", argv),
        date=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        commit=commit,
        dirty=dirty,
        machine=this_machine(on_gpu),
        figures=figures,
        notes=list(notes),
        details=dict(details or {}),
    )
    path = write_record(Path(folder), record)
    print(f"record: {path}", flush=True)
    return path


def _finite(figures: list[Figure], notes: list[str]) -> tuple[list[Figure], list[str]]:
    """The figures with a finite value, each without the extras that are not finite (a run whose
    requests made no second token has no TPOT): what was left out is said in the notes, and the
    other figures are written."""
    kept = []
    for f in figures:
        if not math.isfinite(f.value):
            notes.append(f"{f.target} / {f.case}: not measured (value {f.value!r})")
            continue
        bad = [k for k, q in f.extra.items() if not math.isfinite(q.value)]
        for k in bad:
            notes.append(f"{f.target} / {f.case}: {k} not measured ({f.extra.pop(k).value!r})")
        if f.anchor is not None and not math.isfinite(f.anchor):
            notes.append(f"{f.target} / {f.case}: anchor not measured ({f.anchor!r})")
            f.anchor = f.ratio = f.met = None
        kept.append(f)
    return kept, notes


def file_name(record: Record) -> str:
    parts = [
        record.date.replace(":", ""),
        record.bench,
        record.machine.kind,
        (record.commit or "nocommit")[:7],
    ]
    return re.sub(r"[^\w.-]+", "_", "-".join(parts).replace("×", "x")) + ".json"


def write_record(folder: Path, record: Record) -> Path:
    data = asdict(record)
    data = {"schema": data.pop("schema"), **data}  # the version first, for a reader
    parse_record(data, "the record to write")  # what is written loads back
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(record)
    n = 2
    while path.exists():
        path = folder / f"{file_name(record)[: -len('.json')]}-{n}.json"
        n += 1
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return path


def load_records(folder: Path) -> list[tuple[Path, Record]]:
    """Every record in `folder`, oldest first (`age`)."""
    out = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RecordError(f"{path}: not JSON: {e}") from None
        out.append((path, parse_record(data, str(path))))
    return sorted(out, key=lambda pr: age(*pr))


def age(path: Path, record: Record) -> tuple[str, str]:
    """What orders records, oldest first: the date, then the file's name (a day's records moved
    from prose carry their order there)."""
    return record.date, path.stem


# ------------------------------------------------------------------ validation

_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}:\d{2}Z)?$")


def _fields(data: Any, cls: type, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise RecordError(f"{where}: expected an object, got {type(data).__name__}")
    names = set(cls.__dataclass_fields__)
    unknown = sorted(set(data) - names)
    if unknown:
        raise RecordError(f"{where}: unknown fields {unknown}")
    return data


def _get(data: dict, key: str, types: tuple, where: str, required: bool = True) -> Any:
    if key not in data or data[key] is None:
        if required:
            raise RecordError(f"{where}.{key}: missing")
        return None
    value = data[key]
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = "/".join(t.__name__ for t in types)
        raise RecordError(f"{where}.{key}: expected {names}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise RecordError(f"{where}.{key}: not a finite number: {value!r}")
    return value


_NUM = (int, float)


def _quantity(data: Any, where: str) -> Quantity:
    d = _fields(data, Quantity, where)
    return Quantity(_get(d, "value", _NUM, where), _get(d, "unit", (str,), where))


def _threshold(data: Any, where: str) -> Threshold:
    d = _fields(data, Threshold, where)
    t = Threshold(
        op=_get(d, "op", (str,), where),
        value=_get(d, "value", _NUM, where),
        of=_get(d, "of", (str,), where, required=False) or "value",
    )
    if t.op not in ("<=", ">=") or t.of not in ("value", "ratio"):
        raise RecordError(f"{where}: op is <= or >=, of is value or ratio: got {t}")
    return t


def _figure(data: Any, where: str) -> Figure:
    d = _fields(data, Figure, where)
    f = Figure(
        target=_get(d, "target", (str,), where),
        case=_get(d, "case", (str,), where),
        value=_get(d, "value", _NUM, where),
        unit=_get(d, "unit", (str,), where),
        anchor=_get(d, "anchor", _NUM, where, required=False),
        anchor_name=_get(d, "anchor_name", (str,), where, required=False),
        ratio=_get(d, "ratio", _NUM, where, required=False),
        met=_get(d, "met", (bool,), where, required=False),
    )
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", f.target) or not f.case.strip():
        raise RecordError(f"{where}: target is lower-case words joined by '-', case is text")
    if d.get("threshold") is not None:
        f.threshold = _threshold(d["threshold"], f"{where}.threshold")
    extra = _get(d, "extra", (dict,), where, required=False) or {}
    f.extra = {k: _quantity(v, f"{where}.extra.{k}") for k, v in extra.items()}
    if f.anchor is not None and f.ratio is not None and f.anchor:
        if abs(f.ratio - f.value / f.anchor) > RATIO_TOLERANCE * abs(f.value / f.anchor):
            raise RecordError(f"{where}: ratio {f.ratio} is not value / anchor")
    verdict = f.threshold.judge(f.value, f.ratio) if f.threshold else None
    if f.met != verdict:
        raise RecordError(f"{where}: met is {f.met}, the threshold says {verdict}")
    return f


def parse_record(data: Any, where: str) -> Record:
    """A record from its JSON object, every field checked; RecordError names what is wrong."""
    d = _fields(data, Record, where)
    version = _get(d, "schema", (int,), where)
    if version != SCHEMA_VERSION:
        raise RecordError(f"{where}: schema {version}; this atomrt reads {SCHEMA_VERSION}")
    m = _fields(d.get("machine"), Machine, f"{where}.machine")
    w = f"{where}.machine"
    machine = Machine(
        kind=_get(m, "kind", (str,), w),
        gpu=_get(m, "gpu", (str,), w, required=False),
        gpu_count=_get(m, "gpu_count", (int,), w),
        cpu=_get(m, "cpu", (str,), w, required=False),
        cpu_cores=_get(m, "cpu_cores", (int,), w, required=False),
        torch=_get(m, "torch", (str,), w, required=False),
        triton=_get(m, "triton", (str,), w, required=False),
        cuda=_get(m, "cuda", (str,), w, required=False),
        python=_get(m, "python", (str,), w, required=False),
    )
    date = _get(d, "date", (str,), where)
    if not _DATE.match(date):
        raise RecordError(f"{where}.date: expected 2026-12-04 or 2026-12-04T10:21:07Z: {date!r}")
    figures = _get(d, "figures", (list,), where)
    if not figures:
        raise RecordError(f"{where}.figures: a record holds at least one figure")
    notes = _get(d, "notes", (list,), where, required=False) or []
    if not all(isinstance(n, str) for n in notes):
        raise RecordError(f"{where}.notes: expected a list of strings")
    return Record(
        bench=_get(d, "bench", (str,), where),
        command=_get(d, "command", (str,), where),
        date=date,
        commit=_get(d, "commit", (str,), where, required=False),
        dirty=_get(d, "dirty", (bool,), where, required=False),
        machine=machine,
        figures=[_figure(f, f"{where}.figures[{i}]") for i, f in enumerate(figures)],
        notes=notes,
        details=_get(d, "details", (dict,), where, required=False) or {},
        schema=version,
    )

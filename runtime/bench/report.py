"""`atomrt bench report`: docs/perf.md rendered from the bench records, and a target's history.

    atomrt bench report [--results DIR] [--template FILE] [--out FILE | --check]
    atomrt bench report --history TARGET [--case TEXT] [--machine KIND] [--plot PNG]

The page is the template (benchmarks/results/perf-template.md: the hand-written preface and notes)
with every `{{table TARGET}}` line replaced by that target's table (`{{table TARGET cases REGEX}}`:
only the cases REGEX finds, for a sweep too long for the page; the template says so), and a table for each target the
template does not place appended at the end. A table holds the newest figure of each (case,
machine kind): figure, anchor (the floor or ceiling of the same run) and ratio, target and
verdict, and the run it came from (date, commit, machine, the command, the record), grouped by run,
newest run first. `--check` renders and compares with the page instead of writing it (exit 1 when
they differ). `--history` prints every figure of one target, oldest first, and plots it with
`--plot`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Optional

from atomrt.runtime.bench.records import (
    RESULTS,
    Figure,
    Record,
    RecordError,
    age,
    checkout_root,
    load_records,
)

TEMPLATE = "perf-template.md"  # in the results folder
PAGE = Path("docs") / "perf.md"  # from the checkout's root
PLACEHOLDER = re.compile(r"^\{\{table ([a-z0-9][a-z0-9.-]*)(?: cases ([^}]+))?\}\}$")
DITTO = "〃"

Entry = tuple[Path, Record, Figure]


def _natural(text: str) -> tuple:
    """Sort key that orders the numbers in a case by value: bs=8 before bs=32."""
    return tuple(
        (0, float(p), "") if i % 2 else (1, 0.0, p)
        for i, p in enumerate(re.split(r"(\d+(?:\.\d+)?)", text))
    )


def current(records: Sequence[tuple[Path, Record]]) -> dict[str, list[Entry]]:
    """The newest figure of each (target, case, machine kind), by target."""
    newest: dict[tuple[str, str, str], Entry] = {}
    for path, record in records:  # oldest first: a newer record replaces
        for f in record.figures:
            newest[(f.target, f.case, record.machine.kind)] = (path, record, f)
    out: dict[str, list[Entry]] = {}
    for (target, _, _), entry in newest.items():
        out.setdefault(target, []).append(entry)
    return out


def _num(x: float) -> str:
    return format(x, ".6g")


def _ratio(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.3g}×"


def _quantity(value: float, unit: str) -> str:
    return f"{_num(value)}{unit}" if unit in ("×", "%") else f"{_num(value)} {unit}"


def _figure_cell(f: Figure) -> str:
    text = _quantity(f.value, f.unit)
    if f.extra:
        text += " (" + ", ".join(f"{k} {_quantity(q.value, q.unit)}" for k, q in f.extra.items())
        text += ")"
    return text


def _target_cell(f: Figure) -> str:
    t = f.threshold
    if t is None:
        return "—"
    op = "≤" if t.op == "<=" else "≥"
    bound = f"{_num(t.value)}×" if t.of == "ratio" else _quantity(t.value, f.unit)
    verdict = {True: "met", False: "**not met**", None: "not judged"}[f.met]
    return f"{op} {bound}: {verdict}"


def _commit_cell(r: Record) -> str:
    if r.commit is None:
        return "—"
    return r.commit[:7] + (" (dirty)" if r.dirty else "")


def _command_cell(path: Path, r: Record, link_from: Path) -> str:
    link = Path(os.path.relpath(path, link_from)).as_posix()
    text = f"`{r.command}` · [record]({link})"
    if r.notes:
        text += " · " + "; ".join(r.notes)
    return text


def _row(cells: list[str]) -> str:
    """A table row; a `|` in a cell (a command's shell pipe) is escaped, not a column."""
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def table(entries: Sequence[Entry], link_from: Path) -> list[str]:
    """One target's table: rows grouped by run, newest run first, cases in natural order."""
    figs = [f for _, _, f in entries]
    anchors = {f.anchor_name for f in figs if f.anchor is not None or f.ratio is not None}
    cols = ["case", "figure"]
    if anchors:
        cols.append(next(iter(anchors)) if len(anchors) == 1 and None not in anchors else "anchor")
    has_ratio = any(f.ratio is not None for f in figs)
    has_target = any(f.threshold is not None for f in figs)
    cols += ["ratio"] * has_ratio + ["target"] * has_target
    cols += ["date", "commit", "machine", "command"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    order = sorted(entries, key=lambda e: age(e[0], e[1]), reverse=True)
    groups: dict[Path, list[Entry]] = {}
    for e in order:
        groups.setdefault(e[0], []).append(e)
    for path, group in groups.items():
        group.sort(key=lambda e: _natural(e[2].case))
        for i, (_, r, f) in enumerate(group):
            row = [f.case, _figure_cell(f)]
            if anchors:
                anchor = "—" if f.anchor is None else _quantity(f.anchor, f.unit)
                if len(anchors) > 1 and f.anchor_name:
                    anchor += f" ({f.anchor_name})"
                row.append(anchor)
            if has_ratio:
                row.append(_ratio(f.ratio))
            if has_target:
                row.append(_target_cell(f))
            if i == 0:
                row += [r.date[:10], _commit_cell(r), r.machine.kind]
                row.append(_command_cell(path, r, link_from))
            else:
                row += [DITTO] * 4
            lines.append(_row(row))
    return lines


def render(results: Path, template: Path, page: Path) -> str:
    """The page `page` (docs/perf.md) as the records in `results` and the template make it."""
    by_target = current(load_records(results))
    link_from = page.parent
    out: list[str] = []
    placed: set[str] = set()
    for line in template.read_text().splitlines():
        m = PLACEHOLDER.match(line.strip())
        if m is None:
            out.append(line)
            continue
        target, cases = m.groups()
        placed.add(target)
        entries = by_target.get(target, [])
        if cases is not None:  # a long sweep: the page shows some cases, the records keep all
            entries = [e for e in entries if re.search(cases, e[2].case)]
        out += table(entries, link_from) if entries else ["_No record yet._"]
    rest = sorted(set(by_target) - placed)
    if rest:
        out += ["", "## Other targets"]
        for target in rest:
            out += ["", f"### `{target}`", "", *table(by_target[target], link_from)]
    return "\n".join(out).rstrip("\n") + "\n"


# ------------------------------------------------------------------ history


def history(
    records: Sequence[tuple[Path, Record]], target: str, case: str, machine: str
) -> list[Entry]:
    """Every figure of `target` (case and machine kind containing the given text), by case,
    machine kind and date."""
    rows = [
        (path, r, f)
        for path, r in records
        for f in r.figures
        if f.target == target and case in f.case and machine in r.machine.kind
    ]
    return sorted(rows, key=lambda e: (_natural(e[2].case), e[1].machine.kind, age(e[0], e[1])))


def history_table(entries: Sequence[Entry]) -> list[str]:
    lines = ["| case | machine | date | commit | figure | anchor | ratio | target |"]
    lines.append("|" + "---|" * 8)
    for _, r, f in entries:
        anchor = "—" if f.anchor is None else _quantity(f.anchor, f.unit)
        row = [f.case, r.machine.kind, r.date, _commit_cell(r), _figure_cell(f), anchor]
        row.append(_ratio(f.ratio))
        lines.append(_row([*row, _target_cell(f)]))
    return lines


def _when(date: str) -> datetime:
    """A record's date as a naive UTC datetime (a day alone: its midnight)."""
    return datetime.fromisoformat(date.rstrip("Z") if "T" in date else date + "T00:00")


def plot_history(entries: Sequence[Entry], target: str, path: Path) -> None:
    """One line per (case, machine kind): the figure against the date of its run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[datetime, float]]] = {}
    for _, r, f in entries:
        series.setdefault(f"{f.case} ({r.machine.kind})", []).append((_when(r.date), f.value))
    fig, ax = plt.subplots(figsize=(9, 5))
    for label, points in series.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_title(f"{target}: history")
    ax.set_ylabel(entries[0][2].unit)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.autofmt_xdate()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------ the command


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="atomrt bench report", description=__doc__.splitlines()[0])
    p.add_argument(
        "--results", default=None, help=f"the records (default: the checkout's {RESULTS})"
    )
    p.add_argument("--template", default=None, help=f"default: {TEMPLATE} in the records' folder")
    p.add_argument(
        "--out", default=None, help=f"the page to write (default: the checkout's {PAGE})"
    )
    p.add_argument(
        "--check", action="store_true", help="compare with the page; exit 1 if it differs"
    )
    p.add_argument("--history", metavar="TARGET", help="print every figure of TARGET over time")
    p.add_argument("--case", default="", help="with --history: cases containing this text")
    p.add_argument("--machine", default="", help="with --history: machine kinds containing this")
    p.add_argument("--plot", default=None, metavar="PNG", help="with --history: plot it here")
    args = p.parse_args(argv)
    if args.history is None and (args.case or args.machine or args.plot):
        p.error("--case, --machine and --plot go with --history TARGET")
    if args.history is not None and (args.check or args.out):
        p.error("--history prints a target's records; --check and --out are for the page")
    root = checkout_root()
    if root is None and (args.results is None or (args.history is None and args.out is None)):
        p.error(
            f"outside a checkout (no {RESULTS}/ at or above {Path.cwd()}): give --results "
            "(and --out for the page)"
        )
    args.results = Path(args.results) if args.results else root / RESULTS
    args.template = Path(args.template) if args.template else args.results / TEMPLATE
    args.out = Path(args.out) if args.out else (root / PAGE if root else None)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    try:
        if args.history is not None:
            return _print_history(args)
        text = render(args.results, args.template, args.out)
    except (RecordError, OSError) as e:
        print(f"atomrt bench report: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        old = args.out.read_text() if args.out.exists() else ""
        if old == text:
            print(f"{args.out} is what the records render")
            return 0
        diff = difflib.unified_diff(
            old.splitlines(), text.splitlines(), str(args.out), "rendered", lineterm="", n=1
        )
        print("\n".join(list(diff)[:60]))
        print(f"{args.out} differs from what the records render: run `atomrt bench report`")
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({text.count(chr(10))} lines)")
    return 0


def _print_history(args: argparse.Namespace) -> int:
    records = load_records(args.results)
    entries = history(records, args.history, args.case, args.machine)
    if not entries:
        known = sorted({f.target for _, r in records for f in r.figures})
        print(
            f"atomrt bench report: no figure of {args.history!r} matches; targets: {known}",
            file=sys.stderr,
        )
        return 2
    print("\n".join(history_table(entries)))
    if args.plot:
        plot_history(entries, args.history, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

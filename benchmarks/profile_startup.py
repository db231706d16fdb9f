"""Where a start-up's time goes: two processes build the same model on one fresh compile cache and
one fresh Triton cache (cold, then warm, as `atomrt bench startup` does), each under cProfile.

    python benchmarks/profile_startup.py [--model SmolLM2-135M] [--load-format dummy] [--out DIR]
        [--runs cold,warm] [--top 45]

Per run it prints the phases (process start to first token, as `atomrt bench startup` names them),
the import split into torch, triton and atomrt, and the functions with the most cumulative and the
most own time; with --out it also keeps each run's pstats file (`python -m pstats FILE`). cProfile
slows Python-heavy phases (Dynamo's tracing most), so read shares from it and seconds from the bench.
For the imports alone: `python -X importtime -c "import atomrt.runtime.entrypoints.llm"`.
"""

from __future__ import annotations

import time

SPAWNED = time.time()  # close to the interpreter's start: nothing is imported before this line

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402


def child(args: argparse.Namespace) -> None:
    """One start-up under cProfile: imports, LLM construction, one request's first token."""
    prof = cProfile.Profile()
    prof.enable()
    marks = [("interpreter (process start to this script)", SPAWNED - args.spawned_at)]
    t = time.time()
    import torch  # noqa: F401

    marks.append(("import torch", time.time() - t))
    t = time.time()
    import triton  # noqa: F401

    marks.append(("import triton", time.time() - t))
    t = time.time()
    from atomrt.runtime.config import CompilationConfig
    from atomrt.runtime.entrypoints.llm import LLM
    from atomrt.runtime.sampling_params import SamplingParams

    marks.append(("import atomrt (entrypoints.llm)", time.time() - t))
    t = time.time()
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        compilation_config=CompilationConfig(level=3, cache_dir=args.cache_dir),
    )
    built = time.time()
    worker = list(llm.engine.info.startup_phases)
    marks += [(f"  {name}", seconds) for name, seconds in worker]
    marks.append(("  processes, groups, engine", built - t - sum(s for _, s in worker)))
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1), use_tqdm=False)
    first = time.time()
    prof.disable()
    marks.append(("first token (one request's prefill)", first - built))
    marks.append(("total: process start to first token", first - args.spawned_at))
    llm.shutdown()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    if args.pstats:
        stats.dump_stats(args.pstats)
    print("PHASES " + json.dumps(marks), flush=True)
    print(buf.getvalue(), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="SmolLM2-135M")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--runs", default="cold,warm", help="cold, warm or both, in order")
    ap.add_argument("--top", type=int, default=45, help="functions per cProfile table")
    ap.add_argument("--out", default="", help="a folder for each run's pstats and report")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--spawned-at", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--pstats", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="atomrt-profile-startup-") as tmp:
        root = Path(tmp)
        env = dict(os.environ, TRITON_CACHE_DIR=str(root / "triton"))
        summary = {}
        for run in args.runs.split(","):
            env["TORCHINDUCTOR_CACHE_DIR"] = str(root / f"inductor_{run}")
            cmd = [
                sys.executable, __file__, "--child", "--model", args.model,
                "--load-format", args.load_format, "--cache-dir", str(root / "compile_cache"),
                "--top", str(args.top), "--spawned-at", str(time.time()),
            ]  # fmt: skip
            if out:
                cmd += ["--pstats", str(out / f"startup-{run}.pstats")]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise SystemExit(
                    f"{run} start-up failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
                )
            report = proc.stdout
            if out:
                (out / f"startup-{run}.txt").write_text(report + "\n" + proc.stderr[-20000:])
            phases = next(line for line in report.splitlines() if line.startswith("PHASES "))
            summary[run] = json.loads(phases[len("PHASES ") :])
            print(f"==== {run} start-up under cProfile ====\n{report}", flush=True)
    runs = list(summary)
    print("phase".ljust(60) + "".join(f"{r:>10}" for r in runs))
    for i, (name, _) in enumerate(summary[runs[0]]):
        print(name[:59].ljust(60) + "".join(f"{summary[r][i][1]:9.2f}s" for r in runs))


if __name__ == "__main__":
    main()

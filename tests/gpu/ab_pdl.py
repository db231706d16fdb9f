"""Programmatic dependent launch off and on, alternating, in one process: `atomrt bench latency` rows
for each setting (figures from different GPU calls land on different machines and can differ by
more than the change).

    python tests/gpu/ab_pdl.py [--model SmolLM2-135M:1,Llama-3.2-1B:32] [--rounds 2] [--out DIR]
        [-- extra bench latency args]
Each (model:batch size) runs FULL+async at level 3, PDL off then on, `--rounds` times. The first
round of each setting compiles; later rounds load the compile cache (its key includes the setting).
Prints one summary line per model: the median of each setting's rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from atomrt.compile import backends, cache
from atomrt.runtime import bench_latency
from atomrt.workers.kernels import device_info


def set_pdl(on: bool) -> None:
    env = dataclasses.replace(device_info.ENV, pdl=on)
    for module in (device_info, backends, cache):
        module.ENV = env


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="SmolLM2-135M:1,Llama-3.2-1B:32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="/tmp/ab_pdl")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    out = Path(a.out)
    import torch
    import triton
    from torch._inductor import config as inductor_config

    print(f"torch {torch.__version__}, triton {triton.__version__}, Inductor PDL codegen: "
          f"{hasattr(inductor_config.triton, 'enable_pdl')}", flush=True)
    summary = []
    for spec in a.model.split(","):
        model, bs = spec.split(":")
        medians: dict[bool, list[float]] = {False: [], True: []}
        for rnd in range(a.rounds):
            for on in (False, True):
                set_pdl(on)
                path = out / f"{model}_bs{bs}_pdl{int(on)}_r{rnd}.json"
                print(f"== {model} bs={bs} pdl={'on' if on else 'off'} round {rnd}", flush=True)
                bench_latency.main(["--model", model, "--level", "3", "--modes", "FULL+async",
                                    "--batch-sizes", bs, "--json", str(path), *a.extra])
                rows = json.loads(path.read_text())["rows"]
                medians[on] += [r["ms_median"] for r in rows]
        off, on_ = statistics.median(medians[False]), statistics.median(medians[True])
        summary.append(f"{model} bs={bs}: PDL off {off:.3f} ms {medians[False]}, on {on_:.3f} ms {medians[True]} "
                       f"({(on_ / off - 1) * 100:+.1f}%)")
    print("\n".join(summary))


if __name__ == "__main__":
    main()

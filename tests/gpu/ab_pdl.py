"""Programmatic dependent launch off and on, alternating, in one process (figures from different GPU
calls land on different machines and can differ by more than the change).

    python tests/gpu/ab_pdl.py [--model SmolLM2-135M:1,Llama-3.2-1B:32] [--rounds 2] [--decode-steps 64]
For each (model:batch size), FULL+async at level 3, PDL off then on, `--rounds` times, one LLM each:
- the decode step as `atomrt bench latency` times it (median ms over --decode-steps steps);
- the bucket's request graph replayed 50 times back to back: GPU us per replay (the step's GPU
  work alone, with the host out of the way) and host us per replay call.
The first round of each setting compiles; later rounds load the compile cache (its key includes the
setting). Prints one summary line per model: the median of each setting's figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import re
import statistics
import time

import numpy as np
import torch

from atomrt.runtime import envs
from atomrt.runtime.bench import latency as bench_latency
from atomrt.runtime.entrypoints.llm import LLM
from profile_step import replay_costs


def set_pdl(on: bool) -> None:
    envs.ENV = dataclasses.replace(envs.ENV, pdl=on)


def measure(model: str, bs: int, args: argparse.Namespace) -> tuple[float, float, float]:
    """(step ms, replay GPU us, replay host us) of one fresh LLM."""
    t = time.perf_counter()
    llm = LLM(model, load_format="dummy", max_num_seqs=bs, cuda_graph_sizes=[bs],
              **bench_latency.mode_settings("FULL+async", 3, True))
    try:
        print(f"   built in {time.perf_counter() - t:.1f} s", flush=True)
        step_ms = float(np.median(bench_latency.time_decode(llm, bs, args, seed=bs))) * 1e3
        replay = replay_costs(llm.engine, bs)
        host, gpu = (float(x) for x in re.findall(r"([\d.]+) us", replay))
        return step_ms, gpu, host
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="SmolLM2-135M:1,Llama-3.2-1B:32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--warmup-steps", type=int, default=8)
    a = ap.parse_args()
    import triton
    from torch._inductor import config as inductor_config

    print(f"torch {torch.__version__}, triton {triton.__version__}, Inductor PDL codegen: "
          f"{hasattr(inductor_config.triton, 'enable_pdl')}", flush=True)
    summary = []
    for spec in a.model.split(","):
        model, bs = spec.split(":")
        figures: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for rnd in range(a.rounds):
            for on in (False, True):
                set_pdl(on)
                step, gpu, host = measure(model, int(bs), a)
                figures[on].append((step, gpu, host))
                print(f"== {model} bs={bs} pdl={'on' if on else 'off'} round {rnd}: step {step:.3f} ms, "
                      f"graph replay GPU {gpu:.1f} us, host {host:.1f} us", flush=True)
        med = {on: [statistics.median(f[i] for f in figures[on]) for i in range(3)] for on in (False, True)}
        summary.append(
            f"{model} bs={bs}: step ms off {med[False][0]:.3f} on {med[True][0]:.3f}; "
            f"replay GPU us off {med[False][1]:.1f} on {med[True][1]:.1f} ({(med[True][1] / med[False][1] - 1) * 100:+.1f}%); "
            f"replay host us off {med[False][2]:.1f} on {med[True][2]:.1f}"
        )
    print("\n".join(summary))


if __name__ == "__main__":
    main()

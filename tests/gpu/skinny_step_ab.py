"""One decode-step setting of the skinny GEMM, in its own process (not a test; GPU machine):

    python tests/gpu/skinny_step_ab.py --setting cublas|skinny [--model Llama-3.1-8B] [--bs 1]
        [--max-weight-elems 33554432] [--sweep-json sweep.json]

`skinny` lets the skinny GEMM take weights below --max-weight-elems (the add + RMSNorm before a
projection then run in its prologue) and adds the sweep's best configs (sweep_gemm.py --json) for
the shapes where they beat cuBLAS; `cublas` is the default threshold and table. Prints the step's
median ms as `atomrt bench latency` times it and the request graph's replay GPU us (50 replays of
the bucket staged with a one-key context, so its attention is shorter than the step's). Give each
setting its own ATOMRT_CACHE_ROOT: the cache directory's hash does not cover the threshold, which
decides the traced graph's shape, so two settings in one root would recompile over each other's
artifacts (each piece's fingerprint keeps the wrong one from loading).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from atomrt.runtime import bench_latency
from atomrt.runtime.llm import LLM
from atomrt.workers.kernels import skinny_gemm
from atomrt.workers.layers import linear
from profile_step import replay_costs


def apply_skinny(max_weight_elems: int, sweep_json: str) -> list[str]:
    """Raise the threshold (both modules' copies) and add the sweep's winning configs; what was added."""
    skinny_gemm.SKINNY_MAX_WEIGHT_ELEMS = linear.SKINNY_MAX_WEIGHT_ELEMS = max_weight_elems
    added = []
    if sweep_json:
        with open(sweep_json) as f:
            for s in json.load(f)["summaries"]:
                if s["best"] and s["best_us"] < s["cublas_us"]:
                    key = (skinny_gemm.bucket_m(s["m"]), s["n"], s["k"])
                    skinny_gemm.CONFIGS[key] = skinny_gemm.SkinnyConfig(**s["best"])
                    added.append(f"{key}: {skinny_gemm.CONFIGS[key]} "
                                 f"({s['best_us']:.2f} vs cuBLAS {s['cublas_us']:.2f} us)")
    return added


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setting", choices=("cublas", "skinny"), required=True)
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--max-weight-elems", type=int, default=1 << 25)
    ap.add_argument("--sweep-json", default="")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--warmup-steps", type=int, default=8)
    a = ap.parse_args()
    if a.setting == "skinny":
        for line in apply_skinny(a.max_weight_elems, a.sweep_json):
            print("config", line)
    llm = LLM(a.model, load_format="dummy", max_num_seqs=a.bs, cuda_graph_sizes=[a.bs],
              **bench_latency.mode_settings("FULL+async", 3, True))
    try:
        step_ms = float(np.median(bench_latency.time_decode(llm, a.bs, a, seed=a.bs))) * 1e3
        replay = replay_costs(llm.engine, a.bs)
        print(f"== {a.model} bs={a.bs} {a.setting}: step {step_ms:.3f} ms; {replay}", flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()

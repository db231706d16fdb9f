"""One decode-step setting of the skinny GEMM, in its own process (not a test; GPU machine):

    python tests/gpu/skinny_step_ab.py --setting default|skinny [--model Llama-3.1-8B] [--bs 1]
        [--max-weight-elems 33554432] [--sweep-json a.json,b.json] [--stats-values V] [--kernels]
        [--gated-max-weight-elems N]

`skinny` lets the skinny GEMM take weights below --max-weight-elems at every batch size up to 4
(one threshold for SKINNY_MAX_WEIGHT_ELEMS and SKINNY_M1_MAX_WEIGHT_ELEMS; the add + RMSNorm before
a projection then run in its prologue) and adds the sweeps' best configs (sweep_gemm.py --json, one
file or several, comma-separated; a later file's entry replaces an earlier one's) for the shapes
where they beat cuBLAS; `default` is the default thresholds and table (for Llama-3.1-8B's weights
the skinny GEMM at bs=1, cuBLAS above). --stats-values sets
skinny_gemm.NORM_STATS_VALUES (the prologue's statistics pass; 0: one K tile per step). Prints the
step's median ms as `atomrt bench latency` times it and the request graph's replay GPU us (50
replays of the bucket staged with a one-key context, so its attention is shorter than the step's);
--kernels adds the step's kernel table (profile_step.kernel_table, 20 steps).
--gated-max-weight-elems (skinny only) sets layers/linear.GATED_MAX_WEIGHT_ELEMS: down projections
up to that size take the gated MLP's SiLU-and-mul in their prologue. Give each
setting its own ATOMRT_CACHE_ROOT: the cache directory's hash does not cover the threshold, which
decides the traced graph's shape, so two settings in one root would recompile over each other's
artifacts (each piece's fingerprint keeps the wrong one from loading).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from atomrt.runtime.bench import latency as bench_latency
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import SamplingParams
from atomrt.workers.kernels.gemm import skinny_configs
from atomrt.workers.kernels.gemm import skinny_gemm
from atomrt.workers.layers import linear
from profile_step import kernel_table, replay_costs


def apply_skinny(max_weight_elems: int, sweep_jsons: str) -> list[str]:
    """Raise the threshold and add the sweeps' winning configs; what was added."""
    skinny_gemm.SKINNY_MAX_WEIGHT_ELEMS = skinny_gemm.SKINNY_M1_MAX_WEIGHT_ELEMS = max_weight_elems
    added = []
    for sweep_json in filter(None, sweep_jsons.split(",")):
        with open(sweep_json) as f:
            for s in json.load(f)["summaries"]:
                if s["best"] and s["best_us"] < s["cublas_us"]:
                    key = (skinny_configs.bucket_m(s["m"]), s["n"], s["k"])
                    skinny_configs.CONFIGS[key] = skinny_configs.SkinnyConfig(**s["best"])
                    added.append(f"{key}: {skinny_configs.CONFIGS[key]} "
                                 f"({s['best_us']:.2f} vs cuBLAS {s['cublas_us']:.2f} us)")
    return added


def decode_kernel_table(llm: LLM, a: argparse.Namespace) -> str:
    """The kernel table of 20 decode steps of a.bs fresh requests, prefilled and warmed up first
    (time_decode aborts its own requests when it returns: a step without them launches nothing)."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=a.warmup_steps + 40)
    ids = [eng.add_request([1 + i] * a.input_len, params) for i in range(a.bs)]
    try:
        for _ in range(a.warmup_steps + 2):  # prefill (one chunk at these lengths), then decode
            eng.step()
        return kernel_table(eng, 20)
    finally:
        for rid in ids:
            eng.abort(rid)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setting", choices=("default", "skinny"), required=True)
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--max-weight-elems", type=int, default=1 << 25)
    ap.add_argument("--sweep-json", default="")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--stats-values", type=int, default=None)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--gated-max-weight-elems", type=int, default=None)
    a = ap.parse_args()
    if a.stats_values is not None:
        skinny_gemm.NORM_STATS_VALUES = a.stats_values
    print(f"NORM_STATS_VALUES {skinny_gemm.NORM_STATS_VALUES}")
    if a.setting == "skinny":
        for line in apply_skinny(a.max_weight_elems, a.sweep_json):
            print("config", line)
        if a.gated_max_weight_elems is not None:
            linear.GATED_MAX_WEIGHT_ELEMS = a.gated_max_weight_elems
    elif a.gated_max_weight_elems is not None:
        raise SystemExit("--gated-max-weight-elems needs --setting skinny")
    print(f"skinny below {skinny_gemm.SKINNY_MAX_WEIGHT_ELEMS} weight elements "
          f"({skinny_gemm.SKINNY_M1_MAX_WEIGHT_ELEMS} at bs=1); SiLU-and-mul fused up to "
          f"{linear.GATED_MAX_WEIGHT_ELEMS}")
    llm = LLM(a.model, load_format="dummy", max_num_seqs=a.bs, cuda_graph_sizes=[a.bs],
              **bench_latency.mode_settings("FULL+async", 3, True))
    try:
        step_ms = float(np.median(bench_latency.time_decode(llm, a.bs, a, seed=a.bs))) * 1e3
        replay = replay_costs(llm.engine, a.bs)
        print(f"== {a.model} bs={a.bs} {a.setting}: step {step_ms:.3f} ms; {replay}", flush=True)
        if a.kernels:
            print(decode_kernel_table(llm, a), flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()

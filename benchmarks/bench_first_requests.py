"""The first requests after start-up: time of each `generate` of a new batch shape, and the Triton
kernels compiled during it (a kernel compiled mid-serving stalls that step by a second or more).

    python benchmarks/bench_first_requests.py [--model SmolLM2-135M] [--mode FULL] [--level 3]
Prints the start-up phases, then one line per shape: ms, and the names of the kernels compiled.
Dummy weights; greedy, 4 output tokens. Set TRITON_CACHE_DIR to a fresh folder for a cold start.
"""

import argparse
import random
import time

SHAPES = [(1, 32), (8, 32), (8, 32), (3, 100), (2, 700), (64, 32), (64, 32)]  # (prompts, length)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M")
    ap.add_argument("--mode", default="FULL")
    ap.add_argument("--level", type=int, default=3)
    args = ap.parse_args()

    from triton import knobs

    from atomrt import SamplingParams
    from atomrt.runtime.config import CompilationConfig, CUDAGraphMode
    from atomrt.runtime.entrypoints.llm import LLM

    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format="dummy",
        device="cuda",
        async_scheduling=True,
        compilation_config=CompilationConfig(
            level=args.level, cudagraph_mode=CUDAGraphMode[args.mode]
        ),
    )
    phases = ", ".join(f"{n} {s:.2f} s" for n, s in llm.engine.info.startup_phases)
    print(f"start-up {time.perf_counter() - start:.2f} s: {phases}", flush=True)
    compiled: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"].split("[")[0])
    rng = random.Random(0)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
    try:
        for n, length in SHAPES:
            prompts = [[rng.randrange(10, 500) for _ in range(length)] for _ in range(n)]
            compiled.clear()
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            ms = (time.perf_counter() - t) * 1e3
            print(f"{n} x {length}: {ms:.1f} ms, kernels compiled: {compiled}", flush=True)
    finally:
        knobs.runtime.jit_post_compile_hook = None
        llm.shutdown()


if __name__ == "__main__":
    main()

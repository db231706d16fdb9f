"""Where a decode step's host time goes: cProfile over engine steps of one model and mode.

    python tests/gpu/profile_step.py [--mode FULL] [--bs 1] [--steps 200] [--out FILE]
Prints ms/step and the top functions by cumulative time (dummy SmolLM2-135M weights).
"""

import argparse
import cProfile
import io
import pstats
import time

from atomrt.runtime import SamplingParams
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="FULL")
    ap.add_argument("--level", type=int, default=0)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", default="SmolLM2-135M")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cc = CompilationConfig(level=a.level, cudagraph_mode=a.mode, cuda_graph_sizes=[max(a.bs, 8)])
    llm = LLM(a.model, load_format="dummy", compilation_config=cc, max_num_seqs=max(a.bs, 8), max_model_len=2048)
    eng = llm.engine
    for i in range(a.bs):
        eng.add_request([1 + i] * 128, SamplingParams(temperature=0, max_tokens=3 * a.steps + 10, ignore_eos=True))
    for _ in range(5):
        eng.step()
    t = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    ms = (time.perf_counter() - t) * 1e3 / a.steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        eng.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
    text = f"{a.model} {a.mode} level {a.level} bs {a.bs}: {ms:.3f} ms/step (unprofiled)\n" + buf.getvalue()
    print(text)
    if a.out:
        open(a.out, "w").write(text)
    llm.shutdown()


if __name__ == "__main__":
    main()

"""The host's share of a decode step: the engine's step loop with the forward replaced by fixed
logits, on CPU. What is left is everything but the model: scheduling, the plan, the worker's
inputs, the sampler's argmax, postprocessing and streamed detokenization.

    python benchmarks/bench_host_step.py [--bs 1] [--sync] [--steps 200] [--profile tottime]
Prints the best of three runs in us/step (tiny 2-layer Llama, word-level tokenizer, streamed
outputs as a server asks for them). Under async scheduling this host work overlaps the GPU's, so
on the GPU machine it bounds the step from below: a step is at least max(GPU, host) long.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from atomrt import SamplingParams
from atomrt.runtime.bench.records import add_record_flag, figure, resolve_record_flag, save
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.workers.runner.model_runner import ModelOutput

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent / "tests")
)  # the CPU tests' tiny model
from executor_harness import VOCAB, build_tiny_llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--sync", action="store_true", help="synchronous scheduling (default: async)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", default="", help="cProfile one more run, sorted by this key")
    add_record_flag(ap)
    a = ap.parse_args()
    resolve_record_flag(a, ap)
    folder = build_tiny_llama(Path(tempfile.mkdtemp()) / "model")
    llm = LLM(
        str(folder),
        device="cpu",
        enforce_eager=True,
        num_kv_blocks=4096,
        max_num_seqs=max(a.bs, 8),
        async_scheduling=not a.sync,
    )
    eng = llm.engine
    runner = eng.executor.worker.runner
    logits = torch.randn(max(a.bs, 8) * 8, VOCAB)

    def fixed_logits(input_ids, decision, logits_indices, split=None) -> ModelOutput:
        n = input_ids.shape[0]
        return ModelOutput(logits[:n][logits_indices], logits[:n], None)

    runner.run_model = fixed_logits
    max_tokens = min(a.steps + 10, 240)  # the tiny model's 256 positions

    def run(steps: int) -> float:
        for _ in range(a.bs):
            eng.add_request(
                [3, 17, 42, 5],
                SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                stream=True,
            )
        for _ in range(5):
            eng.step()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        elapsed = time.perf_counter() - t
        while eng.has_unfinished():
            eng.step()
        return elapsed / steps * 1e6

    steps = min(a.steps, max_tokens - 10)
    runs = [run(steps) for _ in range(3)]
    print(
        f"bs={a.bs} {'sync' if a.sync else 'async'}: host {min(runs):.1f} us/step "
        f"(runs {', '.join(f'{r:.1f}' for r in runs)}; {steps} steps each)"
    )
    if a.record is not None:
        case = f"bs={a.bs} {'sync' if a.sync else 'async'}"
        fig = figure("host-step", case, round(min(runs), 1), "µs")
        program = "python benchmarks/bench_host_step.py"
        save(a.record, "bench_host_step", sys.argv[1:], [fig], on_gpu=False, program=program)
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        run(steps)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(a.profile).print_stats(40)
        print(buf.getvalue())
    llm.shutdown()


if __name__ == "__main__":
    main()

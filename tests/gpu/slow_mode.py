"""Is a slow process slow all along, and is it the host or the GPU? Rounds of decode steps in one engine.

    python tests/gpu/slow_mode.py [--model SmolLM2-135M] [--bs 1] [--rounds 12] [--steps 64]
        [--mode FULL] [--level 3] [--no-async]

The same `bench latency` command gives ~0.60 ms/step in most processes and ~0.95 ms in about one
in three (docs/perf.md, "the slow mode"). Per round of `--steps` decode steps this prints:
- the step's median wall ms (what `bench latency` reports);
- the GPU us of 20 back-to-back replays of the step's request graph (the GPU's own speed);
- the host: a fixed pure-Python loop's ns per iteration, and the CPU the main thread ran on at
  the round's start and end;
- the GPU's SM and memory clocks (NVML, when it can be read).
A process that is slow in every round, with the same GPU us and a slower Python loop, is slow on
the host; one whose replay is slower is slow on the GPU.
`--contend CPU` makes the host slow on purpose, to see what a slow host costs a given tree: after
start-up the main thread is pinned to that CPU and a busy-looping process shares it (about half
the CPU for the step loop; other threads are left where they are).
"""

import argparse
import multiprocessing as mp
import os
import time

import numpy as np
import torch

from atomrt.runtime import SamplingParams
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.entrypoints.llm import LLM


def current_cpu() -> int:
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])  # field 39, "processor"


def py_loop_ns() -> float:
    t = time.perf_counter()
    s = 0
    for i in range(50_000):
        s += i
    return (time.perf_counter() - t) / 50_000 * 1e9


def clocks() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return (f"SM {pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)} MHz, "
                f"mem {pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)} MHz")
    except Exception as e:  # a diagnostic: say why, go on
        return f"clocks: {type(e).__name__}"


def replay_gpu_us(runner, bs: int) -> float:
    """GPU us per replay of the request graph that holds `bs` rows; the step's staged inputs stay."""
    keys = runner.req_graph.keys()
    key = min((k for k in keys if k[0] >= bs), default=keys[-1])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        runner.req_graph.replay(key)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20 * 1e3


def _spin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="SmolLM2-135M")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--mode", default="FULL")
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--no-async", action="store_true")
    ap.add_argument("--contend", type=int, default=None, metavar="CPU", help="share this CPU with a busy loop")
    a = ap.parse_args()
    cc = CompilationConfig(level=a.level, cudagraph_mode=a.mode, cuda_graph_sizes=[a.bs])
    llm = LLM(a.model, load_format="dummy", compilation_config=cc, max_num_seqs=a.bs,
              max_model_len=128 + (a.rounds + 2) * a.steps + 64, async_scheduling=not a.no_async)
    eng = llm.engine
    runner = eng.executor.worker.runner
    for i in range(a.bs):
        params = SamplingParams(temperature=0, max_tokens=(a.rounds + 2) * a.steps, ignore_eos=True)
        eng.add_request([1 + i] * 128, params)
    for _ in range(8):
        eng.step()
    hog = None
    if a.contend is not None:
        os.sched_setaffinity(0, {a.contend})  # this thread only
        hog = mp.get_context("spawn").Process(target=_spin, args=(a.contend,), daemon=True)
        hog.start()
        time.sleep(0.5)
        print(f"main thread pinned to CPU {a.contend}, shared with a busy loop (pid {hog.pid})")
    print(f"{a.model} {a.mode}{'' if a.no_async else '+async'} level {a.level} bs {a.bs}, {a.steps} steps a round")
    print("round  median ms  p90 ms  replay GPU us  python ns/iter  cpu start->end  clocks", flush=True)
    medians = []
    for r in range(a.rounds):
        cpu0, py = current_cpu(), py_loop_ns()
        times = np.empty(a.steps)
        for i in range(a.steps):
            t = time.perf_counter()
            eng.step()
            times[i] = time.perf_counter() - t
        cpu1 = current_cpu()
        graphs = torch.cuda.is_available() and runner.req_graph is not None and len(runner.req_graph)
        gpu = replay_gpu_us(runner, a.bs) if graphs else float("nan")
        med = float(np.median(times)) * 1e3
        medians.append(med)
        print(f"{r:5d}  {med:9.3f}  {np.percentile(times, 90) * 1e3:6.3f}  {gpu:13.1f}  {py:14.1f}  "
              f"{cpu0:5d}->{cpu1:<5d}  {clocks()}", flush=True)
    print(f"median of round medians: {np.median(medians):.3f} ms (min {min(medians):.3f}, max {max(medians):.3f})")
    if hog is not None:
        hog.kill()
    llm.shutdown()


if __name__ == "__main__":
    main()

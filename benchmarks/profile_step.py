"""Where a decode step's time goes, on the GPU: host phases, GPU kernels, and a cProfile.

    python benchmarks/profile_step.py [--model SmolLM2-135M] [--mode FULL] [--level 0] [--bs 1]
        [--steps 200] [--async-scheduling] [--input-len 128] [--kv-cache-dtype auto]
        [--quantization fp8] [--hf-overrides JSON] [--max-model-len N]
        [--v4-attn-plan h16-tc] [--no-v4-hc-mix-kernel] [--no-v4-rope-kernel] [--out FILE]
Prints (dummy weights of --model, --bs prompts of --input-len tokens each):
- ms/step unprofiled;
- host time per phase (perf_counter, no extra synchronisation): driver (schedule, decide, plan,
  postprocess), the worker's launch outside the runner, the runner's staging (buffers.prepare),
  the forward launch, logits + sampler launch, and `executor.collect`: the wait in the step's one
  synchronisation (the GPU still running) plus the readback; inside those, the request graph's
  replay call, the LM head's launch, the readback's start and the worker's mirrors (apply, build);
- the forward's GPU time alone (CUDA events around run_model);
- the replay alone of the step's request graph: host us per launch and GPU us per replay;
- the GPU kernels of one step (torch.profiler: count and total kernel time, the top kernels);
- the top functions by cumulative and by own host time (cProfile).
"""

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict

import torch

from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.workers.kernels.v4.v4_kernels import ATTN_PLANS, DEFAULT_ATTN_PLAN, use_attn_plan
from atomrt.workers.layers import v4_hyper, v4_modules
from atomrt.workers.runner.input_batch import dummy_decode_inputs


def _timed(acc: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t

    return wrapper


def phase_times(eng, steps: int) -> tuple[dict, float]:
    """Host seconds per phase per step, and the forward's GPU ms per step (CUDA events)."""
    ex = eng.executor
    worker = ex.worker
    runner = worker.runner
    acc: dict = defaultdict(float)
    gpu_ms: list = []
    run_model = runner.run_model

    def run_model_events(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = run_model(*args, **kwargs)
        end.record()
        gpu_ms.append((start, end))
        return out

    # Bound methods are wrapped on the instances and the wrappers deleted afterwards, so the
    # class's methods show through again.
    parts = [
        (ex, "submit", "executor.submit"),
        (ex, "collect", "executor.collect"),
        (runner, "execute", "runner.execute"),
        (runner.buffers, "prepare", "runner.buffers.prepare"),
        (runner.model, "compute_logits", "  run_model: compute_logits (launch)"),
        (runner, "start_readback", "worker: start_readback"),
        (worker.mirrors, "build", "worker: mirrors.build"),
        (worker.mirrors, "apply", "worker: mirrors.apply"),
        (runner.graphs.req_graph, "replay", "  run_model: req_graph.replay (launch)"),
    ]
    for obj, name, label in parts:
        setattr(obj, name, _timed(acc, label, getattr(obj, name)))
    runner.run_model = _timed(acc, "runner.run_model (launch)", run_model_events)
    sampler = runner.sampler  # an instance attribute: put back, not deleted
    runner.sampler = _timed(acc, "sampler (launch)", sampler)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    total = time.perf_counter() - t
    torch.cuda.synchronize()
    runner.sampler = sampler
    del runner.run_model
    for obj, name, _ in parts:
        delattr(obj, name)
    acc = {k: v / steps for k, v in acc.items()}
    acc["step"] = total / steps
    acc["driver (step - submit - collect)"] = (
        acc["step"] - acc["executor.submit"] - acc["executor.collect"]
    )
    acc["worker launch outside runner.execute"] = acc["executor.submit"] - acc["runner.execute"]
    fwd = sum(s.elapsed_time(e) for s, e in gpu_ms) / len(gpu_ms)
    return acc, fwd


def replay_costs(eng, bs: int) -> str:
    """Host and GPU time of the replay alone of the request graph a `bs`-row decode step runs (the
    smallest bucket that holds it), 50 back to back."""
    runner = eng.executor.worker.runner
    req_graph = runner.graphs.req_graph
    if not len(req_graph):
        return "no request graphs"
    key = min((k for k in req_graph.keys() if k[0] >= bs), default=req_graph.keys()[-1])
    bs = key[0]
    decision = ForwardDecision(
        ForwardKind.REQ_GRAPH, running_bs=bs, running_tokens=bs, is_prefill=False, req_key=key
    )
    runner.buffers.prepare(
        dummy_decode_inputs(bs, 1), decision
    )  # a request graph replays the step staged for its bucket
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    start.record()
    for _ in range(50):
        req_graph.replay(key)
    host = (time.perf_counter() - t) / 50 * 1e6
    end.record()
    torch.cuda.synchronize()
    return f"request graph {key}: replay host {host:.1f} us/call, GPU {start.elapsed_time(end) / 50 * 1e3:.1f} us/replay"


def kernel_table(eng, steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_name: dict = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        per_name[e.name][0] += 1
        per_name[e.name][1] += e.device_time
    total_us = sum(v[1] for v in per_name.values())
    lines = [
        f"GPU kernels per step: {len(kernels) / steps:.1f}, kernel time per step {total_us / steps / 1e3:.3f} ms"
    ]
    for name, (n, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:40]:
        lines.append(f"  {n / steps:6.1f}/step {us / steps:8.1f} us/step  {name[:110]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mode", default="FULL")
    ap.add_argument("--level", type=int, default=0)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", default="SmolLM2-135M")
    ap.add_argument("--out", default="")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    ap.add_argument("--quantization", default=None, help="e.g. fp8 (online, dummy weights)")
    ap.add_argument(
        "--hf-overrides",
        type=json.loads,
        default=None,
        help="JSON over the model's config, e.g. '{\"num_hidden_layers\": 2}'",
    )
    ap.add_argument("--max-model-len", type=int, default=0, help="0: what the run needs")
    ap.add_argument(
        "--v4-attn-plan",
        choices=sorted(ATTN_PLANS),
        default=DEFAULT_ATTN_PLAN,
        help="DeepSeek-V4's sparse attention launch plan (workers/kernels/v4/v4_kernels.py)",
    )
    ap.add_argument(
        "--v4-hc-mix-kernel",
        action=argparse.BooleanOptionalAction,
        default=v4_hyper.HC_MIX_KERNEL,
        help="DeepSeek-V4's mHC mixing weights in one launch (workers/layers/v4_hyper.py)",
    )
    ap.add_argument(
        "--v4-rope-kernel",
        action=argparse.BooleanOptionalAction,
        default=v4_modules.ROPE_KERNEL,
        help="DeepSeek-V4's rotary embedding in one launch (workers/layers/v4_modules.py)",
    )
    a = ap.parse_args()
    # the in-process worker launches the kernels with these
    use_attn_plan(a.v4_attn_plan)
    v4_hyper.HC_MIX_KERNEL = a.v4_hc_mix_kernel
    v4_modules.ROPE_KERNEL = a.v4_rope_kernel
    # Early requests of a chunked prefill decode while later ones prefill: a token per chunk.
    new_tokens = 5 * a.steps + 60 + a.bs * a.input_len // 256
    max_model_len = a.max_model_len or max(2048, a.input_len + new_tokens + 64)
    if max_model_len < a.input_len + new_tokens:
        ap.error(f"--max-model-len {max_model_len}: the run needs {a.input_len + new_tokens}")
    cc = CompilationConfig(level=a.level, cudagraph_mode=a.mode, cuda_graph_sizes=[max(a.bs, 8)])
    llm = LLM(
        a.model,
        load_format="dummy",
        compilation_config=cc,
        max_num_seqs=max(a.bs, 8),
        max_model_len=max_model_len,
        async_scheduling=a.async_scheduling,
        kv_cache_dtype=a.kv_cache_dtype,
        quantization=a.quantization,
        **({"hf_overrides": a.hf_overrides} if a.hf_overrides else {}),
    )
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ids = {eng.add_request([1 + i] * a.input_len, params, stream=True) for i in range(a.bs)}
    started: set = set()
    while len(started) < a.bs:  # prefill, possibly chunked over several steps: not timed
        started.update(o.request_id for o in eng.step() if o.request_id in ids)
    for _ in range(5):
        eng.step()
    t = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    ms = (time.perf_counter() - t) * 1e3 / a.steps
    phases, fwd_ms = phase_times(eng, a.steps)
    replay = replay_costs(
        eng, a.bs
    )  # before torch.profiler, whose leftovers may slow later launches
    kernels = kernel_table(eng, 20)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        eng.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)  # where the host time is
    text = [
        f"{a.model} {a.mode}{' async' if a.async_scheduling else ''} level {a.level} bs {a.bs} "
        f"prompt {a.input_len} kv {a.kv_cache_dtype} quant {a.quantization}: "
        f"{ms:.3f} ms/step (unprofiled)",
        f"forward GPU time (events around run_model): {fwd_ms:.3f} ms/step",
        "host ms per step:",
    ]
    text += [f"  {k:55s} {v * 1e3:7.3f}" for k, v in phases.items()]
    text += [replay, kernels, buf.getvalue()]
    print("\n".join(text))
    if a.out:
        open(a.out, "w").write("\n".join(text))
    llm.shutdown()


if __name__ == "__main__":
    main()

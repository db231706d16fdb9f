"""Prefill throughput against the bf16 GEMM ceiling measured in the same run, on CUDA.

    python benchmarks/bench_prefill.py --model Llama-3.1-8B --shapes 8x2048
    python benchmarks/bench_prefill.py --model Llama-3.2-1B --shapes 32x512
    python benchmarks/bench_prefill.py --model SmolLM2-135M --shapes 8x64 --modes eager,TR_HYBRID

A shape NxL is N prompts of L random token ids, each generating one token (so the time is the
prefill and one sample), admitted in one step (max_num_batched_tokens = N*L). Prints, per model,
mode and shape, the median of --repeat timed runs after one warm-up: prompt tokens/s, the FLOP/s
that makes (2 x the decoder's matmul weights per token, plus causal attention's QK and PV), and
that over the ceiling: a large bf16 torch.matmul (8192^3) timed with CUDA events. Dummy weights.

Under a CUDA-graph mode, when the largest shape's N*L fits the default ladder (512), max_num_seqs
is raised to it so that the capture ladder reaches the prefill's rows: TR_HYBRID's token graphs
then cover the step, which is what the small shapes compare against eager.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from atomrt import SamplingParams
from atomrt.runtime.bench import goals
from atomrt.runtime.bench.records import (
    Figure,
    Quantity,
    add_record_flag,
    figure,
    resolve_record_flag,
    save,
)
from atomrt.runtime.bench.targets import model_name
from atomrt.runtime.entrypoints.llm import LLM

LADDER_TOP = 512  # the default capture ladder's largest size (cuda_graph_sizes)


def gemm_ceiling_tflops(n: int = 8192, repeat: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        torch.matmul(a, b)
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * repeat / (start.elapsed_time(end) / 1e3) / 1e12


def decoder_flops_per_token(llm: LLM, prompt_len: int) -> float:
    """2 x the decoder layers' 2-D weights, plus causal attention (QK^T and PV over prompt_len/2
    keys on average) per token."""
    model = llm.engine.executor.worker.runner.model
    weights = sum(
        p.numel() for name, p in model.named_parameters() if ".layers." in name and p.dim() == 2
    )
    arch = llm.engine.executor.worker.runner.arch
    attn = 2 * 2 * arch.num_layers * arch.num_heads * arch.head_dim
    return 2 * weights + attn * prompt_len / 2


def run(model: str, mode: str, shapes: list[tuple[int, int]], repeat: int) -> list[dict]:
    max_tokens = max(n * length for n, length in shapes)
    max_seqs = max(n for n, _ in shapes)
    if mode != "eager" and max_tokens <= LADDER_TOP:
        max_seqs = max(max_seqs, max_tokens)  # capture sizes stop at max_num_seqs
    kwargs = dict(
        load_format="dummy",
        max_num_batched_tokens=max_tokens,
        max_num_seqs=max_seqs,
        max_model_len=max(length for _, length in shapes) + 16,
    )
    if mode == "eager":
        llm = LLM(model, enforce_eager=True, **kwargs)
    else:
        llm = LLM(model, level=3, cudagraph_mode=mode, **kwargs)
    rows = []
    try:
        gen = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        for n, length in shapes:
            times = []
            for i in range(repeat + 1):
                ids = torch.randint(100, 30000, (n, length), generator=gen).tolist()
                torch.cuda.synchronize()
                start = time.perf_counter()
                llm.generate(ids, params, use_tqdm=False)
                if i:  # the first run warms up
                    times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            tokens_s = n * length / seconds
            tflops = tokens_s * decoder_flops_per_token(llm, length) / 1e12
            rows.append(
                dict(
                    model=model,
                    mode=mode,
                    shape=f"{n}x{length}",
                    ms=round(seconds * 1e3, 2),
                    tokens_s=round(tokens_s),
                    tflops=round(tflops, 1),
                )
            )
    finally:
        llm.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="Llama-3.1-8B", help="comma-separated")
    ap.add_argument("--shapes", default="8x2048", help="comma-separated NxL")
    ap.add_argument("--modes", default="FULL", help="eager or CUDA-graph modes, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None, help="where to write the rows as JSON")
    add_record_flag(ap)
    args = ap.parse_args()
    resolve_record_flag(args, ap)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    ceiling = gemm_ceiling_tflops()
    print(f"bf16 GEMM ceiling (8192^3 torch.matmul): {ceiling:.1f} TFLOP/s", flush=True)
    rows = []
    for model in args.model.split(","):
        for mode in args.modes.split(","):
            for row in run(model, mode, shapes, args.repeat):
                row["of_ceiling"] = round(row["tflops"] / ceiling, 3)
                rows.append(row)
                print(
                    f"{row['model']} {row['mode']} {row['shape']}: {row['ms']} ms, "
                    f"{row['tokens_s']} prompt tokens/s, {row['tflops']} TFLOP/s = "
                    f"{100 * row['of_ceiling']:.1f}% of the ceiling",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(ceiling_tflops=round(ceiling, 1), rows=rows), f, indent=1)
    if args.record is not None:
        program = "python benchmarks/bench_prefill.py"
        save(
            args.record,
            "bench_prefill",
            sys.argv[1:],
            figures(rows, ceiling),
            on_gpu=True,
            program=program,
        )


def figures(rows: list[dict], ceiling: float) -> list[Figure]:
    """prefill: TFLOP/s against the GEMM ceiling of the same run, per model, shape and mode."""
    out = []
    for row in rows:
        goal = goals.threshold("prefill", model=model_name(row["model"]), shape=row["shape"])
        out.append(
            figure(
                "prefill",
                f"{model_name(row['model'])} {row['shape']} {row['mode']}",
                row["tflops"],
                "TFLOP/s",
                anchor=round(ceiling, 1),
                anchor_name="bf16 GEMM ceiling",
                threshold=goal,
                extra={
                    "time": Quantity(row["ms"], "ms"),
                    "prompts": Quantity(row["tokens_s"], "tokens/s"),
                },
            )
        )
    return out


if __name__ == "__main__":
    main()

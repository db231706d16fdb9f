"""Structured outputs' grammar masks on the device: logit_additions.apply_bits (the torch arithmetic)
against workers/kernels/grammar_mask.apply_grammar_mask (the default: GRAMMAR_MASK_KERNEL), on
float32 logits of Llama-3's vocabulary with every row constrained.

    python benchmarks/bench_grammar_apply.py [--rows 16,64] [--vocab 128256] [--record [DIR]]

Prints, per count of constrained rows, the GPU us per apply (CUDA events over 200 eager calls, the
sampler's way of launching it) of each, and whether the two masked the same tokens. Needs CUDA.
`--record` keeps each count's kernel figure against the torch arithmetic's as a
`grammar-mask-apply` figure: a step's mask apply, in GPU us.

`--upload`: instead, how long the sampling worker's thread is held sending a step's masks to the
device (workers/runner/grammar_upload.py) while the stream still runs BUSY_MS of earlier work (a
forward): from pageable memory (the default) and through pinned buffers (PINNED_GRAMMAR_MASKS).
"""

from __future__ import annotations

import argparse
import sys

import torch

from atomrt.runtime.bench.records import (
    Figure,
    Quantity,
    add_record_flag,
    figure,
    resolve_record_flag,
    save,
)
from atomrt.workers.kernels.grammar_mask import apply_grammar_mask
from atomrt.workers.runner.grammar_upload import GrammarUpload
from atomrt.workers.runner.logit_additions import apply_bits


def gpu_us(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", default="16,64", help="comma-separated counts of constrained rows")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--upload", action="store_true", help="time the masks' upload (docstring)")
    add_record_flag(ap)
    a = ap.parse_args()
    resolve_record_flag(a, ap)
    if a.upload and a.record is not None:
        ap.error("--upload prints the host's hold per upload: it takes no --record")
    if not torch.cuda.is_available():
        sys.exit("bench_grammar_apply: needs a CUDA device")
    if a.upload:
        upload(a)
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    words = (a.vocab + 31) // 32
    rows_out: list[dict] = []
    for m in (int(r) for r in a.rows.split(",")):
        logits = torch.randn(m, a.vocab, device="cuda", generator=gen)
        rows = torch.arange(m, device="cuda")
        # about 1 token in 8 allowed: a JSON schema's masks are mostly clear
        bitmask = torch.randint(
            0, 2**32, (m, words), device="cuda", generator=gen, dtype=torch.int64
        )
        bitmask = (
            bitmask & torch.randint_like(bitmask, 0, 2**32) & torch.randint_like(bitmask, 0, 2**32)
        )
        bitmask = bitmask.to(torch.int32)
        a_out, k_out = logits.clone(), logits.clone()
        apply_bits(a_out, rows, bitmask)
        apply_grammar_mask(k_out, rows, bitmask)
        same = torch.equal(a_out, k_out)
        torch_us = gpu_us(lambda: apply_bits(logits.clone(), rows, bitmask))
        kernel_us = gpu_us(lambda: apply_grammar_mask(logits.clone(), rows, bitmask))
        clone_us = gpu_us(lambda: logits.clone())
        print(
            f"rows={m} vocab={a.vocab}: torch apply_bits {torch_us - clone_us:.1f} us, kernel "
            f"{kernel_us - clone_us:.1f} us (each less a clone of the logits, {clone_us:.1f} us); "
            f"same tokens masked: {same}"
        )
        rows_out.append(
            dict(rows=m, vocab=a.vocab, kernel_us=kernel_us - clone_us,
                 torch_us=torch_us - clone_us, clone_us=clone_us, same=same)
        )  # fmt: skip
    if a.record is not None:
        save(
            a.record,
            "bench_grammar_apply",
            sys.argv[1:],
            figures(rows_out),
            on_gpu=True,
            program="python benchmarks/bench_grammar_apply.py",
            notes=mismatches(rows_out),
        )


def figures(rows: list[dict]) -> list[Figure]:
    """grammar-mask-apply: the kernel's GPU us per apply of a step's masks, against the torch
    arithmetic's in the same run (each less a clone of the logits); a row whose two results
    differ is not a figure of the kernel but an error: it is left out, and `mismatches` says so."""
    return [
        figure(
            "grammar-mask-apply",
            f"{r['rows']} rows × {r['vocab']}",
            round(r["kernel_us"], 2),
            "µs",
            anchor=round(r["torch_us"], 2),
            anchor_name="torch arithmetic",
            extra={"logits clone": Quantity(round(r["clone_us"], 2), "µs")},
        )
        for r in rows
        if r["same"]
    ]


def mismatches(rows: list[dict]) -> list[str]:
    """The record's notes on the rows `figures` left out."""
    return [
        f"{r['rows']} rows × {r['vocab']}: the kernel and the torch arithmetic masked different "
        "tokens; not recorded"
        for r in rows
        if not r["same"]
    ]


BUSY_MS = 5.0


def upload(a: argparse.Namespace) -> None:
    """`--upload`: the host's hold per upload behind a busy stream, each way (median of 20)."""
    import time

    import numpy as np

    torch.cuda._sleep(1000)  # the sleep kernel loaded
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    cycles = int(10**7 * BUSY_MS / start.elapsed_time(end))
    words = (a.vocab + 31) // 32
    for m in (int(r) for r in a.rows.split(",")):
        rows = np.arange(m, dtype=np.int32)
        bitmask = np.random.default_rng(0).integers(-(2**31), 2**31, (m, words), dtype=np.int32)
        line = []
        for pinned in (False, True):
            send = GrammarUpload(torch.device("cuda"), pinned=pinned)
            held = []
            for _ in range(20):
                torch.cuda.synchronize()
                torch.cuda._sleep(cycles)  # the forward the masks arrive during
                t = time.perf_counter()
                _, dev = send(rows, bitmask)
                held.append(time.perf_counter() - t)
                torch.cuda.synchronize()
                assert np.array_equal(dev.cpu().numpy(), bitmask)
            line.append(f"{'pinned' if pinned else 'pageable'} {1e6 * sorted(held)[10]:.0f} us")
        print(
            f"upload rows={m} vocab={a.vocab} ({m * words * 4 / 1e6:.2f} MB) behind {BUSY_MS:g} ms "
            f"of queued GPU work: host held {', '.join(line)}"
        )


if __name__ == "__main__":
    main()

"""Registers, spills, occupancy and loop size of the decode attention kernels, compiled for a GPU
target on any machine (no GPU needed: Triton's compiler and the ptxas its wheel ships):

    python benchmarks/kernel_stats.py decode [--head-dim 128] [--group 4] [--kv-cache-dtype fp8]
        [--split] [--quick | --candidates]
    python benchmarks/kernel_stats.py mla [--heads 16] [--kv-cache-dtype fp8]
    python benchmarks/kernel_stats.py v4

One JSON line per launch plan of a grid (decode: key tile x warps x stages x prefetch_kv; mla: key
tile x warps x stages x merge_in_kernel): registers per thread, local-memory stack (spills), shared
memory, the programs an SM holds by registers and by shared memory, and, in the key loop's SASS,
instructions per key, the spill loads and stores, barriers and byte-wide shared-memory loads
there. The plan the runtime picks is marked "default"; decode --candidates gives the e4m3 cache
plans bench_decode_attention.py --sweep times instead of the grid. Run it without TRITON_INTERPRET (the interpreter's kernels do not compile). A static
view, not a timing: it says which plans can keep two programs per SM and which spill in their
loop, for a GPU sweep (bench_decode_attention.py, bench_mla_decode.py --sweep) to time.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from atomrt.workers.kernels.attention.decode_attention import _decode_constexprs, plan_decode
from atomrt.workers.kernels.attention.decode_kernels import decode_attention_kernel
from atomrt.workers.kernels.attention.mla_decode import (
    _decode_constexprs as mla_constexprs,
)
from atomrt.workers.kernels.attention.mla_decode import plan_mla_decode
from atomrt.workers.kernels.attention.mla_kernels import mla_decode_kernel

REGISTERS, SHARED = 65536, 227 * 1024  # per SM on sm_90
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _signature(fn, pointers: dict[str, str], floats: tuple[str, ...]) -> dict[str, str]:
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        else:
            sig[p.name] = pointers.get(p.name, "fp32" if p.name in floats else "i32")
    return sig


# int arguments a real launch passes as multiples of 16 (Triton specializes on that): the model
# dims below, and every stride
DIV16_INTS = ("head_dim", "max_blocks", "kv_lora_rank", "rope_dim")


def compile_stats(fn, sig: dict, constexprs: dict, warps: int, stages: int, capability: int):
    """Compile for sm_<capability> (pointers, strides and DIV16_INTS 16-divisible, as a launch
    marks them) and read the cubin's resources and its loops' instructions."""
    div = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if sig[name].startswith("*") or name.startswith("stride_") or name in DIV16_INTS
    }
    kernel = triton.compile(
        ASTSource(fn, sig, constexprs, div),
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = _run("--dump-resource-usage", f.name)
        sass = _run("-sass", f.name)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    shared = kernel.metadata.shared
    loop = _largest_loop(sass)
    return dict(
        regs=regs,
        stack=stack,
        shared=shared,
        programs_per_sm=min(REGISTERS // (regs * 32 * warps), SHARED // max(shared, 1)),
        loop_instructions=len(loop),
        loop_spill_loads=sum(1 for i in loop if i.startswith("LDL")),
        loop_spill_stores=sum(1 for i in loop if i.startswith("STL")),
        loop_barriers=sum(1 for i in loop if i.startswith("BAR")),
        loop_shared_byte_loads=sum(1 for i in loop if i.startswith(("LDS.U8", "LDS.S8"))),
    )


def _run(flag: str, path: str) -> str:
    return subprocess.run(
        [os.path.join(BIN, "cuobjdump"), flag, path], capture_output=True, text=True, check=True
    ).stdout


def _largest_loop(sass: str) -> list[str]:
    """The instructions between the largest backward branch and its target, among the loops that
    hold a tensor-core product where any does (the key loop, not a merge loop after it)."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?(.*?);", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for addr, ins in lines:
        b = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
        if b and int(b.group(1), 16) < addr:
            loops.append([i for a, i in lines if int(b.group(1), 16) <= a <= addr])
    mma = [body for body in loops if any("MMA" in i for i in body)]
    return max(mma or loops, key=len, default=[])


DECODE_GRID = tuple(itertools.product((64, 128), (4, 8), (1, 2), (False, True)))
QUICK_DECODE_GRID = ((64, 8, 1, False), (128, 8, 2, False))  # the two plans at 8 warps


def _decode_sig(fp8: bool) -> dict[str, str]:
    cache = "*fp8e4nv" if fp8 else "*bf16"
    cache = "*fp8e4nv" if fp8 else "*bf16"
    bf = "*bf16"
    pointers = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), bf)
    pointers |= dict.fromkeys(("partial_ptr", "m_ptr", "l_ptr", "cos_ptr", "sin_ptr"), "*fp32")
    pointers |= dict(k_cache_ptr=cache, v_cache_ptr=cache, kv_scales_ptr="*fp32")
    pointers |= dict(counter_ptr="*i32", positions_ptr="*i64", slot_mapping_ptr="*i64")
    pointers |= dict.fromkeys(("cu_seqlens_q_ptr", "context_lens_ptr", "block_tables_ptr"), "*i32")
    return _signature(decode_attention_kernel, pointers, ("scale_log2",))


def _decode_stats(args, plan, sig: dict, fp8: bool) -> dict:
    cx = dict(_decode_constexprs(plan, args.group, args.head_dim, 16, True, False, fp8, False))
    cx.pop("launch_pdl")
    warps, stages = cx.pop("num_warps"), cx.pop("num_stages")
    stats = compile_stats(decode_attention_kernel, sig, cx, warps, stages, args.capability)
    stats["loop_instructions_per_key"] = round(stats.pop("loop_instructions") / plan.tile_n, 2)
    return stats


def decode_rows(args, grid=DECODE_GRID) -> list[dict]:
    """One row per (tile_n, warps, stages, prefetch_kv) of `grid` and the runtime's plan (added
    where `grid` lacks it), which is marked default."""
    fp8 = args.kv_cache_dtype == "fp8"
    sig = _decode_sig(fp8)
    num_seqs = 1 if args.split else 32
    default = plan_decode(num_seqs, 8192, 8, args.group, args.head_dim, 132, fp8)
    if args.split != (default.num_splits > 1):
        default = dataclasses.replace(default, num_splits=8 if args.split else 1)
    own = (default.tile_n, default.num_warps, default.num_stages, default.prefetch_kv)
    rows = []
    for tile_n, warps, stages, prefetch in dict.fromkeys((*grid, own)):
        plan = dataclasses.replace(
            default, tile_n=tile_n, num_warps=warps, num_stages=stages, prefetch_kv=prefetch
        )
        stats = _decode_stats(args, plan, sig, fp8)
        name = dict(tile_n=tile_n, warps=warps, stages=stages, prefetch_kv=prefetch)
        name["widen_v_first"] = plan.widen_v_first and fp8  # the default's (an e4m3 cache)
        rows.append(dict(name, default=plan == default, **stats))
    return rows


def candidate_rows(args) -> list[dict]:
    """One row per e4m3 cache plan bench_decode_attention.py --sweep times (FP8_CANDIDATES), with
    the split count it gives the plan at bs 32 on 132 SMs, after the e4m3 default's."""
    from bench_decode_attention import FP8_CANDIDATES, candidate_plan  # a sibling script

    sig = _decode_sig(True)
    default = plan_decode(32, 8192, 8, args.group, args.head_dim, 132, True)
    plans = {"default": default}
    plans |= {name: candidate_plan(default, name, 32 * 8, 132) for name in FP8_CANDIDATES}
    rows = []
    for name, plan in plans.items():
        stats = _decode_stats(args, plan, sig, True)
        fields = dict(tile_n=plan.tile_n, warps=plan.num_warps, stages=plan.num_stages)
        fields |= dict(splits=plan.num_splits, widen_v_first=plan.widen_v_first)
        rows.append(dict(candidate=name, **fields, default=plan == default, **stats))
    return rows


def mla_rows(args) -> list[dict]:
    fp8 = args.kv_cache_dtype == "fp8"
    bf = "*bf16"
    pointers = dict(q_ptr=bf, q_pe_ptr=bf, out_ptr=bf, kv_cache_ptr="*fp8e4nv" if fp8 else bf)
    pointers |= dict.fromkeys(("partial_ptr", "m_ptr", "l_ptr", "kv_scales_ptr"), "*fp32")
    pointers |= dict.fromkeys(("block_table_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr"), "*i32")
    pointers |= dict(counter_ptr="*i32")
    sig = _signature(mla_decode_kernel, pointers, ("scale_log2",))
    default = plan_mla_decode(32, 32, 8192, args.heads, 512, 64, 132)
    rows = []
    grid = itertools.product((16, 32, 64), (4, 8), (1, 2, 3), (False, True))
    for block_n, warps, stages, merge in grid:
        plan = dataclasses.replace(
            default, block_n=block_n, num_warps=warps, num_stages=stages, merge_in_kernel=merge
        )
        cx = dict(mla_constexprs(plan, 16, torch.bfloat16))
        warps, stages = cx.pop("num_warps"), cx.pop("num_stages")
        stats = compile_stats(mla_decode_kernel, sig, cx, warps, stages, args.capability)
        stats["loop_instructions_per_key"] = round(stats.pop("loop_instructions") / block_n, 2)
        name = dict(block_n=block_n, warps=warps, stages=stages, merge_in_kernel=merge)
        rows.append(dict(name, default=plan == default, **stats))
    return rows


def v4_rows(args) -> list[dict]:
    """DeepSeek-V4-Flash's kernels (workers/kernels/v4/) as its layers launch them: the compressor
    at the HCA and CSA rates (512-wide entries) and the indexer's (128 wide), and the sparse
    attention's launch plans, with each compile's seconds (an unrolled window once took minutes)."""
    import time

    from atomrt.workers.kernels.v4 import v4_kernels as v4

    bf = "*bf16"
    pointers = dict(rows_ptr=bf, out_ptr=bf, slots_ptr="*i64", windows_ptr="*i64")
    pointers |= dict(ape_ptr="*fp32", norm_ptr="*fp32")
    sig = _signature(v4._v4_pool_kernel, pointers, ("eps",))
    rows = []
    for name, d, rate, overlap in (
        ("pool_hca", 512, 128, False),
        ("pool_csa", 512, 4, True),
        ("pool_csa_indexer", 128, 4, True),
    ):
        start = time.perf_counter()
        stats = compile_stats(
            v4._v4_pool_kernel, sig, v4.pool_constexprs(d, rate, overlap), 4, 3, args.capability
        )
        seconds = round(time.perf_counter() - start, 2)
        rows.append(dict(kernel=name, head_dim=d, rate=rate, compile_s=seconds, **stats))
    pointers = dict(q_ptr=bf, rows_ptr=bf, out_ptr=bf, koff_ptr="*i64", sink_ptr="*fp32")
    sig = _signature(v4._v4_sparse_attn_kernel, pointers, ("scale",))
    # the sparse attention at 64 heads of 512 (one rank's): the default plan and the candidates
    # bench_v4_kernels.py times (heads a program, warps, tensor cores)
    for name in v4.ATTN_PLANS:
        v4.use_attn_plan(name)
        cx = v4.attn_plan(64, 512, torch.bfloat16)
        v4.use_attn_plan(v4.DEFAULT_ATTN_PLAN)
        warps = cx.pop("num_warps")
        start = time.perf_counter()
        stats = compile_stats(
            v4._v4_sparse_attn_kernel, sig, dict(H=64, D=512, **cx), warps, 3, args.capability
        )
        seconds = round(time.perf_counter() - start, 2)
        plan = dict(block_h=cx["BLOCK_H"], warps=warps, tensor_cores=not cx["FP32_DOT"])
        rows.append(dict(kernel="sparse_attention", plan=name, **plan, compile_s=seconds, **stats))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("kernel", choices=("decode", "mla", "v4"))
    ap.add_argument("--head-dim", type=int, default=128, help="decode: Llama-3.1-8B's 128")
    ap.add_argument("--group", type=int, default=4, help="decode: query heads per KV head")
    ap.add_argument("--split", action="store_true", help="decode: the split variant (bs=1)")
    ap.add_argument("--heads", type=int, default=16, help="mla: query heads (V2-Lite's 16)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument("--capability", type=int, default=90, help="the target's sm_ number")
    ap.add_argument("--quick", action="store_true", help="decode: 64- and 128-key tiles, 8 warps")
    ap.add_argument(
        "--candidates",
        action="store_true",
        help="decode: bench_decode_attention.py's e4m3 cache candidates at bs 32 (e4m3 cache)",
    )
    args = ap.parse_args()
    if args.candidates and (args.kernel != "decode" or args.kv_cache_dtype != "fp8"):
        ap.error("--candidates: only with decode --kv-cache-dtype fp8")
    if args.candidates:
        rows = candidate_rows(args)
    elif args.kernel == "decode":
        rows = decode_rows(args, QUICK_DECODE_GRID if args.quick else DECODE_GRID)
    elif args.kernel == "v4":
        rows = v4_rows(args)
    else:
        rows = mla_rows(args)
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

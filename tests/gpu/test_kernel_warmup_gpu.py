"""GPU tier: after start-up (which warms the host-planned attention kernels), prompts of new
lengths, contexts that split their keys and mixed prefill + decode steps compile no attention
kernel: the first requests of a fresh server do not wait on Triton. Dummy weights of
SmolLM2-135M's shape, FULL graphs (eager prefill and mixed steps) and TR_HYBRID (eager regions).

Run on the GPU machine: `pytest -m gpu tests/gpu/test_kernel_warmup_gpu.py`.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.gpu

ATTENTION = (
    "paged_attention_kernel",
    "reduce_splits_kernel",
    "decode_attention_kernel",
    "rope_write_kv_kernel",
    "write_kv_kernel",
)


@pytest.mark.parametrize("mode", ["FULL", "TR_HYBRID"])
def test_requests_after_start_up_compile_no_attention_kernel(mode: str) -> None:
    from triton import knobs

    from atomrt import SamplingParams
    from atomrt.runtime.config import CompilationConfig, CUDAGraphMode
    from atomrt.runtime.entrypoints.llm import LLM

    llm = LLM(
        model="SmolLM2-135M",
        load_format="dummy",
        device="cuda",
        max_num_seqs=16,
        max_model_len=4096,
        compilation_config=CompilationConfig(
            level=3, cudagraph_mode=CUDAGraphMode[mode], cuda_graph_sizes=[16]
        ),
    )
    compiled: list[str] = []

    def hook(**kw):
        compiled.append(kw["repr"].split("[", 1)[0])

    old, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, hook
    rng = random.Random(0)
    try:
        for n, length, out in [
            (1, 3, 4),
            (1, 100, 4),
            (3, 37, 8),
            (2, 700, 16),
            (16, 9, 8),
            (5, 2000, 4),
        ]:
            prompts = [[rng.randrange(10, 500) for _ in range(length)] for _ in range(n)]
            # staggered lengths: later prompts join running decodes (mixed steps)
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
        llm.generate(
            [[rng.randrange(10, 500) for _ in range(rng.randrange(2, 300))] for _ in range(12)],
            [
                SamplingParams(temperature=0, max_tokens=rng.randrange(1, 40), ignore_eos=True)
                for _ in range(12)
            ],
        )
    finally:
        knobs.runtime.jit_post_compile_hook = old
        llm.shutdown()
    print("kernels compiled after start-up:", compiled)
    assert not [name for name in compiled if name.endswith(ATTENTION)], compiled


# A fresh process with an empty Triton cache: every kernel capture launches is new to it. Prints
# the JIT kernels compiled while capture records, then those of the eager warm-up (whose
# compile-ahead pass runs capture's warm-ups too), as two JSON lists, then how many times capture
# ran a compile-ahead pass of its own.
_CAPTURE_AHEAD = """
import json, sys
from triton import knobs
from atomrt.runtime.config import CompilationConfig, CUDAGraphMode
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.workers import worker
from atomrt.workers.runner import graph_runner

phase = ["start"]
compiled = {"start": [], "ahead": [], "capture": []}
own_passes = []
knobs.runtime.jit_post_compile_hook = lambda **kw: compiled[phase[0]].append(
    kw["repr"].split("[", 1)[0])
warm, capture = worker.warm_eager_kernels, graph_runner.GraphRunner.capture
own_pass = graph_runner.GraphRunner._compile_ahead

def in_phase(name, fn):
    def run(*args, **kwargs):
        phase[0] = name
        try:
            return fn(*args, **kwargs)
        finally:
            phase[0] = "start"
    return run

def counted_pass(self, runner, sizes):
    own_passes.append(len(sizes))
    return own_pass(self, runner, sizes)

worker.warm_eager_kernels = in_phase("ahead", warm)
graph_runner.GraphRunner.capture = in_phase("capture", capture)
graph_runner.GraphRunner._compile_ahead = counted_pass
llm = LLM(model="SmolLM2-135M", load_format="dummy", device="cuda", max_num_seqs=64,
          compilation_config=CompilationConfig(level=3, cudagraph_mode=CUDAGraphMode[sys.argv[1]]))
llm.shutdown()
print("CAPTURE " + json.dumps(compiled["capture"]))
print("AHEAD " + json.dumps(compiled["ahead"]))
print("OWN " + json.dumps(own_passes))
"""


@pytest.mark.parametrize("mode", ["FULL", "TR_HYBRID"])
def test_capture_compiles_nothing_after_the_shared_compile_ahead_pass(tmp_path, mode: str) -> None:
    """The eager warm-up's compile-ahead pass runs every capture bucket's warm-up too and compiles
    the Triton kernels capture's recordings launch: with an empty Triton cache, nothing compiles
    while capture records, the pass compiled something (it was not a warm cache's no-op), and
    capture ran no compile-ahead pass of its own."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    proc = subprocess.run(
        [sys.executable, "-c", _CAPTURE_AHEAD, mode],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    lines = {line.split(" ", 1)[0]: line for line in proc.stdout.splitlines()}
    during = json.loads(lines["CAPTURE"].split(" ", 1)[1])
    ahead = json.loads(lines["AHEAD"].split(" ", 1)[1])
    own = json.loads(lines["OWN"].split(" ", 1)[1])
    print("compiled by the pass:", ahead, "during capture:", during)
    assert ahead, "the compile-ahead pass compiled nothing with an empty Triton cache"
    assert not during, f"compiled while capture recorded: {during}"
    assert not own, f"capture ran its own compile-ahead pass over {own} sizes"


def test_unpack_under_compile_ahead_launches_nothing_then_unpacks() -> None:
    """A packed step's unpack launches through `launch`: under `compile_ahead` it only compiles
    (on the pool, beside the other kernels), the static buffers untouched; after it, it unpacks."""
    import torch

    from atomrt.workers.kernels.launch import compile_ahead
    from atomrt.workers.runner.input_batch import dummy_decode_inputs
    from atomrt.workers.runner.step_buffers import PackedStep

    dev = torch.device("cuda")
    fv = {
        "input_ids": torch.zeros(8, dtype=torch.int64, device=dev),
        "positions": torch.zeros(8, dtype=torch.int64, device=dev),
        "slot_mapping": torch.full((8,), -1, dtype=torch.int64, device=dev),
        "cu_seqlens_q": torch.zeros(9, dtype=torch.int32, device=dev),
        "context_lens": torch.zeros(8, dtype=torch.int32, device=dev),
        "block_tables": torch.zeros((8, 16), dtype=torch.int32, device=dev),
    }
    packed = PackedStep(max_seqs=8, max_rows=8, max_blocks=16, device=dev)
    inputs = dummy_decode_inputs(5, 1, 16)
    inputs.input_ids[:] = [3, 4, 5, 6, 7]
    packed.stage(inputs, 5, 5)
    with compile_ahead() as ahead:
        assert ahead
        packed.unpack(fv, 5, 5)
    torch.cuda.synchronize()
    assert fv["input_ids"].tolist() == [0] * 8  # compiled, not launched
    packed.unpack(fv, 5, 5)
    torch.cuda.synchronize()
    assert fv["input_ids"][:5].tolist() == [3, 4, 5, 6, 7]


def test_loads_after_compiles_loads_every_kernel_compiled_ahead(monkeypatch) -> None:
    """With `LOADS_AFTER_COMPILES` on, `compile_ahead` loads each kernel it compiled once every
    compile is done (no pool thread waits on a compile for its load): leaving it, every new
    kernel's module is in, and later launches compile nothing and match torch. Shapes no other
    test uses, so the variants are new to this process."""
    import torch

    from atomrt.workers.kernels import launch
    from atomrt.workers.kernels.gemm.skinny_gemm import skinny_linear
    from atomrt.workers.kernels.gemm.skinny_kernels import skinny_gemm_kernel

    def compiled() -> list:
        return list(skinny_gemm_kernel.device_caches[torch.cuda.current_device()][0].values())

    monkeypatch.setattr(launch, "LOADS_AFTER_COMPILES", True)
    torch.manual_seed(0)
    xs = [torch.randn(m, 344, device="cuda", dtype=torch.bfloat16) for m in (1, 2, 3)]
    weight = torch.randn(216, 344, device="cuda", dtype=torch.bfloat16) / 16
    before = len(compiled())
    with launch.compile_ahead() as ahead:
        assert ahead
        for x in xs:
            skinny_linear(x, weight)
    new = compiled()[before:]
    assert new, "nothing compiled ahead"
    assert all(getattr(c, "module", None) is not None for c in new), "compiled, not loaded"
    count = len(compiled())
    for x in xs:
        ref = (x.double() @ weight.double().T).to(torch.bfloat16)
        torch.testing.assert_close(skinny_linear(x, weight), ref, rtol=2e-2, atol=2e-2)
    assert len(compiled()) == count, "compiled after compile_ahead"

"""workers/kernels/v4/v4_index.py, through Triton's interpreter on CPU (compiled on a GPU):
`prefix_topk`, in each form, picks the entries torch's top-k picks over each row with its tail
past the row's length at -inf, in score order, ties to the lower entry (the kernels' forms; the
"torch" form breaks them as torch does), -1 past a row's finite scores; and with
`GRAPH_SAFE_PREFIX` a graph-safe (FULL) decode of the tiny CSA/HCA model picks, layer by layer
and step by step, what the [n, T] slots and torch's top-k pick, its logits transformers'. The
interpreter runs code a compiler may refuse, so each kernel also compiles for an H100 (sm_90)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kernel_device import DEVICE

from atomrt.workers.kernels.v4.v4_index import TOPK_FORMS, prefix_topk


@pytest.mark.parametrize("form", TOPK_FORMS)
@pytest.mark.parametrize("k", [16, 40])
def test_prefix_topk_picks_torch_topk_entries_of_the_prefix(k: int, form: str) -> None:
    gen = torch.Generator().manual_seed(k)
    scores = torch.randn(6, 700, generator=gen)
    scores[4, 20:30] = float("-inf")  # masked entries inside a prefix count as none
    lens = torch.tensor([700, 300, 5, 0, 650, 900], dtype=torch.int32)  # 900: past T
    got = prefix_topk(scores.to(DEVICE), lens.to(DEVICE), k, form).cpu()
    masked = scores.clone()
    for row, n in enumerate(lens.tolist()):
        masked[row, n:] = float("-inf")
    top = masked.topk(k, dim=-1)
    want = torch.where(top.values > float("-inf"), top.indices, -1)
    assert got.shape == (6, k) and torch.equal(got, want)


KERNEL_FORMS = [f for f in TOPK_FORMS if f != "torch"]


@pytest.mark.parametrize("form", KERNEL_FORMS)
def test_prefix_topk_breaks_ties_to_the_lower_entry(form: str) -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, -2.0, 3.0, 0.5, -0.0, 0.0] * 8])  # 64 entries
    got = prefix_topk(scores.to(DEVICE), torch.tensor([64], device=DEVICE), 16, form).cpu()[0]
    order = sorted(range(64), key=lambda i: (-scores[0, i].item(), i))[:16]
    assert got.tolist() == order


@pytest.mark.parametrize("form", KERNEL_FORMS)
def test_prefix_topk_over_several_tiles_of_tied_scores(form: str) -> None:
    """Rows longer than a tile of either form, of few distinct values (the k-th highest has many
    ties, some taken, some not), one with fewer finite scores than k."""
    gen = torch.Generator().manual_seed(7)
    scores = torch.randint(-4, 5, (3, 2500), generator=gen).float() / 4
    scores[2, 30:] = float("-inf")
    lens = torch.tensor([2500, 1800, 2500], dtype=torch.int32)
    got = prefix_topk(scores.to(DEVICE), lens.to(DEVICE), 40, form).cpu()
    for row, n in enumerate(lens.tolist()):
        finite = [i for i in range(n) if scores[row, i] > float("-inf")]
        order = sorted(finite, key=lambda i: (-scores[row, i].item(), i))[:40]
        assert got[row].tolist() == order + [-1] * (40 - len(order))


@pytest.mark.parametrize("chunk", [32, 300, 1024])
def test_chunked_prefix_topk_over_many_chunks(chunk: int) -> None:
    """The chunked form with prefixes of many chunks (and chunks of fewer entries than k, and a
    last chunk cut by the prefix): the picks of torch's top-k over the masked rows, in score
    order, ties (few distinct scores) to the lower entry, the same as the one-program select."""
    gen = torch.Generator().manual_seed(chunk)
    scores = torch.randint(-6, 7, (4, 2500), generator=gen).float() / 3
    scores[1] = torch.randn(2500, generator=gen)
    scores[3, 100:900] = float("-inf")
    lens = torch.tensor([2500, 2001, 37, 1500], dtype=torch.int32)
    got = prefix_topk(scores.to(DEVICE), lens.to(DEVICE), 40, "chunked", chunk).cpu()
    want = prefix_topk(scores.to(DEVICE), lens.to(DEVICE), 40, "select").cpu()
    assert torch.equal(got, want)
    for row, n in enumerate(lens.tolist()):
        finite = [i for i in range(n) if scores[row, i] > float("-inf")]
        order = sorted(finite, key=lambda i: (-scores[row, i].item(), i))[:40]
        assert got[row].tolist() == order + [-1] * (40 - len(order))


def test_torch_prefix_topk_with_fewer_entries_than_k() -> None:
    """The "torch" form over rows narrower than k, and rows whose prefix holds fewer finite scores
    than k: their picks in score order, -1 after them."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 12, generator=gen)
    lens = torch.tensor([12, 4, 0], dtype=torch.int32)
    got = prefix_topk(scores.to(DEVICE), lens.to(DEVICE), 16, "torch").cpu()
    assert got.shape == (3, 16)
    for row, n in enumerate(lens.tolist()):
        order = sorted(range(n), key=lambda i: -scores[row, i].item())
        assert got[row].tolist() == order + [-1] * (16 - n)


def test_prefix_topk_names_an_unknown_form() -> None:
    with pytest.raises(ValueError, match="form 'radix' is not one of"):
        prefix_topk(torch.zeros(1, 8, device=DEVICE), torch.tensor([8], device=DEVICE), 4, "radix")


# Built in a process of its own: the suite's Triton interprets (TRITON_INTERPRET=1 in the test
# process turns every jit function into an interpreted one, which the compiler does not take).
COMPILE_FOR_H100 = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from atomrt.workers.kernels.v4 import v4_index
fn = getattr(v4_index, sys.argv[1])
sig = {}
for name in fn.arg_names:
    if name.isupper():
        sig[name] = "constexpr"
    elif name == sys.argv[2]:
        sig[name] = "*fp32"
    elif name.endswith("_ptr"):
        sig[name] = "*i32" if name == "lens_ptr" else "*i64"
    else:
        sig[name] = "i32"
consts = {"BLOCK": 512, "TILE": 1024, "CHUNK": 8192}
consts = {name: consts[name] for name in fn.arg_names if name.isupper()}
built = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))
print(len(built.asm["cubin"]), "bytes of cubin")
"""


@pytest.mark.parametrize(
    "kernel, floats",
    [
        ("_prefix_topk_kernel", "scores_ptr"),
        ("_prefix_select_kernel", "scores_ptr"),
        ("_chunk_select_kernel", "scores_ptr"),
        ("_merge_select_kernel", "-"),  # reads the chunks' packed int64 keys
    ],
)
def test_prefix_topk_kernels_compile_for_an_h100(kernel: str, floats: str) -> None:
    """Each form's kernels through Triton's compiler to an sm_90 binary, at a 1M context's k, as a
    GPU builds them (the interpreter runs code the compiler refuses: a branch that a constexpr
    rules out is still compiled after an early return)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_H100, kernel, floats],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[0].isdigit() and int(done.stdout.split()[0]) > 0

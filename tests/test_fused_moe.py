"""The fused-MoE Triton kernel against a float64 reference, on CUDA when present, else on CPU
through Triton's interpreter.

Routings chosen to hit the layout's edges: ragged expert loads, experts that get no token, one
expert taking every token, top-k 1, 2 and 8, widths that are not multiples of the blocks. The GPU
tier (tests/gpu/test_fused_moe_gpu.py) repeats them at real shapes in bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_device import DEVICE

from atomrt.workers.kernels.moe.align import (
    MoEAlignment,
    fits_one_program,
    max_padded_pairs,
    moe_align_block_size,
    moe_align_one_program,
    moe_align_torch,
)
from atomrt.workers.kernels.moe.fused_moe import fused_experts
from atomrt.workers.kernels.moe.moe_configs import (
    CONFIGS,
    MoEConfig,
    bucket_tokens,
    heuristic_config,
    pick_config,
)
from atomrt.workers.layers.moe import fused_experts_ref

# Small blocks keep the interpreter fast; the widths below are not multiples of them.
SMALL = MoEConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
HIDDEN, INTER = 48, 40


def pair_reference(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """float64 on the CPU, [tokens, top_k, hidden]: w_j * W2[e_j] @ (silu(W1[e_j] x) * W3[e_j] x)
    for each token and slot j."""
    x, w13, w2, topk_weights = (t.double().cpu() for t in (x, w13, w2, topk_weights))
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], topk_ids.shape[1], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            out[t, j] = topk_weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def reference(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """float64 on the CPU: sum_j w_j * W2[e_j] @ (silu(W1[e_j] x) * W3[e_j] x), token by token."""
    return pair_reference(x, w13, w2, topk_weights, topk_ids).sum(dim=1)


def make_experts(num_experts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) * 0.2
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=g) * 0.2
    return w13, w2


def random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return weights, ids


def check(num_tokens: int, num_experts: int, topk_ids: torch.Tensor, topk_weights=None) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    w13, w2 = make_experts(num_experts)
    if topk_weights is None:
        topk_weights = torch.rand(topk_ids.shape, generator=g)
    args = (t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids))
    got = fused_experts(*args, SMALL, SMALL)
    expected = reference(x, w13, w2, topk_weights, topk_ids)
    assert got.shape == (num_tokens, HIDDEN) and got.dtype == torch.float32
    torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k",
    [(1, 4, 1), (5, 8, 2), (33, 8, 2), (3, 8, 8), (17, 16, 8)],
)
def test_random_routing_matches_float64(num_tokens: int, num_experts: int, top_k: int) -> None:
    weights, ids = random_routing(num_tokens, num_experts, top_k)
    check(num_tokens, num_experts, ids, weights)


def test_ragged_loads_and_experts_without_tokens() -> None:
    """Expert 0 takes 19 pairs (two blocks of 16, the second mostly padding), expert 3 sixteen,
    expert 2 two, expert 5 one; experts 1, 4, 6 and 7 none."""
    ids = torch.zeros(19, 2, dtype=torch.int64)
    ids[:, 1] = 3
    ids[0, 1] = 5
    ids[7, 1] = ids[14, 1] = 2
    check(19, 8, ids)


def test_every_token_to_one_expert() -> None:
    check(37, 8, torch.full((37, 1), 6))


@pytest.mark.parametrize("case", ["one token", "ragged", "one expert", "duplicates", "random 5x3"])
def test_routing_laid_out_in_the_kernel_equals_the_alignment(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ROUTE_IN_KERNEL_MAX_CELLS (on by default) the GEMM programs lay the routing out from
    topk_ids themselves: the same output as through the alignment's layout (the cells at 0), bit
    for bit (the same blocks of the same pairs), and the float64 reference's; a routing past the
    cells takes the layout."""
    from atomrt.workers.kernels.moe import fused_moe

    ids = {
        "one token": torch.tensor([[5, 1, 7, 0, 2, 6]]),
        "ragged": torch.cat([torch.zeros(19, 1), torch.full((19, 1), 3)], dim=1).long(),
        "one expert": torch.full((20, 1), 6),
        "duplicates": torch.tensor([[2, 2], [7, 2], [2, 7]]),
        "random 5x3": random_routing(5, 8, 3)[1],
    }[case]
    if case == "ragged":
        ids[0, 1], ids[7, 1] = 5, 2
    g = torch.Generator().manual_seed(4)
    x = torch.randn(ids.shape[0], HIDDEN, generator=g)
    w13, w2 = make_experts(8)
    weights = torch.rand(ids.shape, generator=g)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    monkeypatch.setattr(fused_moe, "ROUTE_IN_KERNEL_MAX_CELLS", 0)
    assert isinstance(fused_moe.in_kernel_routing(args[4], 16, 8), MoEAlignment)
    laid_out = fused_experts(*args, SMALL, SMALL, sum_pairs=False)
    monkeypatch.setattr(fused_moe, "ROUTE_IN_KERNEL_MAX_CELLS", 1024)
    assert isinstance(fused_moe.in_kernel_routing(args[4], 16, 8), fused_moe.InKernelRouting)
    in_kernel = fused_experts(*args, SMALL, SMALL, sum_pairs=False)
    assert torch.equal(in_kernel, laid_out)
    expected = pair_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(in_kernel.double().cpu(), expected, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(fused_moe, "ROUTE_IN_KERNEL_MAX_CELLS", 8)
    assert not isinstance(fused_moe.in_kernel_routing(args[4], 16, 8), fused_moe.InKernelRouting)


def test_pairs_unsummed_are_each_slots_weighted_output() -> None:
    """`sum_pairs=False`: the kernel and the torch loop both give every (token, slot) pair's
    weighted expert output [tokens, top_k, hidden], the float64 reference's; a token routed twice
    to one expert keeps both rows."""
    weights, ids = random_routing(9, 8, 3)
    ids[4, 2] = ids[4, 0]
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3))
    w13, w2 = make_experts(8)
    expected = pair_reference(x, w13, w2, weights, ids)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    kernel = fused_experts(*args, SMALL, SMALL, sum_pairs=False)
    loop = fused_experts_ref(*(t.double().cpu() for t in args[:4]), ids, sum_pairs=False)
    for got in (kernel, loop):
        assert got.shape == (9, 3, HIDDEN)
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-5)
    summed = fused_experts_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    torch.testing.assert_close(summed, expected.sum(dim=1), rtol=0, atol=1e-12)


def test_compiled_fused_moe_gives_the_eager_result() -> None:
    """A FusedMoE (softmax top-k routing, Mixtral's and Qwen3-MoE's) compiled by Inductor: the
    expert op's fake shape [tokens, top_k, hidden] is what it returns, and the traced sum gives
    the eager layer's output and the float64 reference's."""
    from atomrt.workers.layers.moe import FusedMoE, select_experts

    moe = FusedMoE(8, 2, HIDDEN, INTER, renormalize=True)
    gen = torch.Generator().manual_seed(4)
    w13, w2 = make_experts(8)
    with torch.no_grad():
        moe.w13_weight.copy_(w13)
        moe.w2_weight.copy_(w2)
        moe.gate.weight.copy_(torch.randn(8, HIDDEN, generator=gen))
    x = torch.randn(7, HIDDEN, generator=gen)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(moe, backend="inductor", fullgraph=True, dynamic=False)(x)
        eager = moe(x)
    weights, ids = select_experts(F.linear(x, moe.gate.weight), 2, True)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        got.double(), reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5
    )


def test_fp8_pairs_unsummed_and_traced_sum() -> None:
    """The FP8 twin: `sum_pairs=False` gives each pair's row of the float64 dequantizing
    reference (one e4m3 step apart now and then: see test_fp8_kernels), and the layer's call,
    compiled by Inductor, sums the op's [tokens, top_k, hidden] rows to the eager result."""
    from types import SimpleNamespace

    from atomrt.workers.kernels.moe.fused_moe_fp8 import fused_experts_fp8
    from atomrt.workers.layers.quantization.fp8 import fp8_experts_ref, quantize_fp8
    from atomrt.workers.layers.quantization.fp8_ops import fp8_routed_experts

    gen = torch.Generator().manual_seed(6)
    e, hidden, inter, top_k, group = 6, 256, 160, 2, 128
    q13, s13 = quantize_fp8(torch.randn(e, 2 * inter, hidden, generator=gen) * 0.1, group)
    q2, s2 = quantize_fp8(torch.randn(e, hidden, inter, generator=gen) * 0.1, group)
    x = torch.randn(5, hidden, generator=gen)
    weights, ids = random_routing(5, e, top_k, seed=7)
    quantize = {} if DEVICE == "cuda" else {"quantize": quantize_fp8}
    experts = [t.to(DEVICE) for t in (q13, q2, s13, s2, weights, ids)]
    pairs = fused_experts_fp8(x.to(DEVICE), *experts, group, **quantize, sum_pairs=False)
    ref = fp8_experts_ref(x.double(), q13, q2, s13, s2, weights.double(), ids, group, False)
    assert pairs.shape == ref.shape == (5, top_k, hidden)
    err = (pairs.cpu().double() - ref).abs()
    assert err.max() < 2e-2 * ref.abs().max() and err.mean() < 1e-3 * ref.abs().max()

    moe = SimpleNamespace(
        w13_weight=q13, w2_weight=q2, w13_weight_scale=s13, w2_weight_scale=s2, fp8_group_k=group
    )
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x, w, i: fp8_routed_experts(x, w, i, moe), backend="inductor", fullgraph=True
    )
    got, eager = compiled(x, weights, ids), fp8_routed_experts(x, weights, ids, moe)
    assert got.shape == (5, hidden)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)


def test_alignment_layout() -> None:
    """Each block holds one expert's pairs, in order, then padding; empty experts take no block;
    the used length is on the device and the layout's size is the host bound."""
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]])
    block_m, num_experts = 4, 6
    al = moe_align_block_size(ids, block_m, num_experts)
    num_pairs = ids.numel()
    assert al.sorted_pair_ids.shape[0] == max_padded_pairs(num_pairs, num_experts, block_m)
    used = int(al.num_padded_pairs[0])
    # counts: e0 2, e1 2, e2 1, e3 5 -> padded 4 + 4 + 4 + 8
    assert used == 20
    flat = ids.reshape(-1)
    for b in range(used // block_m):
        rows = al.sorted_pair_ids[b * block_m : (b + 1) * block_m].tolist()
        real = [p for p in rows if p < num_pairs]
        assert all(int(flat[p]) == int(al.expert_ids[b]) for p in real)
        assert real == sorted(real) and rows[: len(real)] == real  # pairs first, then padding
    placed = sorted(p for p in al.sorted_pair_ids[:used].tolist() if p < num_pairs)
    assert placed == list(range(num_pairs))
    assert set(al.expert_ids[: used // block_m].tolist()) == {0, 1, 2, 3}  # 4, 5: no block


def test_alignment_sizes_depend_on_shapes_only() -> None:
    """Graph safety: two routings of one shape give tensors of the same sizes."""
    a = moe_align_block_size(torch.zeros(9, 2, dtype=torch.int64), 16, 8)
    b = moe_align_block_size(torch.arange(18).reshape(9, 2) % 8, 16, 8)
    assert [t.shape for t in a] == [t.shape for t in b]


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,block_m",
    [
        (1, 64, 6, 16),
        (8, 64, 6, 16),
        (32, 64, 6, 64),
        (3, 60, 4, 32),
        (5, 8, 2, 4),
        (1, 256, 8, 16),
    ],
)
def test_one_program_alignment_equals_the_torch_one(
    num_tokens: int, num_experts: int, top_k: int, block_m: int
) -> None:
    """The one-launch layout (through Triton's interpreter on CPU) is the torch path's, tensor for
    tensor: a decode step's routing, a batch's, experts not a power of two, more experts than
    pairs."""
    _, ids = random_routing(num_tokens, num_experts, top_k, seed=num_tokens + num_experts)
    ids = ids.to(DEVICE)
    skewed = ids.clone()
    skewed[: num_tokens // 2 + 1, 0] = num_experts - 1  # one expert busier than the rest
    for routing in (ids, skewed, ids.to(torch.int32)):
        got, want = (
            f(routing, block_m, num_experts) for f in (moe_align_one_program, moe_align_torch)
        )
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), (g, w)


def test_one_program_alignment_bounds() -> None:
    assert fits_one_program(6, 64) and fits_one_program(192, 64) and fits_one_program(64, 256)
    assert not fits_one_program(0, 64) and not fits_one_program(257, 64)
    with pytest.raises(ValueError, match="exceed one program"):
        moe_align_one_program(torch.zeros(300, 1, dtype=torch.int64), 16, 64)


def test_down_config_takes_the_gate_up_block_m() -> None:
    weights, ids = random_routing(6, 4, 2)
    x = torch.randn(6, HIDDEN)
    w13, w2 = make_experts(4)
    wide = MoEConfig(32, 32, 32, 1, 4, 1)
    got = fused_experts(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)), SMALL, wide)
    torch.testing.assert_close(
        got.double().cpu(), reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5
    )


def test_config_lookup() -> None:
    assert [bucket_tokens(n) for n in (0, 1, 3, 64, 65)] == [1, 1, 4, 64, 128]
    decode = heuristic_config("gate_up", 8, 128, 8, 768, 2048)
    prefill = heuristic_config("gate_up", 8192, 128, 8, 768, 2048)
    assert decode.block_m == 16 and prefill.block_m == 64
    key = ("down", 4, 48, 40)
    swept = {16: MoEConfig(16, 32, 32, 1, 4, 2), 256: MoEConfig(64, 64, 32, 8, 8, 3)}
    CONFIGS[key] = swept
    try:
        assert pick_config("down", 10, 4, 2, 48, 40) == swept[16]
        assert pick_config("down", 17, 4, 2, 48, 40) == swept[256]
        # past the largest swept bucket: the heuristic, not the largest entry
        past = heuristic_config("down", 4096, 4, 2, 48, 40)
        assert pick_config("down", 4096, 4, 2, 48, 40) == past != swept[256]
    finally:
        del CONFIGS[key]
    assert pick_config("down", 10, 4, 2, 48, 40) == heuristic_config("down", 10, 4, 2, 48, 40)
    with pytest.raises(ValueError, match="power of two"):
        MoEConfig(24, 32, 32, 1, 4, 1)


def test_fp8_launch_table_reaches_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape's FP8_MOE_LAUNCHES entry (other columns a program, a K step past the down GEMM's
    width, more warps and stages) gives the float64 dequantizing reference, per-row scales."""
    from atomrt.workers.kernels.moe import fused_moe_fp8 as fm
    from atomrt.workers.layers.quantization.fp8 import fp8_experts_ref, quantize_fp8

    gen = torch.Generator().manual_seed(8)
    e, hidden, inter, top_k = 4, 256, 160, 2
    q13, s13 = quantize_fp8(torch.randn(e, 2 * inter, hidden, generator=gen) * 0.1, None)
    q2, s2 = quantize_fp8(torch.randn(e, hidden, inter, generator=gen) * 0.1, None)
    x = torch.randn(3, hidden, generator=gen)
    weights, ids = random_routing(3, e, top_k, seed=9)
    wide = fm.FP8MoELaunch(block_n=32, block_k=256, num_warps=8, num_stages=4)
    monkeypatch.setitem(fm.FP8_MOE_LAUNCHES, ("gate_up", inter, hidden), wide)
    monkeypatch.setitem(fm.FP8_MOE_LAUNCHES, ("down", hidden, inter), wide)
    assert fm.fp8_moe_launch("down", hidden, inter) is wide
    quantize = {} if DEVICE == "cuda" else {"quantize": quantize_fp8}
    experts = [t.to(DEVICE) for t in (q13, q2, s13, s2, weights, ids)]
    got = fm.fused_experts_fp8(x.to(DEVICE), *experts, None, **quantize)
    ref = fp8_experts_ref(x.double(), q13, q2, s13, s2, weights.double(), ids, None, True)
    err = (got.cpu().double() - ref).abs()
    assert err.max() < 2e-2 * ref.abs().max() and err.mean() < 1e-3 * ref.abs().max()
    with pytest.raises(ValueError, match="block_k"):
        fm.FP8MoELaunch(block_k=96)


@pytest.mark.parametrize("seed", range(6))
def test_random_routings_laid_out_in_the_kernel(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random decode-sized routings (1-12 tokens, top 1-8 of 4-66 experts, not powers of two;
    repeated experts in a row): the programs' own layout gives the alignment's output bit for
    bit, whatever the block size."""
    from atomrt.workers.kernels.moe import fused_moe

    rng = torch.Generator().manual_seed(100 + seed)
    tokens = int(torch.randint(1, 13, (1,), generator=rng))
    experts = int(torch.randint(4, 67, (1,), generator=rng))
    top_k = int(torch.randint(1, min(8, experts) + 1, (1,), generator=rng))
    ids = torch.randint(0, experts, (tokens, top_k), generator=rng)
    block_m = (16, 32)[seed % 2]
    cfg = MoEConfig(block_m=block_m, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
    x = torch.randn(tokens, HIDDEN, generator=rng)
    w13, w2 = make_experts(experts, seed)
    weights = torch.rand(ids.shape, generator=rng)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    monkeypatch.setattr(fused_moe, "ROUTE_IN_KERNEL_MAX_CELLS", 0)
    laid_out = fused_experts(*args, cfg, cfg, sum_pairs=False)
    monkeypatch.setattr(fused_moe, "ROUTE_IN_KERNEL_MAX_CELLS", 1 << 20)
    assert isinstance(
        fused_moe.in_kernel_routing(args[4], block_m, experts), fused_moe.InKernelRouting
    )
    assert torch.equal(fused_experts(*args, cfg, cfg, sum_pairs=False), laid_out)

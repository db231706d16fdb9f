"""DeepSeek-V4's kernels (workers/kernels/v4/) against float64 references written here from the
formulas, on CUDA when present, else on CPU through Triton's interpreter, over a cache whose rows no query owns hold NaN
(a kernel that reads a foreign row fails the test).

- the compressor: per channel, softmax over the window's tokens of gate + ape, weighting kv; a
  CSA window is the previous window's first-half projections and its own second half (window 0:
  its own only); then RMS-normalised times the weight;
- the indexer: score = sum_h w_h relu(q_h . k) / sqrt(Di), -inf for a missing entry;
- sparse attention: softmax over the given keys and the head's sink, the keys as values.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_device import DEVICE

from atomrt.workers.kernels.v4.v4_kernels import (
    ATTN_PLANS,
    v4_index_scores,
    v4_pool,
    v4_sparse_attention,
)

NAN = float("nan")


def _cache(num_slots: int, width: int, owned: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.full((num_slots, width), NAN)
    rows[owned] = torch.randn(len(owned), width, generator=g)
    return rows


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("rate", [4, 12])  # 12: a window over several tiles, the last one partial
def test_pool_matches_float64(overlap: bool, rate: int) -> None:
    d, eps = 24, 1e-6
    c = 2 if overlap else 1
    span = c * rate
    width = 3 + 2 * c * d  # some leading columns, then kv, then gate
    kv_col, gate_col = 3, 3 + c * d
    windows = torch.tensor([0, 1, 3, 2, 5, -1])  # -1: a row that ends no window
    n = windows.shape[0]
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(400, generator=g)[: n * span].view(n, span)
    if overlap:
        slots[0, :rate] = -1  # window 0 has no previous window
    rows = _cache(400, width, slots[:-1][slots[:-1] >= 0].tolist(), 2)  # the last row's: NaN
    ape = torch.randn(rate, c * d, generator=g)
    norm = torch.randn(d, generator=g)
    out = torch.full((n, d), NAN, device=DEVICE)
    args = (t.to(DEVICE) for t in (rows, slots, windows, ape, norm))
    v4_pool(*args, kv_col, gate_col, eps, overlap, out)
    out = out.cpu()

    ref = torch.zeros(n, d, dtype=torch.float64)
    r64 = rows.double()
    for i in range(n - 1):
        kvs, gates = [], []
        for j in range(span):
            if overlap and j < rate and windows[i] == 0:
                continue
            ch = (j // rate) * d if overlap else 0
            row = r64[slots[i, j]]
            kvs.append(row[kv_col + ch : kv_col + ch + d])
            gates.append(
                row[gate_col + ch : gate_col + ch + d] + ape[j % rate, ch : ch + d].double()
            )
        weights = torch.softmax(torch.stack(gates), dim=0)
        pooled = (weights * torch.stack(kvs)).sum(0)
        ref[i] = pooled / torch.sqrt(pooled.square().mean() + eps) * norm.double()
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_index_scores_match_float64() -> None:
    """Three tiles of 64 entries: row 1's last two hold none (only -inf is stored there)."""
    n, h, di, t = 3, 5, 20, 150
    width, col = 50, 7
    g = torch.Generator().manual_seed(3)
    entry_slots = torch.randperm(600, generator=g)[: n * t].view(n, t)
    entry_slots[1, 30:] = -1
    entry_slots[2, ::3] = -1
    rows = _cache(600, width, entry_slots[entry_slots >= 0].tolist(), 4)
    iq = torch.randn(n, h, di, generator=g)
    iw = torch.randn(n, h, generator=g)
    got = v4_index_scores(*(t.to(DEVICE) for t in (iq, iw, rows, entry_slots)), col).cpu()
    for i in range(n):
        for j in range(t):
            if entry_slots[i, j] < 0:
                assert got[i, j] == float("-inf")
                continue
            k = rows[entry_slots[i, j], col : col + di].double()
            s = (torch.relu(iq[i].double() @ k) * iw[i].double()).sum() / math.sqrt(di)
            assert abs(got[i, j].item() - s.item()) < 1e-5


# every launch plan: 16 or 32 heads a program gives several head tiles at 20 heads; the tensor-core
# plans take float16 (Triton's interpreter multiplies bfloat16 as raw bits, float16 as numbers)
@pytest.mark.parametrize("plan", list(ATTN_PLANS))
@pytest.mark.parametrize("num_heads,num_keys", [(4, 21), (20, 40), (3, 0), (4, 70)])
def test_sparse_attention_matches_float64(
    num_heads: int, num_keys: int, plan: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """70 keys: whole blocks of masked keys (a fixed-width entry list's tail, and one in the
    middle) are skipped, the rest as the reference. Each launch plan; with tensor cores the
    products take 16-bit operands (the probabilities rounded to them too)."""
    from atomrt.workers.kernels.v4 import v4_kernels

    tile, warps, tensor_cores = ATTN_PLANS[plan]
    monkeypatch.setattr(v4_kernels, "ATTN_HEAD_TILE", tile)
    monkeypatch.setattr(v4_kernels, "ATTN_WARPS", warps)
    monkeypatch.setattr(v4_kernels, "ATTN_TENSOR_CORES", tensor_cores)
    dtype, tol = (torch.float32, 1e-5)
    if tensor_cores:  # the model's bfloat16 on CUDA
        dtype, tol = (torch.bfloat16, 3e-2) if DEVICE == "cuda" else (torch.float16, 5e-3)
    n, d, width = 3, 24, 64
    scale = d**-0.5
    g = torch.Generator().manual_seed(5)
    slots = torch.randint(0, 100, (n, num_keys), generator=g)
    col = torch.randint(0, width - d, (n, num_keys), generator=g)
    offsets = slots * width + col
    if num_keys:
        offsets[0, 5:9] = -1
    if num_keys > 64:
        offsets[:, 16:32] = -1
        offsets[1:, 40:] = -1
    rows = torch.randn(100, width, generator=g).to(dtype)  # every element is some key's column
    q = torch.randn(n, num_heads, d, generator=g).to(dtype)
    sinks = torch.randn(num_heads, generator=g)
    out = torch.full((n, num_heads, d), NAN, device=DEVICE, dtype=dtype)
    v4_sparse_attention(*(t.to(DEVICE) for t in (q, rows, offsets, sinks)), scale, out)
    out = out.cpu()
    flat = rows.double().flatten()
    for i in range(n):
        keys = [flat[o : o + d] for o in offsets[i].tolist() if o >= 0]
        keys = torch.stack(keys) if keys else torch.zeros(0, d, dtype=torch.float64)
        logits = torch.cat((q[i].double() @ keys.T * scale, sinks.double().unsqueeze(1)), dim=1)
        probs = torch.softmax(logits, dim=1)[:, :-1]
        assert torch.allclose(out[i].double(), probs @ keys, atol=tol, rtol=tol)


def test_sparse_attention_stops_at_each_rows_keys() -> None:
    """`key_lens`: a row attends its first key_lens[i] offsets alone. Where the rest are -1 (a
    fixed-width entry list's tail) the output is the full walk's, bit for bit; a length short of
    the row's keys, inside a block, gives the attention over those before it (the reference's)."""
    n, h, d, width, k = 3, 4, 24, 64, 70
    g = torch.Generator().manual_seed(6)
    offsets = torch.randint(0, 100, (n, k), generator=g) * width + 8
    lens = torch.tensor([70, 33, 0])
    offsets[1, 33:] = -1
    offsets[2, :] = -1
    rows = torch.randn(100, width, generator=g)
    q = torch.randn(n, h, d, generator=g)
    sinks = torch.randn(h, generator=g)
    args = [t.to(DEVICE) for t in (q, rows, offsets, sinks)]
    full, stopped = (torch.empty(n, h, d, device=DEVICE) for _ in range(2))
    v4_sparse_attention(*args, d**-0.5, full)
    v4_sparse_attention(*args, d**-0.5, stopped, lens.to(DEVICE))
    assert torch.equal(full, stopped)
    short = torch.empty(n, h, d, device=DEVICE)
    v4_sparse_attention(*args, d**-0.5, short, torch.tensor([20, 33, 0], device=DEVICE))
    keys = rows.double().flatten().unfold(0, d, 1)[offsets[0, :20]]
    logits = torch.cat((q[0].double() @ keys.T * d**-0.5, sinks.double().unsqueeze(1)), dim=1)
    want = torch.softmax(logits, dim=1)[:, :-1] @ keys
    torch.testing.assert_close(short[0].cpu().double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(short[1:], full[1:])


def check_kernels_read_e4m3_rows(device: str) -> None:
    """Each kernel over an e4m3 cache (kv_cache_dtype fp8) gives what it gives over the same rows
    widened to float32: the loads widen, the arithmetic is float32 either way."""
    g = torch.Generator(device=device).manual_seed(0)
    num_slots, d, rate = 64, 32, 4
    width = 2 * (2 * d) + d  # kv, gate (overlapping windows: 2 * d each), an entry
    rows8 = torch.randn(num_slots, width, device=device, generator=g).to(torch.float8_e4m3fn)
    rows32 = rows8.float()
    slots = torch.randint(0, num_slots, (5, 2 * rate), device=device, generator=g)
    windows = torch.arange(5, device=device)
    ape = torch.randn(rate, 2 * d, device=device, generator=g)
    norm = torch.randn(d, device=device, generator=g)
    pooled = [
        v4_pool(rows, slots, windows, ape, norm, 0, 2 * d, 1e-6, True, rows32.new_empty(5, d))
        for rows in (rows8, rows32)
    ]
    torch.testing.assert_close(pooled[0], pooled[1], atol=1e-5, rtol=1e-5)
    iq = torch.randn(5, 4, d, device=device, generator=g)
    iw = torch.rand(5, 4, device=device, generator=g)
    entries = torch.randint(-1, num_slots, (5, 9), device=device, generator=g)
    scores = [v4_index_scores(iq, iw, rows, entries, 4 * d) for rows in (rows8, rows32)]
    torch.testing.assert_close(scores[0], scores[1], atol=1e-5, rtol=1e-5)
    q = torch.randn(5, 8, d, device=device, generator=g)
    offsets = torch.where(entries >= 0, entries * width + 4 * d, -1)
    sinks = torch.randn(8, device=device, generator=g)
    out = [torch.empty_like(q) for _ in range(2)]
    for rows, o in zip((rows8, rows32), out):
        v4_sparse_attention(q, rows, offsets, sinks, d**-0.5, o)
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=1e-5)


def test_kernels_read_e4m3_rows() -> None:
    check_kernels_read_e4m3_rows(DEVICE)


@pytest.mark.skipif(
    DEVICE == "cuda",
    reason="runs the kernels on CPU tensors (USE_KERNELS_ON_CPU), which only Triton's interpreter "
    "launches; TRITON_INTERPRET is off on a CUDA host",
)
@pytest.mark.parametrize("name", ["hca_first", "csa_hca"])
def test_model_through_the_kernels_matches_transformers(
    name: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole tiny model with the compressor and the attention in the kernels (through the
    interpreter): a ragged prefill and decode steps within 1e-4 of transformers' logits."""
    pytest.importorskip("transformers")
    from model_harness import load_hf, max_logit_diff, run_prefill_and_decode
    from v4_harness import build_v4_folder

    from atomrt.runtime.config import Config
    from atomrt.workers.layers import v4_attention
    from atomrt.workers.loading.loader import load_model

    monkeypatch.setattr(v4_attention, "USE_KERNELS_ON_CPU", True)
    folder = build_v4_folder(tmp_path, name)
    model = load_model(Config(model=str(folder)), "cpu", torch.float32).model
    prompts = [[3, 17, 42, 99, 5, 8, 61, 11, 12, 13, 14, 15, 16, 17, 18], [7, 1, 120]]
    result = run_prefill_and_decode(model, prompts, 3, block_size=4, num_pad_rows=1)
    assert max_logit_diff(result, load_hf(folder), prompts) <= 1e-4


def test_flash_kernels_compile_as_loops_without_spills() -> None:
    """benchmarks/kernel_stats.py v4 compiles the kernels for sm_90 as DeepSeek-V4-Flash launches
    them (no GPU needed): the compressor pools a window in a loop over tiles of slots, so an HCA
    window of 128 tokens is a loop and not 128 unrolled copies (unrolled, it compiled for minutes
    and spilled 12 KB a thread), and no compressor spills; nor do the attention's 16-head plans
    (the default's 64 heads a program spill 25 KB a thread)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "kernel_stats.py"), "v4"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = [json.loads(line) for line in proc.stdout.splitlines()]
    pools = {r["kernel"]: r for r in found if r["kernel"].startswith("pool")}
    assert {"pool_hca", "pool_csa", "pool_csa_indexer"} == pools.keys()
    for name, row in pools.items():
        assert row["stack"] == 0 and row["loop_spill_loads"] == 0, (name, row)
        assert row["programs_per_sm"] >= 2, (name, row)
    assert 0 < pools["pool_hca"]["loop_instructions"] < 2000, pools["pool_hca"]
    # the attention's 16-head plans keep their [16, 512] accumulator in registers
    tiles = [r for r in found if r["kernel"] == "sparse_attention" and r["block_h"] == 16]
    assert len(tiles) == 3
    for row in tiles:
        assert row["stack"] == 0 and row["programs_per_sm"] >= 2, row


# bfloat16 on CUDA only (Triton's interpreter multiplies bfloat16 as raw bits): the model's dtype,
# its products rounded to bfloat16 between the launches
FUSED_EXPERT_DTYPES = [pytest.param(torch.float32, 1e-5, id="float32")] + [
    pytest.param(
        torch.bfloat16,
        3e-2,
        id="bfloat16",
        marks=pytest.mark.gpu,
    )
]


@pytest.mark.parametrize("dtype,tol", FUSED_EXPERT_DTYPES)
@pytest.mark.parametrize("num_tokens,top_k", [(1, 6), (5, 2), (40, 3)])
def test_fused_experts_match_float64(
    num_tokens: int, top_k: int, dtype: torch.dtype, tol: float
) -> None:
    """The float routed experts' kernel launches (v4_experts.py): each pair's weighted
    w2 @ swiglu_limit(w13 @ x), the SwiGLU clamped (gate <= limit, |up| <= limit: a limit the
    pre-activations cross), against a float64 reference; a token's pairs stay apart."""
    from atomrt.workers.kernels.v4.v4_experts import v4_fused_experts

    hidden, inter, num_experts, limit = 48, 40, 8, 0.7
    g = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * 0.3).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g)
    args = (t.to(DEVICE) for t in (x, w13, w2, weights, ids))
    got = v4_fused_experts(*args, limit).cpu().double()
    assert got.shape == (num_tokens, top_k, hidden)
    h = torch.einsum("nd,nkid->nki", x.double(), w13.double()[ids])
    gate, up = h.chunk(2, dim=-1)
    assert gate.max() > limit and up.abs().max() > limit  # the clamp takes part
    act = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    want = torch.einsum("nki,nkdi->nkd", act, w2.double()[ids]) * weights.double().unsqueeze(-1)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("hc", [2, 4])
def test_hc_mix_matches_float64(hc: int) -> None:
    """The mHC mixing weights in one launch (v4_hc.py) against the torch formulas
    (v4_hyper.hc_mix, which the model tests hold to transformers) in float64: pre, post and the
    Sinkhorn-Knopp comb, doubly stochastic."""
    from atomrt.workers.kernels.v4.v4_hc import v4_hc_mix
    from atomrt.workers.layers.v4_hyper import hc_mix

    n, iters, eps = 5, 20, 1e-6
    g = torch.Generator().manual_seed(11)
    mixes = torch.randn(n, (2 + hc) * hc, generator=g) * 3
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + hc) * hc, generator=g)
    got = v4_hc_mix(*(t.to(DEVICE) for t in (mixes, scale, base)), hc, iters, eps)
    want = hc_mix(mixes.double(), scale.double(), base.double(), hc, iters, eps)
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_.cpu().double(), w, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[2].sum(dim=-2).cpu(), torch.ones(n, hc), atol=1e-5)


@pytest.mark.gpu
def test_default_launches_give_the_torch_path_logits_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tiny V4 preset on CUDA in float32, a ragged prefill and decode steps: the default
    launches (the attention's 16-head tensor-core plan, whose float32 q keeps float32 products,
    the mHC mixing kernel and the rotary kernel) give the logits of the 64-head float32 plan with
    torch's mixing and rotary (to float32 rounding)."""
    from model_harness import run_prefill_and_decode

    from atomrt.runtime.config import Config, ModelConfig
    from atomrt.workers.kernels.v4 import v4_kernels
    from atomrt.workers.layers import v4_hyper, v4_modules
    from atomrt.workers.loading.loader import load_model

    assert v4_kernels.DEFAULT_ATTN_PLAN == "h16-tc"
    assert v4_hyper.HC_MIX_KERNEL and v4_modules.ROPE_KERNEL
    config = Config(model="tiny-deepseek-v4", model_config=ModelConfig(load_format="dummy"))
    model = load_model(config, "cuda", torch.float32).model
    prompts = [list(range(3, 40)), [5, 6, 7], list(range(50, 70))]
    default = run_prefill_and_decode(model, prompts, 4, block_size=16)
    for name in ("ATTN_HEAD_TILE", "ATTN_WARPS", "ATTN_TENSOR_CORES"):
        monkeypatch.setattr(v4_kernels, name, getattr(v4_kernels, name))  # restored after
    v4_kernels.use_attn_plan("h64")
    monkeypatch.setattr(v4_hyper, "HC_MIX_KERNEL", False)
    monkeypatch.setattr(v4_modules, "ROPE_KERNEL", False)
    torch_path = run_prefill_and_decode(model, prompts, 4, block_size=16)
    assert torch_path.sequences == default.sequences
    for a, b in zip(torch_path.logits, default.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tail_kernel_matches_torch(heads, dtype: torch.dtype) -> None:
    """The rotary embedding in one launch (v4_rope.py) against the torch formulas
    (v4_modules.rope_tail, which the model tests hold to transformers): a key [n, D] or a
    query [n, H, D] (one angle per token, shared by its heads), 6 pairs after 28 channels left
    as they are; float32 to its rounding, bfloat16 to one rounding of the result."""
    from atomrt.workers.kernels.v4.v4_rope import v4_rope_tail
    from atomrt.workers.layers.v4_modules import rope_tail

    n, d, half = 5, 40, 6
    g = torch.Generator().manual_seed(13)
    shape = (n, d) if heads is None else (n, heads, d)
    x = torch.randn(*shape, generator=g).to(dtype)
    angles = torch.rand(n, half, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    if heads is not None:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    got = v4_rope_tail(*(t.to(DEVICE) for t in (x, cos, sin))).cpu()
    want = rope_tail(x, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got[..., : d - 2 * half], x[..., : d - 2 * half])
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)

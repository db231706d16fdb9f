"""Multi-head latent attention on CPU: the absorbed decode path and the decompressed prefill path
of the torch reference against a float64 reference written here from the formula (and so against
each other), verify rows included; and the `mla_attention` op through an MLA layer: the latent
cache rows it writes, padded rows, and the same output whichever path a sequence takes. Those
stay on the CPU (the op's torch path); the op's kernel path runs on CUDA when present, else on CPU
through Triton's interpreter."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_device import DEVICE, assert_same_roundings

from atomrt.runtime.config import Config
from atomrt.runtime.forward_context import AttentionMetaData, Context, set_forward_context
from atomrt.workers.layers.mla import MLAAttention
from atomrt.workers.layers.mla_ref import mla_paged_ref
from atomrt.workers.layers.rotary import RotaryEmbedding
from atomrt.workers.runner.kv_cache import MLAKVCacheTensor, allocate_kv_cache, kv_layer_specs

H, NOPE, ROPE, V, L, HIDDEN = 4, 16, 8, 12, 32, 48
BLOCK, NUM_BLOCKS = 4, 24
SCALE = (NOPE + ROPE) ** -0.5


def _layer(q_lora: int | None = 24, seed: int = 0) -> MLAAttention:
    torch.manual_seed(seed)
    layer = MLAAttention(
        0,
        HIDDEN,
        H,
        q_lora,
        L,
        NOPE,
        ROPE,
        V,
        SCALE,
        RotaryEmbedding(ROPE, 256, 10000.0, None, True),
    )
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    layer.process_weights_after_loading()
    return layer


def _reference(
    q: torch.Tensor, latent: list[torch.Tensor], seqs: list, kv_b: torch.Tensor
) -> torch.Tensor:
    """float64: row j of a sequence of n rows over context c attends keys 0..c - n + j, each head
    h with key [kv_c W_k,h^T | k_pe] and value kv_c W_v,h^T, W_k,h / W_v,h its rows of kv_b."""
    w = kv_b.double().view(H, NOPE + V, L)
    out = torch.zeros(q.shape[0], H, V, dtype=torch.float64)
    for (_, start, n, c), rows in zip(seqs, latent):
        rows = rows.double()
        kv_c, k_pe = rows[:, :L], rows[:, L:]
        for j in range(n):
            seen = c - n + j + 1
            for h in range(H):
                keys = torch.cat((kv_c[:seen] @ w[h, :NOPE].T, k_pe[:seen]), dim=-1)
                values = kv_c[:seen] @ w[h, NOPE:].T
                p = torch.softmax(keys @ q[start + j, h].double() * SCALE, dim=0)
                out[start + j, h] = p @ values
    return out


def _cache_with_context(seqs: list, seed: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """A latent cache holding each sequence's context in shuffled blocks; its block tables (-1 past
    the end) and each context's rows."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(NUM_BLOCKS, BLOCK, L + ROPE, generator=gen)
    order = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(order)
    width = max(-(-c // BLOCK) for *_, c in seqs)
    tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    rows = []
    for i, (*_, c) in enumerate(seqs):
        blocks = [order.pop() for _ in range(-(-c // BLOCK))]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        rows.append(cache[blocks].flatten(0, 1)[:c])
    return cache, tables, rows


# (sequence, first row, rows, context length): decode rows, a 3-row verify, a long-ish chunk
SEQS = [(0, 0, 1, 9), (1, 1, 3, 7), (2, 4, 1, 1), (3, 5, 6, 14)]


@pytest.mark.parametrize("path", ["absorbed", "decompressed"])
def test_both_paths_equal_the_float64_formula(path: str) -> None:
    layer = _layer()
    cache, tables, rows = _cache_with_context(SEQS, seed=1)
    q = torch.randn(11, H, NOPE + ROPE)
    out = torch.full((11, H, V), float("nan"))
    seqs = (SEQS, []) if path == "absorbed" else ([], SEQS)
    mla_paged_ref(q, cache, out, *seqs, tables, layer.weights(), SCALE)
    expected = _reference(q, rows, SEQS, layer.kv_b_proj.weight.detach())
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)


def _md(positions: list[list[int]], num_pad_rows: int, tables: torch.Tensor) -> AttentionMetaData:
    cu = [0]
    for p in positions:
        cu.append(cu[-1] + len(p))
    context = [p[-1] + 1 for p in positions]
    slots = [
        int(tables[s, pos // BLOCK]) * BLOCK + pos % BLOCK
        for s, seq in enumerate(positions)
        for pos in seq
    ] + [-1] * num_pad_rows
    return AttentionMetaData(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor(context, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_seqlen_q=max(len(p) for p in positions),
        max_seqlen_k=max(context),
        num_seqs=len(positions),
        num_tokens=cu[-1],
        cu_seqlens_q_cpu=cu,
        context_lens_cpu=context,
    )


def _unnormed_input(layer, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's `forward` input for rows taken as already normed: its `in_proj`'s output."""
    return layer.in_proj(hidden)


def _run(layer, hidden, positions, md, cache, config) -> torch.Tensor:
    pos = torch.tensor(
        [p for seq in positions for p in seq] + [0] * (hidden.shape[0] - md.num_tokens)
    )
    ctx = Context(positions=pos, batch_size=md.num_seqs, running_tokens=hidden.shape[0])
    with (
        torch.inference_mode(),
        set_forward_context(md, config, ctx, no_compile_layers={0: layer}, kv_cache_data=cache),
    ):
        return layer(pos, _unnormed_input(layer, hidden))


@pytest.mark.parametrize("q_lora", [24, None], ids=["q_lora", "q_proj"])
def test_op_writes_latent_rows_and_zeroes_padded_rows(q_lora) -> None:
    """The op writes [kv_a_layernorm(kv_c) | rotated k_pe] at each row's slot and nothing for a
    padded row; attention rows past the step's sequences come out zero (their o_proj: zero)."""
    layer = _layer(q_lora)
    # on the CPU: the op's torch path (CUDA tensors take the kernels, tested below)
    cache = allocate_kv_cache(kv_layer_specs({0: layer}), NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    latent = cache["layers.0"].kv_cache
    latent.fill_(7.0)
    tables = torch.tensor([[5, 9], [2, -1]], dtype=torch.int32)
    positions = [[0, 1, 2, 3, 4], [0, 1]]
    md = _md(positions, num_pad_rows=3, tables=tables)
    hidden = torch.randn(10, HIDDEN)
    out = _run(layer, hidden, positions, md, cache, Config(enforce_eager=True))
    assert torch.isfinite(out).all() and torch.equal(out[7:], torch.zeros(3, HIDDEN))
    # the rows the op wrote, recomputed from the layer's projections
    with torch.no_grad():
        a = _unnormed_input(layer, hidden)
        kv_a = a[:, -(L + ROPE) :]  # in_proj's last columns: [kv_c | k_pe]
        kv_c, k_pe = kv_a[:7].split([L, ROPE], dim=-1)
        pos = torch.tensor([p for seq in positions for p in seq])
        _, k_rot = layer.rotary(pos, k_pe.unsqueeze(1), k_pe.unsqueeze(1))
        expected = torch.cat((layer.kv_a_layernorm(kv_c), k_rot.squeeze(1)), dim=-1)
    written = latent.view(-1, L + ROPE)[md.slot_mapping[:7]]
    torch.testing.assert_close(written, expected, rtol=0, atol=1e-6)
    untouched = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    untouched[md.slot_mapping[:7]] = False
    assert (latent.view(-1, L + ROPE)[untouched] == 7.0).all()


def test_a_verify_step_gives_the_same_output_by_either_path() -> None:
    """Rows of a sequence with at most max_q_len rows take the absorbed path: a 3-row verify step
    is decompressed with no speculation configured and absorbed with two draft tokens; the outputs
    agree (and a prompt chunk in the same step is decompressed either way)."""
    layer = _layer()
    tables = torch.tensor([[3, 4, 11], [6, 8, 1]], dtype=torch.int32)
    warm = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3]]  # the context, written by a first step
    step = [[6, 7, 8], [4, 5, 6, 7, 8, 9, 10]]  # a verify step of 3 rows, a chunk of 7
    outputs = []
    spec = Config(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    for config in (Config(enforce_eager=True), spec):
        assert config.max_q_len in (1, 3)
        cache = allocate_kv_cache(  # on the CPU: the op's torch paths, absorbed and decompressed
            kv_layer_specs({0: layer}), NUM_BLOCKS, BLOCK, torch.float32, "cpu"
        )
        torch.manual_seed(5)
        _run(layer, torch.randn(10, HIDDEN), warm, _md(warm, 0, tables), cache, config)
        outputs.append(
            _run(layer, torch.randn(10, HIDDEN), step, _md(step, 0, tables), cache, config)
        )
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=1e-5)


def test_the_cuda_path_equals_the_reference() -> None:
    """The op's CUDA path (on CPU tensors its Triton kernels run by Triton's interpreter): the
    latent write is the reference write, and the absorbed decode through the paged MLA kernel is
    the reference's, with a padded request of no context (a graph bucket's) and a padding row past
    every request both zero."""
    from atomrt.workers.kernels.attention.mla_write import mla_write_kv_cache
    from atomrt.workers.layers.mla import absorbed_decode, write_latent_ref

    layer = _layer().to(DEVICE)
    seqs = SEQS[:3]
    cache, tables, _ = _cache_with_context(seqs, seed=1)
    cache, tables = cache.to(DEVICE), tables.to(DEVICE)
    pad_table = torch.full((1, tables.shape[1]), -1, dtype=torch.int32, device=DEVICE)
    md = AttentionMetaData(
        cu_seqlens_q=torch.tensor([0, 1, 4, 5, 6], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([9, 7, 1, 0], dtype=torch.int32, device=DEVICE),
        block_tables=torch.cat((tables, pad_table)),
    )
    q = torch.randn(7, H, NOPE + ROPE, device=DEVICE)
    out = torch.full((7, H, V), float("nan"), device=DEVICE)
    absorbed_decode(q, out, layer, md, MLAKVCacheTensor(0, cache))
    want = torch.zeros(7, H, V, device=DEVICE)
    mla_paged_ref(q, cache, want, seqs, [], tables, layer.weights(), SCALE)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    kv_c, k_pe = torch.randn(5, L, device=DEVICE), torch.randn(5, ROPE, device=DEVICE)
    slots = torch.tensor([3, -1, 17, 40, 95], device=DEVICE)
    by_kernel = torch.zeros(24, 4, L + ROPE, device=DEVICE)
    by_reference = torch.zeros_like(by_kernel)
    mla_write_kv_cache(kv_c, k_pe, by_kernel, slots)
    write_latent_ref(kv_c, k_pe, by_reference, slots)
    assert torch.equal(by_kernel, by_reference)


def test_the_cuda_path_with_q_pe_rotated_apart_equals_the_reference() -> None:
    """What the op runs on CUDA (through the interpreter on CPU): q_pe and k_pe rotated in
    the latent write's launch (mla_rope_write_kv_cache), the absorbed decode reading the rotated
    q_pe apart (q's own rotary columns never read: NaN here), against the reference over the
    rotary embedding of q and the cache rows."""
    from atomrt.workers.kernels.attention.mla_write import mla_rope_write_kv_cache
    from atomrt.workers.layers.mla import absorbed_decode

    layer = _layer().to(DEVICE)
    seqs = SEQS[:3]
    cache, tables, _ = _cache_with_context(seqs, seed=2)
    cache, tables = cache.to(DEVICE), tables.to(DEVICE)
    md = AttentionMetaData(
        cu_seqlens_q=torch.tensor([0, 1, 4, 5], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([9, 7, 1], dtype=torch.int32, device=DEVICE),
        block_tables=tables,
    )
    positions = torch.tensor([8, 4, 5, 6, 0], device=DEVICE)
    q = torch.randn(5, H, NOPE + ROPE, device=DEVICE)
    kv_c, k_pe = torch.randn(5, L, device=DEVICE), torch.randn(5, ROPE, device=DEVICE)
    slots = torch.tensor([int(tables[s, p // BLOCK]) * BLOCK + p % BLOCK for s, p in
                          zip([0, 1, 1, 1, 2], positions.tolist())], device=DEVICE)  # fmt: skip
    rotary = layer.rotary
    q_pe = mla_rope_write_kv_cache(
        q[..., NOPE:], kv_c, k_pe, positions, rotary.cos_cache, rotary.sin_cache,
        rotary.interleaved, cache, slots,
    )  # fmt: skip
    want_q_pe, want_k_pe = rotary(positions, q[..., NOPE:], k_pe.unsqueeze(1))
    assert_same_roundings(q_pe, want_q_pe)
    assert_same_roundings(cache.view(-1, L + ROPE)[slots, L:], want_k_pe.squeeze(1))
    unread = q.clone()
    unread[..., NOPE:] = float("nan")
    out = torch.full((5, H, V), float("nan"), device=DEVICE)
    absorbed_decode(unread, out, layer, md, MLAKVCacheTensor(0, cache), q_pe)
    want = torch.zeros(5, H, V, device=DEVICE)
    rotated = torch.cat((q[..., :NOPE], want_q_pe), dim=-1)
    mla_paged_ref(rotated, cache, want, seqs, [], tables, layer.weights(), SCALE)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)

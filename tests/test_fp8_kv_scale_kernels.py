"""The Triton cache-write and attention kernels with an e4m3 cache's per-layer k/v scales (the cache
holds k / k_scale and v / v_scale, reads multiply back), against float64 references over the
dequantized cache: the paged prefill / mixed kernel (with and without KV splits), the one-launch
decode kernel (its write and its read, split or not), the write and rotary-write kernels, and MLA's
latent write and decode (one scale, k_scale).

On CPU the kernels run through Triton's interpreter at tiny shapes; on a CUDA machine the same tests
run on the GPU (python -m pytest tests/test_fp8_kv_scale_kernels.py). Written values are built as
e4m3 values times the scale, so that their quotient by the scale is exact in e4m3 and the check is
of the plumbing (Triton's interpreter rounds some values to the wrong binade when it casts to e4m3).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_device import DEVICE
from test_decode_attention import expected, forced_plan, make_decode_case
from test_kernels import CASES, SENTINEL, make_batch, reference_attention
from test_mla_kernels import make_mla_batch, reference_mla, run_mla

from atomrt.workers.kernels.attention.decode_attention import decode_attention
from atomrt.workers.kernels.attention.mla_decode import mla_decode_attention
from atomrt.workers.kernels.attention.mla_write import mla_write_kv_cache
from atomrt.workers.kernels.attention.paged_attention import (
    kv_scales_arg,
    launch_attention,
    plan_attention,
    rope_write_kv,
    unified_attention,
    write_kv_cache,
)
from atomrt.workers.layers.attention_ref import from_cache_dtype, to_cache_dtype
from atomrt.workers.layers.rotary import RotaryEmbedding

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.0123, 0.0371  # unlike 1.0 and unlike each other: a swapped scale shows


def _scales(k_scale: float = K_SCALE, v_scale: float = V_SCALE) -> torch.Tensor:
    return torch.tensor([k_scale, v_scale], dtype=torch.float32, device=DEVICE)


def _e4m3(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random float32 values that e4m3 holds exactly (~N(0, 4))."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return (2 * torch.randn(shape, generator=gen, device=DEVICE)).to(FP8).float()


def _dequantized(batch, k_scale: float = K_SCALE, v_scale: float = V_SCALE):
    """The batch with its e4m3 caches as float64 values times their scales (the reference's view)."""
    return dataclasses.replace(
        batch,
        k_cache=batch.k_cache.double() * k_scale,
        v_cache=batch.v_cache.double() * v_scale,
    )


def _fp8_batch(case: str, seed: int):
    lens_q, lens_k = CASES[case]
    b = make_batch(
        lens_q, lens_k, num_kv_heads=2, group=3, head_dim=32, block_size=16, max_blocks=4,
        pad_seqs=1, pad_rows=2, seed=seed, device=DEVICE,
    )  # fmt: skip
    return dataclasses.replace(b, k_cache=(2 * b.k_cache).to(FP8), v_cache=(2 * b.v_cache).to(FP8))


def _check(batch, out: torch.Tensor) -> None:
    ref = reference_attention(_dequantized(batch), batch.q.shape[2] ** -0.5)
    n = batch.num_real_rows
    torch.testing.assert_close(out[:n].double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.all(out[n:] == SENTINEL), "padded output rows were written"


@pytest.mark.parametrize("case", ["prefill", "mtp3"])
def test_paged_attention_reads_a_scaled_cache(case: str) -> None:
    """unified_attention over an e4m3 cache with k_scale / v_scale equals float64 attention over
    the cache times its scales."""
    b = _fp8_batch(case, seed=3)
    out = torch.full_like(b.q, SENTINEL)
    unified_attention(
        b.q, b.k_cache, b.v_cache, out, b.cu_seqlens_q, b.context_lens, b.block_tables,
        b.q.shape[2] ** -0.5, num_seqs=b.num_seqs, max_seqlen_q=max(CASES[case][0]),
        max_seqlen_k=max(b.context_lens_cpu), graph_safe=False,
        cu_seqlens_q_cpu=b.cu_seqlens_q_cpu, context_lens_cpu=b.context_lens_cpu,
        kv_scales=_scales(),
    )  # fmt: skip
    _check(b, out)


def test_split_paged_attention_reads_a_scaled_cache() -> None:
    """With the keys split (partials merged by the reduce kernel) the scales apply once."""
    b = _fp8_batch("prefill", seed=4)
    plan = plan_attention(b.num_seqs, 17, 48, num_kv_heads=2, group=3, head_dim=32, num_sms=4)
    plan = dataclasses.replace(plan, num_splits=3, tile_n=16)
    out = torch.full_like(b.q, SENTINEL)
    launch_attention(
        plan, b.q, b.k_cache, b.v_cache, out, b.cu_seqlens_q, b.context_lens, b.block_tables,
        b.q.shape[2] ** -0.5, num_seqs=b.num_seqs, reduce_rows=b.q.shape[0], kv_scales=_scales(),
    )  # fmt: skip
    _check(b, out)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_writes_and_reads_a_scaled_cache(num_splits: int) -> None:
    """The one-launch decode kernel divides the new key and value by their scales as it writes
    them, attends to them from registers and to the old ones from the cache, times the scales."""
    case = make_decode_case(
        [1, 2, 17, 40], num_kv_heads=2, group=4, head_dim=32, pad_seqs=1, pad_rows=2,
        rope=False, seed=5, device=DEVICE,
    )  # fmt: skip
    b = case.batch
    b = dataclasses.replace(b, k_cache=(2 * b.k_cache).to(FP8), v_cache=(2 * b.v_cache).to(FP8))
    k_held, v_held = _e4m3(tuple(case.k.shape), 6), _e4m3(tuple(case.v.shape), 7)
    case = dataclasses.replace(case, batch=b, k=k_held * K_SCALE, v=v_held * V_SCALE)
    out = torch.full_like(b.q, SENTINEL)
    decode_attention(
        b.q, case.k, case.v, out, None, None, None, b.k_cache, b.v_cache, case.slot_mapping,
        b.cu_seqlens_q, b.context_lens, b.block_tables, b.q.shape[2] ** -0.5,
        forced_plan(4, 32, num_splits), num_seqs=b.num_seqs, kv_scales=_scales(),
    )  # fmt: skip
    ref_case = dataclasses.replace(case, batch=_dequantized(b))
    ref_out, _, _ = expected(ref_case)
    n = b.num_real_rows
    torch.testing.assert_close(out[:n].double(), ref_out, rtol=1e-5, atol=1e-5)
    assert torch.all(out[n:] == SENTINEL)
    written = case.slot_mapping >= 0
    slots = case.slot_mapping[written]
    assert torch.equal(b.k_cache.view(-1, 2, 32)[slots].float(), k_held[written])
    assert torch.equal(b.v_cache.view(-1, 2, 32)[slots].float(), v_held[written])


def test_write_kernels_divide_by_the_scales() -> None:
    """write_kv_cache stores k / k_scale and v / v_scale (saturated at +-448, as the torch
    reference does); rope_write_kv stores the rotated key over k_scale, within e4m3's steps."""
    k_held, v_held = _e4m3((3, 2, 16), 8), _e4m3((3, 2, 16), 9)
    k, v = k_held * K_SCALE, v_held * V_SCALE
    k[0, 0, :2] = torch.tensor([1000.0, -1000.0]) * K_SCALE
    k_cache, v_cache = (torch.zeros(4, 4, 2, 16, dtype=FP8, device=DEVICE) for _ in range(2))
    slots = torch.tensor([5, -1, 14], device=DEVICE)
    write_kv_cache(k, v, k_cache, v_cache, slots, _scales())
    flat_k, flat_v = k_cache.view(-1, 2, 16).float(), v_cache.view(-1, 2, 16).float()
    want_k = to_cache_dtype(k, FP8, K_SCALE).float()
    assert want_k[0, 0, 0] == 448 and want_k[0, 0, 1] == -448
    assert torch.equal(flat_k[[5, 14]], want_k[[0, 2]])
    assert torch.equal(flat_v[[5, 14]], v_held[[0, 2]])
    assert flat_k[[i for i in range(16) if i not in (5, 14)]].abs().sum() == 0

    rotary = RotaryEmbedding(16, max_position=64, theta=10000.0).to(DEVICE)
    q = torch.randn(3, 4, 16, device=DEVICE)
    positions = torch.tensor([3, 0, 9], device=DEVICE)
    k, v = k_held * K_SCALE, v_held * V_SCALE
    k_cache.zero_()
    v_cache.zero_()
    rope_write_kv(
        q, k, v, positions, rotary.cos_cache, rotary.sin_cache, k_cache, v_cache, slots, _scales()
    )
    _, k_rot = rotary(positions, q.clone(), k.clone())
    back = from_cache_dtype(k_cache.view(-1, 2, 16)[[5, 14]], torch.float64, K_SCALE)
    want = k_rot[[0, 2]].double()
    # e4m3 rounds to within 1/16 of a value, or half its subnormal step 2^-9 (times the scale);
    # the interpreter at times to the binade below (half the value). Unscaled, the values would
    # be 1 / K_SCALE times larger; with v_scale, 3 times smaller.
    relative = 1 / 16 if DEVICE == "cuda" else 1 / 2
    assert ((back - want).abs() <= want.abs() * relative + 2**-10 * K_SCALE).all()
    assert torch.equal(v_cache.view(-1, 2, 16)[[5, 14]].float(), v_held[[0, 2]])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_kernels_write_and_read_a_scaled_latent_cache(num_splits: int) -> None:
    """MLA's latent cache takes one scale (k_scale): the write divides the latent and k_pe by it,
    the decode kernel's scores and output multiply it back."""
    batch = make_mla_batch(
        [1, 3, 1], [9, 40, 66], num_heads=4, kv_lora_rank=64, rope_dim=32, seed=num_splits,
        device=DEVICE,
    )  # fmt: skip
    batch.kv_cache = (2 * batch.kv_cache).to(FP8)
    scales = _scales(K_SCALE, K_SCALE)
    out = batch.out()
    args = (batch.q, batch.kv_cache, batch.block_table, batch.seq_lens, batch.cu_seqlens_q)
    mla_decode_attention(*args, batch.scale, out, num_splits, kv_scales=scales)
    ref = reference_mla(dataclasses.replace(batch, kv_cache=batch.kv_cache.double() * K_SCALE))
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    # unscaled, the same cache reads as other values: the scale is what made it match
    assert not torch.allclose(run_mla(batch, num_splits).double(), ref, atol=1e-3, rtol=1e-3)

    kv_c, k_pe = _e4m3((2, 64), 10), _e4m3((2, 32), 11)
    mla_write_kv_cache(
        kv_c * K_SCALE, k_pe * K_SCALE, batch.kv_cache, torch.tensor([3, -1], device=DEVICE), scales
    )
    assert torch.equal(batch.kv_cache.view(-1, 96)[3].float(), torch.cat((kv_c[0], k_pe[0])))


def test_scales_are_read_only_from_an_fp8_cache() -> None:
    """A cache in the model's dtype ignores the scales (what a layer with kv_cache_dtype 'auto'
    passes); a malformed scales tensor is refused by name."""
    b = make_batch(
        [5, 1], [5, 17], num_kv_heads=2, group=2, head_dim=32, block_size=16, max_blocks=2,
        device=DEVICE,
    )  # fmt: skip
    out = torch.full_like(b.q, SENTINEL)
    unified_attention(
        b.q, b.k_cache, b.v_cache, out, b.cu_seqlens_q, b.context_lens, b.block_tables,
        b.q.shape[2] ** -0.5, num_seqs=b.num_seqs, max_seqlen_q=5, max_seqlen_k=17,
        graph_safe=False, kv_scales=_scales(),
    )  # fmt: skip
    ref = reference_attention(b, b.q.shape[2] ** -0.5)
    torch.testing.assert_close(out[: b.num_real_rows].double(), ref, rtol=1e-5, atol=1e-5)
    for bad in (torch.ones(2, dtype=torch.float64), torch.ones(3), torch.ones(1, 2, 2)):
        with pytest.raises(ValueError, match=r"kv_scales must be \[k_scale, v_scale\] float32"):
            kv_scales_arg(bad, b.k_cache)


def test_unit_scales_are_made_with_the_decode_counters() -> None:
    """A cache without scales of its own reads 1.0 and 1.0 from one tensor per device, made where
    the KV-cache allocation makes the decode split counters (before any CUDA-graph capture)."""
    from atomrt.workers.kernels import device_info
    from atomrt.workers.kernels.attention.decode_attention import prepare_decode_counters

    device = torch.device(DEVICE)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    key = ("attention: unit KV cache scales", device)
    device_info._scratch.pop(key, None)  # as a fresh process has it
    prepare_decode_counters(device)
    unit = device_info._scratch[key]
    cache = torch.zeros(1, 16, 1, 16, dtype=FP8, device=device)
    assert kv_scales_arg(None, cache) is unit
    assert unit.tolist() == [1.0, 1.0]

# The writes of DeepSeek's MLA latent KV cache, on CUDA (the attention over it: mla_decode.py):
#   mla_write_kv_cache   - scatter this step's cache rows (normalised latent, then rotated k_pe) into
#                          the cache at slot_mapping
#   mla_rope_write_kv_cache - the same write with k_pe's rotary embedding, and q_pe's, in one launch
# Graph-safe: every length is read on the device. The kernels are in mla_kernels.py. Importing this
# module needs no GPU.

from __future__ import annotations

from typing import Optional

import torch
import triton

from atomrt.workers.kernels.attention.mla_decode import _check_integers, _check_unit_last_stride
from atomrt.workers.kernels.attention.mla_kernels import (
    mla_rope_write_kv_kernel,
    mla_write_kv_kernel,
)
from atomrt.workers.kernels.attention.paged_attention import kv_scales_arg, unit_last_stride
from atomrt.workers.kernels.launch import launch


def mla_write_kv_cache(
    kv_c_normed: torch.Tensor,  # [T, kv_lora_rank]
    k_pe: torch.Tensor,  # [T, rope_dim], already rotated
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    slot_mapping: torch.Tensor,  # [T] int64 (or longer), < 0 = padded row (skipped)
    kv_scales: Optional[torch.Tensor] = None,  # an e4m3 cache's [k_scale, _] (kv_scales_arg)
) -> None:
    """Writes row t (the latent, then k_pe, in the cache's dtype; an e4m3 cache's over its scale,
    k_scale) at slot `slot_mapping[t]` (= block * block_size + offset) of the cache. A negative
    slot skips its row; so does one past the cache's end, which no block table can name."""
    if kv_c_normed.dim() != 2 or k_pe.dim() != 2 or kv_cache.dim() != 3:
        raise ValueError(
            f"mla_write_kv_cache: want kv_c_normed [T, kv_lora_rank], k_pe [T, rope_dim] and "
            f"kv_cache [num_blocks, block_size, kv_lora_rank + rope_dim], got "
            f"{tuple(kv_c_normed.shape)}, {tuple(k_pe.shape)}, {tuple(kv_cache.shape)}"
        )
    num_tokens, kv_lora_rank = kv_c_normed.shape
    rope_dim = k_pe.shape[1]
    if k_pe.shape[0] != num_tokens or kv_cache.shape[2] != kv_lora_rank + rope_dim:
        raise ValueError(
            f"mla_write_kv_cache: kv_c_normed {tuple(kv_c_normed.shape)} and k_pe "
            f"{tuple(k_pe.shape)} do not fit cache rows of {kv_cache.shape[2]}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"mla_write_kv_cache: slot_mapping {tuple(slot_mapping.shape)} for {num_tokens} rows"
        )
    _check_integers("mla_write_kv_cache", slot_mapping=slot_mapping)
    _check_unit_last_stride(kv_cache, "kv_cache")
    if num_tokens == 0:
        return
    kv_c_normed, k_pe = unit_last_stride(kv_c_normed), unit_last_stride(k_pe)
    num_blocks, block_size, _ = kv_cache.shape
    launch(
        mla_write_kv_kernel,
        (num_tokens,),
        kv_c_normed,
        k_pe,
        kv_cache,
        slot_mapping,
        kv_scales_arg(kv_scales, kv_cache),
        kv_c_normed.stride(0),
        k_pe.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        num_blocks * block_size,
        kv_lora_rank,
        rope_dim,
        BLOCK_SIZE=block_size,
        LORA_P=triton.next_power_of_2(kv_lora_rank),
        ROPE_P=triton.next_power_of_2(max(1, rope_dim)),
        num_warps=4 if kv_lora_rank >= 256 else 1,
    )


def mla_rope_write_kv_cache(
    q_pe: torch.Tensor,  # [T, H, rope_dim], not rotated (any row and head strides)
    kv_c_normed: torch.Tensor,  # [T, kv_lora_rank]
    k_pe: torch.Tensor,  # [T, rope_dim], not rotated
    positions: torch.Tensor,  # [T] int64
    cos_cache: torch.Tensor,  # [max_position, rope_dim / 2] float32 (RotaryEmbedding's)
    sin_cache: torch.Tensor,
    interleaved: bool,  # RotaryEmbedding.interleaved: pairs (x0, x1), ... (DeepSeek's layout)
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    slot_mapping: torch.Tensor,  # [T] int64 (or longer), < 0 = padded row (nothing written)
    kv_scales: Optional[torch.Tensor] = None,  # an e4m3 cache's [k_scale, _] (kv_scales_arg)
) -> torch.Tensor:
    """The rotary embedding of q_pe and k_pe at `positions`, as RotaryEmbedding computes it (same
    roundings), and mla_write_kv_cache's rows [kv_c_normed | rotated k_pe], in one launch. Returns
    q_pe rotated, [T, H, rope_dim] contiguous, in q_pe's dtype (every row, padded ones too)."""
    if q_pe.dim() != 3 or k_pe.dim() != 2 or kv_c_normed.dim() != 2 or kv_cache.dim() != 3:
        raise ValueError(
            f"mla_rope_write_kv_cache: want q_pe [T, H, P], kv_c_normed [T, L], k_pe [T, P] and "
            f"kv_cache [num_blocks, block_size, L + P], got {tuple(q_pe.shape)}, "
            f"{tuple(kv_c_normed.shape)}, {tuple(k_pe.shape)}, {tuple(kv_cache.shape)}"
        )
    num_tokens, num_heads, rope_dim = q_pe.shape
    kv_lora_rank = kv_c_normed.shape[1]
    if (
        k_pe.shape != (num_tokens, rope_dim)
        or kv_c_normed.shape[0] != num_tokens
        or kv_cache.shape[2] != kv_lora_rank + rope_dim
        or positions.shape[0] < num_tokens
        or slot_mapping.dim() != 1
        or slot_mapping.shape[0] < num_tokens
        or rope_dim % 2
        or cos_cache.shape[1:] != (rope_dim // 2,)
        or sin_cache.shape != cos_cache.shape
        or k_pe.dtype != q_pe.dtype
    ):
        raise ValueError(
            f"mla_rope_write_kv_cache: q_pe {tuple(q_pe.shape)} {q_pe.dtype}, kv_c_normed "
            f"{tuple(kv_c_normed.shape)}, k_pe {tuple(k_pe.shape)} {k_pe.dtype}, positions "
            f"{tuple(positions.shape)}, slot_mapping {tuple(slot_mapping.shape)} and cos/sin "
            f"{tuple(cos_cache.shape)} do not fit cache rows of {kv_cache.shape[2]}"
        )
    _check_integers("mla_rope_write_kv_cache", slot_mapping=slot_mapping, positions=positions)
    _check_unit_last_stride(kv_cache, "kv_cache")
    q_out = torch.empty(num_tokens, num_heads, rope_dim, dtype=q_pe.dtype, device=q_pe.device)
    if num_tokens == 0:
        return q_out
    q_pe, kv_c_normed, k_pe = (
        unit_last_stride(q_pe),
        unit_last_stride(kv_c_normed),
        unit_last_stride(k_pe),
    )
    num_blocks, block_size, _ = kv_cache.shape
    launch(
        mla_rope_write_kv_kernel,
        (num_tokens,),
        q_pe, q_out, kv_c_normed, k_pe, positions, cos_cache.contiguous(), sin_cache.contiguous(),
        kv_cache, slot_mapping, kv_scales_arg(kv_scales, kv_cache),
        q_pe.stride(0), q_pe.stride(1), q_out.stride(0), q_out.stride(1),
        kv_c_normed.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        num_heads, num_blocks * block_size, kv_lora_rank, rope_dim,
        BLOCK_SIZE=block_size,
        HEADS_P=triton.next_power_of_2(num_heads),
        LORA_P=triton.next_power_of_2(kv_lora_rank),
        ROPE_P=triton.next_power_of_2(max(1, rope_dim)),
        INTERLEAVED=interleaved,
        num_warps=4 if kv_lora_rank >= 256 or num_heads >= 32 else 1,
    )  # fmt: skip
    return q_out

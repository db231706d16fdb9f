# The merge of MLA decode's KV splits (mla_kernels.py's decode kernel leaves their partials; shapes
# as there: partial acc [R, H, S, L] fp32, unnormalised; m, l [R, H, S] fp32, m in log2 units):
#   mla_merge_kernel - a launch of its own, (row, head, latent chunk) per program

import triton
import triton.language as tl

from atomrt.workers.kernels.attention.attention_kernels import _NEG_BIG


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def mla_merge_kernel(
    partial_ptr,  # [R, H, S, L] fp32
    m_ptr,
    l_ptr,  # [R, H, S] fp32
    out_ptr,  # [R, H, L]
    cu_seqlens_q_ptr,
    num_reqs,
    num_splits,
    kv_lora_rank,
    stride_pr,
    stride_ph,
    stride_ps,
    stride_mr,
    stride_mh,
    stride_or,
    stride_oh,
    SPLITS_P: tl.constexpr,
    DIM_CHUNK: tl.constexpr,  # latent columns per program (the tile is SPLITS_P x DIM_CHUNK fp32)
):
    """Merges the KV splits of one (row, head), DIM_CHUNK latent columns per program (grid dim 2):
    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits that saw a key (l_s > 0):
    the others' partial outputs are neither read nor needed. A row that saw no key gets zeros; rows
    past the requests' are left to the decode kernel (which zeros them). A lone request's merge
    thus still runs on many SMs: its partials are as large as a few thousand keys of cache."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    d0 = tl.program_id(2) * DIM_CHUNK
    if row >= tl.load(cu_seqlens_q_ptr + num_reqs):
        return
    row64 = row.to(tl.int64)
    splits = tl.arange(0, SPLITS_P)
    ml_off = row64 * stride_mr + head * stride_mh + splits
    m = tl.load(m_ptr + ml_off, mask=splits < num_splits, other=_NEG_BIG)
    l = tl.load(l_ptr + ml_off, mask=splits < num_splits, other=0.0)
    live = l > 0.0
    w = tl.where(live, tl.exp2(m - tl.max(m, 0)), 0.0)  # [SPLITS_P]
    l_total = tl.sum(w * l, 0)
    inv = 1.0 / tl.where(l_total > 0.0, l_total, 1.0)
    a_base = partial_ptr + row64 * stride_pr + head * stride_ph + splits[:, None] * stride_ps
    o_base = out_ptr + row64 * stride_or + head * stride_oh
    dims = d0 + tl.arange(0, DIM_CHUNK)
    dim_valid = dims < kv_lora_rank
    acc = tl.load(
        a_base + dims[None, :], mask=live[:, None] & dim_valid[None, :], other=0.0
    )  # [SPLITS_P, DIM_CHUNK]
    o = tl.sum(w[:, None] * acc, 0) * inv
    tl.store(o_base + dims, o.to(out_ptr.dtype.element_ty), mask=dim_valid)

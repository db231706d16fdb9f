# The merge of MLA decode's KV splits (mla_kernels.py's decode kernel leaves their partials; shapes
# as there: partial acc [R, H, S, L] fp32 or bf16, unnormalised; m, l [R, H, S] fp32, m in log2
# units):
#   mla_merge_kernel - a launch of its own, (row, head, latent chunk) per program
#   _merge_splits    - the decode kernel's own merge (merge_in_kernel): its last split program to
#                      finish merges a query tile's splits

import triton
import triton.language as tl

from atomrt.workers.kernels.attention.attention_kernels import _NEG_BIG


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def mla_merge_kernel(
    partial_ptr,  # [R, H, S, L] fp32 or bf16
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
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (merge_pdl)
):
    """Merges the KV splits of one (row, head), DIM_CHUNK latent columns per program (grid dim 2):
    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits that saw a key (l_s > 0):
    the others' partial outputs are neither read nor needed. A row that saw no key gets zeros; rows
    past the requests' are left to the decode kernel (which zeros them). A lone request's merge
    thus still runs on many SMs: its partials are as large as a few thousand keys of cache."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    d0 = tl.program_id(2) * DIM_CHUNK
    num_rows = tl.load(cu_seqlens_q_ptr + num_reqs)  # the step's metadata: before the wait
    if USE_PDL:  # before any return, and before the partials: the decode kernel writes them
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if row >= num_rows:
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
    acc_mask = live[:, None] & dim_valid[None, :]
    # [SPLITS_P, DIM_CHUNK]
    acc = tl.load(a_base + dims[None, :], mask=acc_mask, other=0.0).to(tl.float32)
    o = tl.sum(w[:, None] * acc, 0) * inv
    tl.store(o_base + dims, o.to(out_ptr.dtype.element_ty), mask=dim_valid)


@triton.jit
def _merge_splits(partial_ptr, m_ptr, l_ptr, out_ptr, q_row, head, row_valid, num_active,
                  kv_lora_rank, stride_pr, stride_ph, stride_ps, stride_mr, stride_mh, stride_or,
                  stride_oh, BLOCK_M: tl.constexpr, LORA_P: tl.constexpr,
                  MERGE_SPLITS: tl.constexpr, MERGE_DIM: tl.constexpr):  # fmt: skip
    """out of one query tile's BLOCK_M (row, head) pairs from the partials of splits
    0..num_active: first their total max and denominator, then MERGE_DIM latent columns at a time,
    MERGE_SPLITS splits per step. Every working split left its partials, zeros where it saw no key:
    a step's loads depend on no value loaded, so they all go out before its sums; each split's
    tile [BLOCK_M, MERGE_DIM] is summed in registers (no reduction across threads). ".cg" loads
    skip L1, which may hold lines from before the other programs' stores."""
    chunk = tl.arange(0, MERGE_SPLITS)
    ml_off = q_row * stride_mr + head * stride_mh  # [BLOCK_M]
    m_tot = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_tot = tl.zeros([BLOCK_M], tl.float32)
    for c0 in range(0, num_active, MERGE_SPLITS):
        take = row_valid[:, None] & (c0 + chunk < num_active)[None, :]  # [BLOCK_M, MERGE_SPLITS]
        ml_ptrs = ml_off[:, None] + c0 + chunk[None, :]
        m_s = tl.load(m_ptr + ml_ptrs, mask=take, other=_NEG_BIG, cache_modifier=".cg")
        l_s = tl.load(l_ptr + ml_ptrs, mask=take, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_tot, tl.max(m_s, 1))
        l_tot = l_tot * tl.exp2(m_tot - m_new) + tl.sum(l_s * tl.exp2(m_s - m_new[:, None]), 1)
        m_tot = m_new
    inv = 1.0 / tl.where(l_tot > 0.0, l_tot, 1.0)
    p_base = partial_ptr + q_row * stride_pr + head * stride_ph  # [BLOCK_M]
    o_base = out_ptr + q_row * stride_or + head * stride_oh
    for d0 in tl.static_range(0, LORA_P, MERGE_DIM):
        dims = d0 + tl.arange(0, MERGE_DIM)
        dim_valid = dims < kv_lora_rank
        acc = tl.zeros([BLOCK_M, MERGE_DIM], tl.float32)
        for c0 in range(0, num_active, MERGE_SPLITS):
            for j in tl.static_range(MERGE_SPLITS):
                take = row_valid & (c0 + j + 0 * ml_off < num_active)  # [BLOCK_M]
                m_s = tl.load(
                    m_ptr + ml_off + c0 + j, mask=take, other=_NEG_BIG, cache_modifier=".cg"
                )
                l_s = tl.load(l_ptr + ml_off + c0 + j, mask=take, other=0.0, cache_modifier=".cg")
                a_s = tl.load(
                    p_base[:, None] + (c0 + j) * stride_ps + dims[None, :],
                    mask=take[:, None] & dim_valid[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                ).to(tl.float32)  # [BLOCK_M, MERGE_DIM]
                acc += tl.where(l_s > 0.0, tl.exp2(m_s - m_tot), 0.0)[:, None] * a_s
        o_mask = row_valid[:, None] & dim_valid[None, :]
        tl.store(o_base[:, None] + dims[None, :], (acc * inv[:, None]).to(out_ptr.dtype.element_ty),
                 mask=o_mask)  # fmt: skip

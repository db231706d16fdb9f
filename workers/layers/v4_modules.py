"""DeepSeek-V4's attention parts: the layer types, the partial interleaved rotary embedding, the
RMSNorms, the compressor and the lightning indexer's modules, and the per-token cache spec (what
the attention block of workers/layers/v4_attention.py is made of; the formulas are there)."""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

# the layer types (config.json `layer_types`)
SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"


# The rotation in one Triton launch (workers/kernels/v4/v4_rope.py) rather than some ten small
# torch kernels a call (eager CUDA, and what a CUDA graph records at level 0; traced, Inductor fuses
# the torch ones): on an H100, 1.55 against 16.33 us at 1 row, 95.0 against 520.87 us at 2048
# (benchmarks/bench_v4_kernels.py, 6185488).
ROPE_KERNEL = True


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x in interleaved pairs, in float32.
    cos, sin broadcast against x[..., :half] (one angle per pair)."""
    if ROPE_KERNEL and x.is_cuda and x.dim() in (2, 3) and not torch.compiler.is_compiling():
        from atomrt.workers.kernels.v4.v4_rope import v4_rope_tail

        return v4_rope_tail(x, cos, sin)
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepSeek-V4 RMSNorm: in float32, times the weight, back to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


class Norm(nn.Module):
    """A weighted RMSNorm whose parameter is the checkpoint's `<name>.weight` (float32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Compressor(nn.Module):
    """`wkv`, `wgate` (c * dim wide: c = 2 for overlapping CSA windows), `ape` [rate, c * dim]
    and the pooled entry's `norm`."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        c = 2 if overlap else 1
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.wkv = nn.Linear(hidden, c * dim, bias=False)
        self.wgate = nn.Linear(hidden, c * dim, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, c * dim, dtype=torch.float32))
        self.norm = Norm(dim, eps)

    def pool(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        kv_prev: Optional[torch.Tensor],
        gate_prev: Optional[torch.Tensor],
        windows: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Entries of `windows` [m] from their tokens' projections kv, gate [m, rate, c*dim] (and,
        for overlapping windows, the previous window's, ignored for window 0) -> [m, dim], rotated
        at w * rate."""
        d = self.dim
        g = gate.float() + self.ape  # [m, r, c*dim]
        v = kv
        if self.overlap:
            first = (windows == 0).view(-1, 1, 1)
            g_a = (gate_prev[..., :d].float() + self.ape[:, :d]).masked_fill(first, float("-inf"))
            v_a = kv_prev[..., :d].masked_fill(first, 0.0)
            g = torch.cat((g_a, g[..., d:]), dim=1)  # [m, 2r, dim]
            v = torch.cat((v_a, v[..., d:]), dim=1)
        probs = torch.softmax(g, dim=1, dtype=torch.float32).to(v.dtype)
        pooled = self.norm((v * probs).sum(dim=1))
        at = windows * self.rate
        return rope_tail(pooled, cos[at].to(pooled.dtype), sin[at].to(pooled.dtype))


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its compressor (index_head_dim), `wq_b` from the
    query LoRA and `weights_proj`."""

    def __init__(
        self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, rate: int, eps: float
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.compressor = Compressor(hidden, head_dim, rate, True, eps)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


@dataclass(frozen=True)
class V4LayerSpec:
    """A DeepSeek-V4 layer's cache: one row per token (workers/layers/v4_attention.py)."""

    layer_idx: int
    layer_type: str
    head_dim: int
    compress_width: int  # c * head_dim of the compressor's projections (0: sliding)
    index_width: int  # 2 * index_head_dim of the indexer's (0: not CSA)

    @property
    def kind(self) -> str:
        return self.layer_type

    def elements_per_token(self) -> int:
        d, di = self.head_dim, self.index_width // 2
        n = d
        if self.compress_width:
            n += 2 * self.compress_width + d
        if self.index_width:
            n += 2 * self.index_width + di
        return n

    def columns(self) -> "dict[str, tuple[int, int]]":
        """Name -> (first column, width) of a cache row: a token's columns, then the entries'
        (`entries_at` on)."""
        d, cw, iw = self.head_dim, self.compress_width, self.index_width
        widths = [("kv", d)]
        if cw:
            widths += [("ckv", cw), ("cgate", cw)]
        if iw:
            widths += [("ikv", iw), ("igate", iw)]
        if cw:
            widths.append(("centry", d))
        if iw:
            widths.append(("ientry", iw // 2))
        cols, at = {}, 0
        for name, width in widths:
            cols[name], at = (at, width), at + width
        return cols

    @property
    def entries_at(self) -> int:
        """The first entry column (the row's width for a sliding layer)."""
        cols = self.columns()
        return cols["centry"][0] if "centry" in cols else self.elements_per_token()

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> "V4CacheTensor":
        width = self.elements_per_token()
        storage = torch.zeros(num_blocks * block_size + 1, width, dtype=dtype, device=device)
        rows = storage[:-1].view(num_blocks, block_size, width)
        return V4CacheTensor(self.layer_idx, rows, storage)


@dataclass
class V4CacheTensor:
    layer_idx: int
    rows: torch.Tensor  # [num_blocks, block_size, V4LayerSpec.elements_per_token()]
    # rows plus one scratch row last, where a padded row's write goes: a write is one
    # index_copy_ of every row, with no host synchronisation (a token graph records it)
    storage: torch.Tensor

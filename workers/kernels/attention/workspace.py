# Split-KV attention's fp32 workspaces (partial outputs, running max and denominator), shared by the
# decode and the unified attention launches:
#   split_workspace      - one allocation per launch (graph-safe: a capture takes it from its pool)
#   kept_split_workspace - views of a buffer kept per (device, stream), for eager launches
# Importing this module needs no GPU.

from __future__ import annotations

import torch
import triton


def split_workspace(
    num_tokens: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A split-KV launch's fp32 partials: unnormalised outputs [num_tokens, num_heads, num_splits,
    head_dim] and their running max and denominator [num_tokens, num_heads, num_splits], in one
    allocation (each costs host time on every eager call)."""
    num_partials = num_tokens * num_heads * num_splits
    workspace = torch.empty(
        _workspace_len(num_partials, head_dim), device=device, dtype=torch.float32
    )
    return _carve(workspace, num_tokens, num_heads, num_splits, head_dim)


def _workspace_len(num_partials: int, head_dim: int) -> int:
    return num_partials * head_dim + 2 * triton.cdiv(num_partials, 4) * 4


def _carve(
    workspace: torch.Tensor, num_tokens: int, num_heads: int, num_splits: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_partials = num_tokens * num_heads * num_splits
    ml_len = triton.cdiv(num_partials, 4) * 4  # keeps m and l 16-byte aligned
    partial = workspace[: num_partials * head_dim].view(num_tokens, num_heads, num_splits, head_dim)
    m = workspace[num_partials * head_dim :][:num_partials].view(num_tokens, num_heads, num_splits)
    l = workspace[num_partials * head_dim + ml_len :][:num_partials].view(
        num_tokens, num_heads, num_splits
    )
    return partial, m, l


# (device index, stream) -> [buffer, {shape: views}]; see kept_split_workspace
_kept_workspaces: dict[tuple[int, int], list] = {}


def kept_split_workspace(
    num_tokens: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """split_workspace's partials for a launch outside a CUDA-graph capture, carved from a buffer
    kept per (device, stream) and grown on demand: launches on one stream run in order, so they
    can share it, and an eager step pays no allocation. A capture gets fresh memory from its pool
    instead (the recording keeps it; a kept buffer could be grown and freed under it)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return split_workspace(num_tokens, num_heads, num_splits, head_dim, device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    where = (index, torch._C._cuda_getCurrentRawStream(index))
    shape = (num_tokens, num_heads, num_splits, head_dim)
    kept = _kept_workspaces.get(where)
    if kept is not None:
        views = kept[1].get(shape)
        if views is not None:
            return views
    length = _workspace_len(num_tokens * num_heads * num_splits, head_dim)
    if kept is None or kept[0].numel() < length:
        # the stream's earlier launches may still read the old buffer: free it in stream order
        kept = _kept_workspaces[where] = [
            torch.empty(length, device=device, dtype=torch.float32),
            {},
        ]
    views = kept[1][shape] = _carve(kept[0], *shape)
    return views

"""DeepSeek-V4's mixture of experts: routed experts plus one shared expert, both SwiGLU with the
pre-activations clamped (`swiglu_limit`: gate <= limit, -limit <= up <= limit).

Routing, from the router's scores s = score_fn(x @ W_gate^T) (`scoring_func`: sqrt(softplus),
softmax or sigmoid):
- `hash_moe` layers pick the experts by the token alone, `tid2eid[input_ids]` (a frozen table in
  the checkpoint), so the step's token ids reach the layer;
- `moe` layers pick the top `num_experts_per_tok` of s + the correction bias (`gate.bias`).
Either way the weights are the picked scores, renormalised to sum 1, times `routed_scaling_factor`.

Parameter names are the checkpoint's: `gate.weight`, `gate.bias` (moe) or `gate.tid2eid` (hash),
`shared_experts.w1/w2/w3`; the routed experts' `experts.<e>.w1/w3` (gate, up) are stacked into
`w13` [E, 2 * I, hidden] and their `w2` (down) into `w2` [E, hidden, I] (`load_expert`). One rank
holds every expert. Tensor parallelism splits the shared expert's intermediate size; the routed
experts' is split over the DP x TP world (shard `dp_rank * tp_size + tp_rank`): with DP > 1 the
layer gathers every DP rank's rows (and the hash routing every rank's token ids, gathered once per
step by the model), runs the experts over them, and hands each rank its rows back summed over the
DP ranks (`dp_reduce_scatter`); the shared expert runs on the rank's own rows; the TP ranks' sum
comes last.

The float routed experts are one opaque op, `v4_expert_pairs` (as the MXFP4 experts'
`v4_mxfp4_experts`): on CUDA the fused-MoE kernel, each (token, expert) pair reading its expert's
weights alone, planned from shapes and the device-side routing (a CUDA graph records it;
workers/kernels/v4/v4_experts.py); elsewhere each picked expert's GEMMs over its rows. Its weighted
pairs are summed after it, in traced code. Either reports its routing to a probe's tally
(workers/layers/expert_tally.py).
"""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.nn.functional as F
from torch import nn

from atomrt.compile.custom_register import direct_register_custom_op
from atomrt.distributed.communication_op import (
    DPInfo,
    TPInfo,
    dp_all_gather,
    dp_reduce_scatter,
    tp_all_reduce,
)
from atomrt.workers.layers import expert_tally
from atomrt.workers.layers.quantization.mxfp4 import MXFP4_BLOCK, MXFP4Weight, dequantize_mxfp4
from atomrt.workers.layers.weight_utils import Sliceable, divide, read_narrow


class SwiGLU(nn.Module):
    """down(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit)); `intermediate_size` this
    rank's (w1, w3 rows and w2 columns split over TP ranks; the caller sums the ranks')."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.limit = limit
        self.w1.weight.tp_shard_dim = self.w3.weight.tp_shard_dim = 0
        self.w2.weight.tp_shard_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


def clamped_swiglu(h: torch.Tensor, limit: float) -> torch.Tensor:
    """h [rows, 2I] (gate | up) -> silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _mxfp4_experts_impl(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """MXFP4 routed experts over a routing: the w4a16 kernel on CUDA; elsewhere each picked
    expert's weights dequantized to x's dtype, then its rows' GEMMs."""
    expert_tally.record(w13, topk_ids)  # a probe's count of the experts touched (eager steps)
    if x.is_cuda:
        from atomrt.workers.kernels.moe.fused_moe_mxfp4 import fused_experts_mxfp4

        return fused_experts_mxfp4(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, limit)
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        rows, slot = torch.where(topk_ids == e)
        gate_up = dequantize_mxfp4(w13[e], w13_scale[e], "w13").to(x.dtype)
        down = dequantize_mxfp4(w2[e], w2_scale[e], "w2").to(x.dtype)
        y = F.linear(clamped_swiglu(F.linear(x[rows], gate_up), limit), down)
        out.index_add_(0, rows, (y * topk_weights[rows, slot, None].to(x.dtype)).to(out.dtype))
    return out


def _mxfp4_experts_fake(x: torch.Tensor, *routing_and_experts: object) -> torch.Tensor:
    return torch.empty_like(x)


# Opaque to Dynamo: the CPU loop has data-dependent shapes; the kernel plans from shapes alone.
direct_register_custom_op("v4_mxfp4_experts", _mxfp4_experts_impl, fake_impl=_mxfp4_experts_fake)


def _expert_pairs_impl(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """The float routed experts over a routing -> the weighted pairs [n, top_k, hidden]: the
    fused-MoE kernel on CUDA (workers/kernels/v4/v4_experts.py: each pair reads its expert's
    weights only); elsewhere each picked expert's GEMMs over its rows."""
    expert_tally.record(w13, topk_ids)  # a probe's count of the experts touched (eager steps)
    if x.is_cuda:
        from atomrt.workers.kernels.v4.v4_experts import v4_fused_experts

        return v4_fused_experts(x, w13, w2, topk_weights, topk_ids, limit)
    n, top_k = topk_ids.shape
    pairs = x.new_zeros(n, top_k, x.shape[1])
    for e in torch.unique(topk_ids).tolist():
        rows, slot = torch.where(topk_ids == e)
        y = F.linear(clamped_swiglu(F.linear(x[rows], w13[e]), limit), w2[e])
        pairs[rows, slot] = y * topk_weights[rows, slot, None].to(x.dtype)
    return pairs


def _expert_pairs_fake(x: torch.Tensor, topk_weights: torch.Tensor, *rest: object) -> torch.Tensor:
    return x.new_empty(x.shape[0], topk_weights.shape[1], x.shape[1])


# Opaque to Dynamo, as the MXFP4 op: the CPU loop has data-dependent shapes; the kernel plans from
# shapes and the device-side routing alone. The pairs' sum is left to traced code.
direct_register_custom_op("v4_expert_pairs", _expert_pairs_impl, fake_impl=_expert_pairs_fake)


class V4Gate(nn.Module):
    """The router: scores, then the experts each row goes to and their weights."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring_func: str,
        routed_scaling_factor: float,
        hashed: bool,
        vocab_size: int,
    ) -> None:
        super().__init__()
        self.top_k, self.scoring_func, self.scale = top_k, scoring_func, routed_scaling_factor
        self.hashed = hashed
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if hashed:
            # the checkpoint's table replaces this spread (dummy weights keep it)
            table = (
                torch.arange(vocab_size).unsqueeze(1) * top_k + torch.arange(top_k)
            ) % num_experts
            self.register_buffer("tid2eid", table.long())
        else:
            self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        if self.scoring_func == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        if self.scoring_func == "sigmoid":
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden], input_ids [n] -> (expert ids [n, top_k], weights [n, top_k])."""
        scores = self.scores(x)
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scale


class V4MoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        n_shared_experts: int,
        scoring_func: str,
        routed_scaling_factor: float,
        swiglu_limit: float,
        hashed: bool,
        vocab_size: int,
        tp: TPInfo = TPInfo(),
        dp: DPInfo = DPInfo(),
    ) -> None:
        super().__init__()
        self.tp, self.dp = tp, dp
        # the routed experts run on every DP rank's rows: split over the DP x TP world
        self.shard = dp.dp_rank * tp.tp_size + tp.tp_rank
        world = dp.dp_size * tp.tp_size
        routed_size = divide(intermediate_size, world, "moe_intermediate_size")
        shared_size = divide(intermediate_size, tp.tp_size, "moe_intermediate_size")
        self.num_experts, self.intermediate_size, self.limit = (
            num_experts,
            intermediate_size,
            swiglu_limit,
        )
        self.gate = V4Gate(
            hidden_size, num_experts, top_k, scoring_func, routed_scaling_factor, hashed, vocab_size
        )
        self.intermediate_size, self.hidden_size = routed_size, hidden_size
        self.mxfp4 = False  # the routed experts held as MXFP4 (`keep_mxfp4`)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * routed_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, routed_size))
        # transformers' shared expert is one SwiGLU of moe_intermediate_size, whatever the count
        self.shared_experts = (
            SwiGLU(hidden_size, shared_size, swiglu_limit) if n_shared_experts else None
        )

    def keep_mxfp4(self) -> None:
        """Hold the routed experts as MXFP4, as DeepSeek-V4's checkpoints ship them, before they
        load: `w13_packed` [E, 2I, H / 2] and `w2_packed` [E, H, I / 2] e2m1 pairs with e8m0
        exponents `w13_scale` [E, 2I, H / 32] and `w2_scale` [E, H, I / 32] (uint8) in place of
        w13 / w2. The checkpoint's experts (`MXFP4Weight`s) load into them as they ship; CUDA runs
        them through the w4a16 fused-MoE kernel (16-bit activations)."""
        e, two_i, hidden = self.w13.shape
        i = two_i // 2
        for name, size in (
            ("hidden_size", hidden),
            ("moe_intermediate_size / (data_parallel_size x tensor_parallel_size)", i),
        ):
            if size % MXFP4_BLOCK:
                raise ValueError(
                    f"MXFP4 experts: {name} = {size} is not a multiple of {MXFP4_BLOCK} (one e8m0 "
                    f"scale per {MXFP4_BLOCK} input features)"
                )
        device = self.w13.device
        del self.w13, self.w2
        # the shapes the checkpoint's experts are checked against, without their float storage
        self.w13 = torch.empty(e, two_i, hidden, device="meta")
        self.w2 = torch.empty(e, hidden, i, device="meta")
        for name, shape in (("w13", (e, two_i, hidden)), ("w2", (e, hidden, i))):
            rows, cols = shape[1], shape[2]
            packed = torch.zeros(e, rows, cols // 2, dtype=torch.uint8, device=device)
            exponents = torch.zeros(e, rows, cols // MXFP4_BLOCK, dtype=torch.uint8, device=device)
            self.register_buffer(f"{name}_packed", packed)
            self.register_buffer(f"{name}_scale", exponents)
        self.mxfp4 = True
        self.mxfp4_loaded: set[tuple[int, str]] = set()

    def process_weights_after_loading(self) -> None:
        """MXFP4 experts: every expert's w1, w2 and w3 must have loaded."""
        if not self.mxfp4:
            return
        missing = self.num_experts * 3 - len(self.mxfp4_loaded)
        if missing:
            absent = [
                f"experts.{e}.{p}"
                for e in range(self.num_experts)
                for p in ("w1", "w2", "w3")
                if (e, p) not in self.mxfp4_loaded
            ]
            raise ValueError(
                f"MXFP4 experts: {missing} routed expert tensors missing, e.g. {absent[:4]}"
            )

    def load_expert(self, expert: int, proj: str, weight: Sliceable) -> None:
        """Checkpoint tensor `experts.<expert>.<proj>.weight` (whole) into its place in w13 / w2:
        this rank's rows of w1 / w3, its columns of w2 (packed again when held as MXFP4)."""
        i = self.intermediate_size
        start = self.shard * i
        if self.mxfp4:
            self._load_mxfp4(expert, proj, weight, start)
            return
        if isinstance(weight, MXFP4Weight):  # a layer that does not hold them packed
            weight = weight.dequantize()
        with torch.no_grad():
            if proj == "w2":
                self.w2[expert].copy_(read_narrow(weight, 1, start, i))
            else:
                rows = slice(0, i) if proj == "w1" else slice(i, 2 * i)
                self.w13[expert, rows].copy_(read_narrow(weight, 0, start, i))

    def _load_mxfp4(self, expert: int, proj: str, weight: Sliceable, start: int) -> None:
        if not isinstance(weight, MXFP4Weight):
            raise ValueError(f"experts.{expert}.{proj}: the MXFP4 experts take MXFP4 weights")
        i = self.intermediate_size
        if proj == "w2":
            packed, exponents = weight.narrow(1, start, i)
            self.w2_packed[expert].copy_(packed)
            self.w2_scale[expert].copy_(exponents)
        else:
            rows = slice(0, i) if proj == "w1" else slice(i, 2 * i)
            packed, exponents = weight.narrow(0, start, i)
            self.w13_packed[expert, rows].copy_(packed)
            self.w13_scale[expert, rows].copy_(exponents)
        self.mxfp4_loaded.add((expert, proj))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] (after ffn_norm), input_ids: the step's token ids of every DP rank
        (`[dp_size * n]`, in DP-rank order; the hash routing reads them) -> [n, hidden]."""
        routed = dp_all_gather(x, self.dp)  # [dp_size * n, hidden]
        routed = self._routed(routed, input_ids)
        routed = dp_reduce_scatter(routed, self.dp)  # this rank's rows, summed over the DP ranks
        return self._finish(x, routed)

    def forward_ubatch(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> Generator[None, None, torch.Tensor]:
        """`forward` as one microbatch of two-batch overlap: pauses before and after each
        exchange with the other DP ranks."""
        routed = x
        if self.dp.dp_size > 1:
            yield
            routed = dp_all_gather(x, self.dp)
            yield
        routed = self._routed(routed, input_ids)
        if self.dp.dp_size > 1:
            yield
            routed = dp_reduce_scatter(routed, self.dp)
            yield
        return self._finish(x, routed)

    def _finish(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The shared expert on the rank's own rows, then the TP ranks' sum."""
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return tp_all_reduce(routed, self.tp)

    def _routed(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x, input_ids)
        if self.mxfp4:
            args = (x, weights, ids, self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale)
            if torch.compiler.is_compiling():
                return torch.ops.atomrt.v4_mxfp4_experts(*args, float(self.limit))
            return _mxfp4_experts_impl(*args, float(self.limit))
        args = (x, weights, ids, self.w13, self.w2, float(self.limit))
        if torch.compiler.is_compiling():
            return torch.ops.atomrt.v4_expert_pairs(*args).sum(dim=1)
        return _expert_pairs_impl(*args).sum(dim=1)

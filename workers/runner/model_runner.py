# Hot path (worker, once per step): prepare inputs -> run_model -> sample. What may live here: the
# static input buffers, filling them by slicing, the eager / graph-replay dispatch that the step's
# ForwardDecision names, and sampling. Capture runs once (capture_cudagraph); KV sizing in kv_cache.
"""`ModelRunner`: owns the model, its static input buffers (`forward_vars`), the KV cache and the graphs."""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import numpy as np
import torch

from atomrt.compile.decorators import compile_model
from atomrt.graphs.region_graph import ReqGraph, captured_token_sizes
from atomrt.runtime.config import Config, CUDAGraphMode
from atomrt.runtime.forward_context import AttentionMetaData, Context, DPMetadata, set_forward_context
from atomrt.runtime.decision import CapturedBuckets, ForwardDecision, ForwardKind
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.kv_cache import KVCacheTensor, KVLayerSpec, allocate_kv_cache, kv_bytes_per_block
from atomrt.workers.layers.attention import collect_attention_layers
from atomrt.workers.layers.tp_ops import TPInfo
from atomrt.workers.loading.loader import load_model
from atomrt.workers.runner.packed_step import PackedStep, write_padded
from atomrt.workers.runner.sampler import Sampler, SamplerOutput, SamplingTensors, greedy_argmax

logger = logging.getLogger(__name__)

_READBACK_SLOTS = 4  # pinned token buffers reused by start_readback (async scheduling keeps <= 2 busy)


class ReadbackSlot:
    """A pinned host buffer for a step's sampled tokens and the event that says their copy landed.
    The runner keeps a few and reuses them (a step's readback allocates nothing); `busy` from the
    copy's start until `Readback.wait`."""

    def __init__(self, size: int) -> None:
        self.tokens = torch.empty(size, dtype=torch.int64, pin_memory=True)
        self.event = torch.cuda.Event()
        self.busy = False


class Readback:
    """A step's sampled tokens (and logprobs) on their way to the host. On CUDA the copies are queued
    behind the step and the host waits on an event, so a later step queued meanwhile is not waited
    for; on CPU the values are already there. The tokens land in `slot` when one is given (free,
    and large enough), else in a new pinned tensor."""

    def __init__(self, out: SamplerOutput, device: torch.device, slot: Optional[ReadbackSlot] = None) -> None:
        lp = out.logprobs
        tensors = [out.sampled_token_ids]
        if lp is not None:
            tensors += [lp.sampled_logprobs.float(), lp.top_token_ids.to(torch.int32), lp.top_logprobs.float()]
        self.event: Optional[torch.cuda.Event] = None
        self.slot: Optional[ReadbackSlot] = None
        if device.type == "cuda":
            tokens = tensors[0]
            fits = slot is not None and tokens.dtype == slot.tokens.dtype and tokens.shape[0] <= slot.tokens.shape[0]
            if fits and not slot.busy:
                host = slot.tokens[: tokens.shape[0]]
                host.copy_(tokens, non_blocking=True)
                tensors = [host] + [t.to("cpu", non_blocking=True) for t in tensors[1:]]
                slot.busy, self.slot, self.event = True, slot, slot.event
            else:
                tensors = [t.to("cpu", non_blocking=True) for t in tensors]
                self.event = torch.cuda.Event()
            self.event.record()
        self.tensors = tensors

    def wait(self) -> tuple[list[int], Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
        """(token ids, (sampled logprobs, top ids, top logprobs) or None)."""
        if self.event is not None:
            self.event.synchronize()
        tokens = self.tensors[0].tolist()
        if self.slot is not None:  # the tokens are out of the slot: it may take the next step's
            self.slot.busy, self.slot = False, None
        if len(self.tensors) == 1:
            return tokens, None
        return tokens, tuple(t.numpy() for t in self.tensors[1:])


def resolve_device(config: Config, local_device: Optional[int] = None) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is visible")
    return torch.device("cuda", local_device if local_device is not None else torch.cuda.current_device())


def resolve_dtype(config: Config, device: torch.device) -> torch.dtype:
    name = config.model_config.dtype
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


class ModelRunner:
    def __init__(self, config: Config, device: torch.device, tp: TPInfo = TPInfo(), rank: int = 0) -> None:
        self.config = config
        self.device = device
        self.rank = rank
        self.tp = tp
        self.dtype = resolve_dtype(config, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        loaded = load_model(config, device, self.dtype, tp)
        self.model, self.arch = compile_model(loaded.model, config), loaded.arch
        self.max_model_len = config.model_config.max_model_len or self.arch.max_position
        self.block_size = config.cache_config.block_size
        self.attn_layers = collect_attention_layers(self.model)
        self.kv_cache: dict[str, KVCacheTensor] = {}
        self.sampler = Sampler()
        self.enforce_eager = config.enforce_eager or device.type != "cuda"
        self.capture_sizes: list[int] = []
        self.req_graph: Optional[ReqGraph] = None
        self.graph_pool_bytes = 0  # after capture: the shared pool, and the pool after the largest bucket
        self.graph_pool_largest_bytes = 0
        self._allocate_static_buffers()

    # ---------------------------------------------------------------- buffers and KV cache

    def _allocate_static_buffers(self) -> None:
        sc = self.config.scheduler_config
        self.max_num_seqs = sc.max_num_seqs
        max_capture = max(self.config.capture_sizes or [0])
        self.max_num_tokens = max(sc.max_num_batched_tokens, max_capture)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        dev, n, s = self.device, self.max_num_tokens, self.max_num_seqs
        self.forward_vars: dict[str, torch.Tensor] = {
            "input_ids": torch.zeros(n, dtype=torch.int64, device=dev),
            "positions": torch.zeros(n, dtype=torch.int64, device=dev),
            "slot_mapping": torch.full((n,), -1, dtype=torch.int64, device=dev),
            "cu_seqlens_q": torch.zeros(s + 1, dtype=torch.int32, device=dev),
            "context_lens": torch.zeros(s, dtype=torch.int32, device=dev),
            "block_tables": torch.full((s, self.max_blocks_per_seq), -1, dtype=torch.int32, device=dev),
            "logits_indices": torch.zeros(s, dtype=torch.int64, device=dev),
            "outputs": torch.zeros(n, self.arch.hidden_size, dtype=self.dtype, device=dev),
        }
        # Async scheduling: a row's token is gathered from the token pool: [the step's staged ids |
        # the previous step's sampled tokens], at the index `token_src` names (StepInputs.token_src).
        self.token_pool: Optional[torch.Tensor] = None
        self.prev_token_base: Optional[int] = None
        if self.config.scheduler_config.async_scheduling:
            self.token_pool = torch.zeros(n + s, dtype=torch.int64, device=dev)
            self.prev_token_base = n
            self.forward_vars["staged_ids"] = self.token_pool[:n]
            self.forward_vars["prev_tokens"] = self.token_pool[n:]
            self.forward_vars["token_src"] = torch.zeros(n, dtype=torch.int64, device=dev)
            self._own_rows = np.arange(n, dtype=np.int64)
        # Host staging: on CUDA, pinned mirrors filled with numpy and copied asynchronously (one copy
        # per buffer, padding included); on CPU the buffers are filled in place.
        self._staging = {
            k: v.cpu().pin_memory() if dev.type == "cuda" else v
            for k, v in self.forward_vars.items() if k not in ("outputs", "prev_tokens")
        }
        # The pinned staging buffers are rewritten every step. Under async scheduling the host may
        # stage step N+1 before step N's copies ran, so it first waits for this event (recorded after
        # a step's copies were queued; in practice long complete). Synchronously it has already
        # waited for step N's tokens.
        self._staging_read = torch.cuda.Event() if dev.type == "cuda" and self.token_pool is not None else None
        self._readback_slots = [ReadbackSlot(s) for _ in range(_READBACK_SLOTS)] if dev.type == "cuda" else []
        self._replayed_tokens: Optional[torch.Tensor] = None  # the last request-graph replay's argmax [rows]
        # Request-graph steps (FULL decode) travel packed: one copy, unpacked inside the graph.
        self.packed: Optional[PackedStep] = None
        self._staged: Optional[tuple[int, int]] = None  # (seqs, rows) of the step last staged packed
        if dev.type == "cuda" and not self.enforce_eager and self.config.cudagraph_mode.records_request_graphs() and max_capture:
            self.packed = PackedStep(max_capture, max_capture, self.max_blocks_per_seq, dev, self.prev_token_base)

    def kv_layer_specs(self) -> list[KVLayerSpec]:
        return [KVLayerSpec(i, a.num_kv_heads, a.head_dim) for i, a in sorted(self.attn_layers.items())]

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.kv_layer_specs(), self.block_size, self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = allocate_kv_cache(self.kv_layer_specs(), num_blocks, self.block_size, self.dtype, self.device)
        self.num_kv_blocks = num_blocks

    # ---------------------------------------------------------------- one step

    def _fill(self, name: str, values: np.ndarray, length: int, pad: Any) -> None:
        """forward_vars[name][:length] = values, then `pad` (rows of a 2-D buffer alike)."""
        staging = self._staging[name]
        write_padded(staging.numpy(), values, length, pad)
        if staging is not self.forward_vars[name]:
            self.forward_vars[name][:length].copy_(staging[:length], non_blocking=True)

    def prepare(self, inputs: StepInputs, decision: ForwardDecision) -> tuple[AttentionMetaData, Context]:
        """Copy the step into the static buffers (padding rows zeroed, padded slots -1).

        A request-graph step on CUDA is staged packed instead (`self.packed`): its one copy lands in
        the packed device buffer, and the graph's first nodes unpack it into the static buffers."""
        fv = self.forward_vars
        n, bs = inputs.num_tokens, inputs.num_seqs
        rows = max(decision.running_tokens, n)
        seqs = decision.running_bs if decision.kind is ForwardKind.REQ_GRAPH else bs
        if self.token_pool is not None and inputs.token_src is None:  # every row's token is staged
            inputs.token_src = self._own_rows[:n]
        if self._staging_read is not None:
            self._staging_read.synchronize()
        if self.packed is not None and decision.kind is ForwardKind.REQ_GRAPH:
            self.packed.stage(inputs, seqs, rows)
            self._staged = (seqs, rows)
        else:
            if self.token_pool is not None:
                self._fill("staged_ids", inputs.input_ids, rows, 0)
                self._fill("token_src", inputs.token_src, rows, 0)
            else:
                self._fill("input_ids", inputs.input_ids, rows, 0)
            self._fill("positions", inputs.positions, rows, 0)
            self._fill("slot_mapping", inputs.slot_mapping, rows, -1)
            self._fill("cu_seqlens_q", inputs.cu_seqlens_q, seqs + 1, n)
            self._fill("context_lens", inputs.context_lens, seqs, 0)
            self._fill("block_tables", inputs.block_tables, seqs, -1)
        md = AttentionMetaData(
            cu_seqlens_q=fv["cu_seqlens_q"][: seqs + 1],
            context_lens=fv["context_lens"][:seqs],
            block_tables=fv["block_tables"][:seqs],
            slot_mapping=fv["slot_mapping"][:rows],
            max_seqlen_q=max(inputs.max_seqlen_q, 1 + decision.draft_num if not decision.is_prefill else 0),
            max_seqlen_k=inputs.max_seqlen_k,
            num_seqs=seqs,
            num_tokens=n,
            cu_seqlens_q_cpu=inputs.cu_seqlens_q.tolist(),
            context_lens_cpu=inputs.context_lens.tolist(),
            graph_safe=decision.kind is ForwardKind.REQ_GRAPH,
        )
        context = Context(
            positions=fv["positions"][:rows],
            is_prefill=decision.is_prefill,
            batch_size=bs,
            running_bs=decision.running_bs,
            running_tokens=rows,
        )
        return md, context

    def unpack_step(self, seqs: int, rows: int) -> None:
        """The device half of staging, recorded at the head of request graphs: unpack the packed
        step (which gathers the rows' tokens too, under async scheduling), else only the gather."""
        if self.packed is not None:
            self.packed.unpack(self.forward_vars, seqs, rows)
        else:
            self.gather_input_ids(rows)

    def gather_input_ids(self, rows: int) -> None:
        """input_ids[:rows] = token_pool[token_src[:rows]] (async scheduling; else a no-op)."""
        if self.token_pool is not None:
            fv = self.forward_vars
            torch.index_select(self.token_pool, 0, fv["token_src"][:rows], out=fv["input_ids"][:rows])

    def execute(self, inputs: StepInputs, decision: ForwardDecision, sampling: SamplingTensors) -> SamplerOutput:
        md, context = self.prepare(inputs, decision)
        dp = DPMetadata.make(list(decision.dp_num_tokens), decision.running_tokens) if decision.dp_num_tokens else None
        rows = context.running_tokens
        num_sampled = int(inputs.sample_rows.shape[0])
        if num_sampled == inputs.num_tokens:  # every row samples (decode): no gather needed
            logits_indices = slice(0, num_sampled)
        else:
            self._fill("logits_indices", inputs.sample_rows, num_sampled, 0)
            logits_indices = self.forward_vars["logits_indices"][:num_sampled]
        if self._staging_read is not None:
            self._staging_read.record()
        if decision.kind is not ForwardKind.REQ_GRAPH:  # a request graph gathers them itself
            self.gather_input_ids(rows)
        with set_forward_context(
            md, self.config, context, no_compile_layers=self.attn_layers, kv_cache_data=self.kv_cache,
            dp_metadata=dp, tr_graph=decision.tr_graph,
        ):
            logits, _ = self.run_model(self.forward_vars["input_ids"][:rows], decision, logits_indices)
        if num_sampled == 0:  # an idle DP rank's dummy batch
            return SamplerOutput(logits.new_empty(0, dtype=torch.int64))
        if self._replayed_tokens is not None and sampling.is_plain_greedy:
            # The request graph's argmax (which also fed the next step's pending rows).
            return SamplerOutput(self._replayed_tokens[:num_sampled])
        out = self.sampler(logits, sampling)
        if self.token_pool is not None:
            self._keep_sampled(out.sampled_token_ids, sampling)
        return out

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """The argmax of a request graph's logits [rows, vocab], recorded after them: a plain greedy
        step takes its tokens from here with no sampler launch. Under async scheduling they go to
        the token pool too, as `_keep_sampled` would put them (a step that samples otherwise
        overwrites them after the replay)."""
        tokens = greedy_argmax(logits)
        if self.token_pool is not None:
            self.forward_vars["prev_tokens"][: tokens.shape[0]].copy_(tokens)
        return tokens

    def _keep_sampled(self, tokens: torch.Tensor, sampling: SamplingTensors) -> None:
        """Async scheduling: the step's tokens become the next step's pending inputs. Every TP rank
        must feed the same ones: unless sampling is plain greedy (an argmax of the same logits),
        TP rank 0's are broadcast."""
        if self.tp.tp_size > 1 and not (sampling.all_greedy and not sampling.do_penalties):
            torch.distributed.broadcast(tokens, src=self.rank - self.tp.tp_rank, group=self.tp.group)
        self.forward_vars["prev_tokens"][: tokens.shape[0]].copy_(tokens)

    def start_readback(self, out: SamplerOutput) -> "Readback":
        """Start copying a step's tokens (and logprobs) to the host; `Readback.wait` returns them.
        On CUDA the tokens go to a free one of the runner's pinned slots (a step in flight and one
        waiting hold two); with none free a new buffer is allocated."""
        slot = next((s for s in self._readback_slots if not s.busy), None)
        return Readback(out, self.device, slot)

    def run_model(
        self, input_ids: torch.Tensor, decision: ForwardDecision, logits_indices: Union[torch.Tensor, slice]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward the step's ForwardDecision names: eager, ReqGraph.replay, or the token graph.

        Under TOKEN_GRAPH the forward context says tr_graph="replay" and the model's `@token_graph`
        unit replays its recording; under REQ_GRAPH the request bucket's graph replays (unpacking
        the staged step first, see `prepare`): its hidden states land in `forward_vars["outputs"]`,
        and its output is every row's logits, which a `slice` of `logits_indices` (the rows a decode
        step samples) takes as they are. Otherwise logits are computed for `logits_indices` rows only.
        """
        num_rows = input_ids.shape[0]
        self._replayed_tokens = None
        if decision.kind is ForwardKind.REQ_GRAPH:
            if self.packed is not None and self._staged != (decision.running_bs, num_rows):
                raise RuntimeError(
                    f"request graph {decision.req_key} replayed without its step staged by prepare() "
                    f"(staged: {self._staged}); it would unpack another bucket's layout"
                )
            logits, tokens = self.req_graph.replay(decision.req_key)  # every row's, valid until the next replay
            hidden_states = self.forward_vars["outputs"][:num_rows]
            if isinstance(logits_indices, slice):  # rows 0..n-1 sample: the graph computed their logits
                self._replayed_tokens = tokens
                return logits[logits_indices], hidden_states
        else:
            hidden_states = self.model(input_ids, self.forward_vars["positions"][:num_rows])
        return self.model.compute_logits(hidden_states[logits_indices]), hidden_states

    # ---------------------------------------------------------------- capture

    @torch.inference_mode()
    def capture_cudagraph(self) -> tuple[float, list[int]]:
        """Record the graphs of the step kinds the CUDA-graph mode replays; see workers/runner/graph_capture.py."""
        from atomrt.workers.runner.graph_capture import capture_all

        return capture_all(self)

    def captured_buckets(self) -> CapturedBuckets:
        """What capture recorded, for the driver's ForwardMode."""
        mode = self.config.cudagraph_mode
        if self.enforce_eager or mode == CUDAGraphMode.NONE:
            return CapturedBuckets()
        return CapturedBuckets(
            req_keys=tuple(self.req_graph.keys()) if self.req_graph is not None else (),
            prefill_token_sizes=tuple(captured_token_sizes(self.model, "prefill")),
            decode_token_sizes=tuple(captured_token_sizes(self.model, "decode")),
        )

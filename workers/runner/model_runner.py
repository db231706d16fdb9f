# Hot path (worker, once per step): prepare inputs -> run_model -> sample. What may live here: the
# eager / graph-replay dispatch that the step's ForwardDecision names, and sampling. The static
# buffers are step_buffers.py's, capture and replay graph_runner.py's, KV sizing kv_sizing.py's;
# speculative decoding hides behind `self.spec` (workers/spec_decode/speculator.py).
"""`ModelRunner`: one rank's model, its KV cache, static buffers and graphs, and its step."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Optional, Union

import torch

from atomrt.compile.decorators import compile_model
from atomrt.distributed.communication_op import DPInfo, TPInfo
from atomrt.runtime.config import Config
from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.runtime.forward_context import DPMetadata, SpecDecodeMetadata, set_forward_context
from atomrt.workers.layers.attention import Attention, collect_attention_layers
from atomrt.workers.layers.mla import MLAAttention
from atomrt.workers.layers.v4_attention import V4Attention
from atomrt.workers.loading.loader import load_model
from atomrt.workers.runner.grammar_upload import GrammarUpload
from atomrt.workers.runner.graph_runner import GraphRunner
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.kv_cache import (
    FP8_KV_DTYPES,
    CacheEntry,
    LayerSpec,
    allocate_kv_cache,
    kv_bytes_per_block,
    kv_cache_torch_dtype,
    kv_layer_specs,
)
from atomrt.workers.runner.logit_additions import apply_grammar_bitmask, greedy_under_grammar
from atomrt.workers.runner.prompt_logprobs import compute_prompt_logprobs
from atomrt.workers.runner.readback import Readback, Readbacks
from atomrt.workers.runner.sampler import Sampler, SamplerOutput, SamplingTensors, greedy_argmax
from atomrt.workers.runner.step_buffers import RunnerShape, StepBuffers
from atomrt.workers.runner.token_pool import TokenPool
from atomrt.workers.runner.ubatch import SplitStep, UbatchRunner
from atomrt.workers.spec_decode.proposer import TargetStep
from atomrt.workers.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)


def resolve_device(config: Config, local_device: Optional[int] = None) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is visible")
    return torch.device(
        "cuda", local_device if local_device is not None else torch.cuda.current_device()
    )


def resolve_dtype(config: Config, device: torch.device) -> torch.dtype:
    name = config.model_config.dtype
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # [len(logits_indices), vocab]
    hidden_states: torch.Tensor  # [rows, hidden]
    tokens: Optional[torch.Tensor]  # a request graph's recorded argmax of those logits, else None


class StepForward(NamedTuple):
    """A step whose forward ran and whose sampling has not: what `ModelRunner.sample` needs
    (valid until the next step's forward)."""

    out: ModelOutput
    inputs: StepInputs
    sampling: SamplingTensors
    spec: Optional[SpecDecodeMetadata]
    target: Optional[TargetStep]  # what a method drafting after sampling (MTP) drafts from


class GrammarMask(NamedTuple):
    """Structured outputs: the step's logits rows a grammar constrains and their packed masks."""

    rows: torch.Tensor  # int64 [m]
    bitmask: torch.Tensor  # int32 [m, words]


def _check_fp8_cache(config: Config, device: torch.device, layers: dict[int, object]) -> None:
    """An FP8 KV cache on CUDA needs kernels that read it: the paged attention, MLA and
    DeepSeek-V4 ones do (V4's widen its e4m3 rows); any other layer kind's read the model's dtype
    only."""
    kv = config.cache_config.kv_cache_dtype
    if kv not in FP8_KV_DTYPES or device.type != "cuda":
        return
    supported = (Attention, MLAAttention, V4Attention)
    other = sorted({type(x).__name__ for x in layers.values() if not isinstance(x, supported)})
    if other:
        raise ValueError(
            f"cache_config.kv_cache_dtype={kv!r} on CUDA: the {', '.join(other)} layers' kernels "
            "read the cache in the model's dtype (their FP8 caches run on CPU); use 'auto'"
        )


class ModelRunner:
    def __init__(
        self,
        config: Config,
        device: torch.device,
        tp: TPInfo = TPInfo(),
        dp: DPInfo = DPInfo(),
    ) -> None:
        self.config = config
        self.device = device
        self.tp, self.dp = tp, dp
        dtype = resolve_dtype(config, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        loaded = load_model(config, device, dtype, tp, dp)
        self.model, self.arch = compile_model(loaded.model, config), loaded.arch
        sc = config.scheduler_config
        self.shape = RunnerShape(
            max_model_len=config.model_config.max_model_len or self.arch.max_position,
            block_size=config.cache_config.block_size,
            max_num_seqs=sc.max_num_seqs,
            max_num_tokens=max(sc.max_num_batched_tokens, max(config.capture_sizes or [0])),
        )
        self.kv_cache: dict[str, CacheEntry] = {}
        self.sampler = Sampler()
        self.grammar_upload = GrammarUpload(device)  # structured outputs' masks to the device
        enforce_eager = config.enforce_eager or device.type != "cuda"
        self.graphs = GraphRunner(config, enabled=not enforce_eager)
        spec = config.speculative_config
        self.spec: Optional[Speculator] = None  # speculative decoding
        if spec is not None:
            self.spec = Speculator(
                config, device, dtype, tp, self.shape, self.graphs.enabled, self.model, dp
            )
        # every layer's attention, the drafter's own layers' (MTP) with the target's: one KV
        # cache layout and one forward context
        self.attn_layers = collect_attention_layers(self.model)
        if self.spec is not None:
            self.attn_layers.update(self.spec.attention_layers())
        _check_fp8_cache(config, device, self.attn_layers)
        self.tokens: Optional[TokenPool] = None  # async scheduling's and a drafter's token state
        if sc.async_scheduling or (self.spec is not None and self.spec.drafts_in_pool):
            self.tokens = TokenPool(
                self.shape.max_num_tokens, self.shape.max_num_seqs, device, spec is not None
            )
        self.buffers = StepBuffers(
            self.shape,
            self.arch.hidden_size,
            dtype,
            device,
            self.tokens,
            self.graphs.packed_bucket,
            config.max_q_len,
        )
        # values read back per request: its token, or its tokens and drafts
        width = self.spec.readback_width if self.spec is not None else 1
        self.readbacks = Readbacks(device, self.shape.max_num_seqs * width)
        self.ubatch: Optional[UbatchRunner] = None  # two-batch overlap
        if config.parallel_config.enable_tbo != "none":
            self.ubatch = UbatchRunner(
                self.shape.max_num_seqs, self.shape.max_blocks_per_seq, device
            )

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and, with cache_config.kv_cache_dtype "auto", KV cache's) dtype."""
        return self.buffers.forward_vars["outputs"].dtype

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache tensors' dtype (`cache_config.kv_cache_dtype`)."""
        return kv_cache_torch_dtype(self.config.cache_config.kv_cache_dtype, self.dtype)

    @property
    def rank(self) -> int:
        """This worker's rank in the world: DP-major, TP-minor."""
        return self.dp.dp_rank * self.tp.tp_size + self.tp.tp_rank

    # ---------------------------------------------------------------- KV cache

    def kv_layer_specs(self) -> list[LayerSpec]:
        return kv_layer_specs(self.attn_layers)

    def kv_bytes_per_block(self) -> int:
        """A block's bytes over every layer (a draft model's layers too: it shares the blocks)."""
        draft = self.spec.kv_bytes_per_block() if self.spec is not None else 0
        specs, block_size = self.kv_layer_specs(), self.shape.block_size
        return kv_bytes_per_block(specs, block_size, self.kv_cache_dtype) + draft

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = allocate_kv_cache(
            self.kv_layer_specs(),
            num_blocks,
            self.shape.block_size,
            self.kv_cache_dtype,
            self.device,
        )
        if self.spec is not None:
            self.spec.allocate_kv_cache(num_blocks)

    # ---------------------------------------------------------------- one step

    def execute(
        self, inputs: StepInputs, decision: ForwardDecision, sampling: SamplingTensors
    ) -> SamplerOutput:
        """One step on this rank: stage, run the forward the decision names, sample."""
        return self.sample(self.forward(inputs, decision, sampling))

    def forward(
        self, inputs: StepInputs, decision: ForwardDecision, sampling: SamplingTensors
    ) -> StepForward:
        """Stage the step and run the forward the decision names (a draft model drafts first)."""
        split: Optional[SplitStep] = None
        if decision.ubatch_rows is not None and decision.kind is not ForwardKind.REQ_GRAPH:
            split = self.ubatch.split(inputs, decision)  # two-batch overlap, eager
            inputs = split.inputs
        md, context = self.buffers.prepare(inputs, decision)
        dp = (
            DPMetadata.make(list(decision.dp_num_tokens), decision.running_tokens)
            if decision.dp_num_tokens
            else None
        )
        rows = context.running_tokens
        logits_indices = self.buffers.logits_indices(inputs)
        if split is not None:
            self.ubatch.stage(split)
        spec = None  # speculative decoding: the proposer's prepare, and the drafts described
        if self.spec is not None:
            spec = self.spec.prepare(inputs, sampling, self.tokens, logits_indices, decision)
        self.buffers.staged()
        if decision.req_key is None:  # a whole-step graph gathers them itself
            self.buffers.gather_input_ids(rows)
        with set_forward_context(
            md,
            self.config,
            context,
            no_compile_layers=self.attn_layers,
            kv_cache_data=self.kv_cache,
            dp_metadata=dp,
            spec_decode_metadata=spec,
            tr_graph=decision.tr_graph,
            tr_req_key=decision.tr_req_key,
        ):
            out = self.run_model(
                self.buffers.forward_vars["input_ids"][:rows], decision, logits_indices, split
            )
        target = None  # what a method drafting after sampling drafts from
        if self.spec is not None and self.spec.drafts_after_sample:
            ids = self.buffers.forward_vars["input_ids"][:rows]
            target = TargetStep(
                decision, md, context, dp, ids, out.hidden_states, self.attn_layers, self.kv_cache
            )
        return StepForward(out, inputs, sampling, spec, target)

    def sample(self, step: StepForward, grammar: Optional[GrammarMask] = None) -> SamplerOutput:
        """Sample a step whose forward ran; `grammar`: structured outputs' masks, applied to the
        rows' logits first (a request graph's recorded argmax of the unmasked logits is not used)."""
        out, sampling = step.out, step.sampling
        prompt_logprobs = None  # the rows of requests that asked, before drafts reuse buffers
        if step.inputs.prompt_rows is not None:
            prompt_logprobs = compute_prompt_logprobs(
                self.model, out.hidden_states, step.inputs.prompt_rows
            )
        if grammar is None:
            sampled = self._sample(out, step.inputs, sampling, step.spec, step.target)
        elif out.logits.device.type == "cpu" and self.spec is None and sampling.is_plain_greedy:
            # greedy: only the rows whose argmax the grammar refuses need the mask
            tokens = greedy_under_grammar(out.logits, grammar.rows, grammar.bitmask)
            sampled = SamplerOutput(tokens)
            if self.tokens is not None:
                self.tokens.keep(tokens, sampling.same_on_every_rank, self.tp)
        else:
            logits = apply_grammar_bitmask(out.logits, grammar.rows, grammar.bitmask)
            out = ModelOutput(logits, out.hidden_states, None)
            sampled = self._sample(out, step.inputs, sampling, step.spec, step.target)
        sampled.prompt_logprobs = prompt_logprobs
        return sampled

    def grammar_mask(self, rows: Any, bitmask: Any) -> GrammarMask:
        """Host arrays (int rows, int32 [m, words] masks) as the device tensors `sample` takes."""
        return GrammarMask(*self.grammar_upload(rows, bitmask))

    def _sample(
        self,
        out: ModelOutput,
        inputs: StepInputs,
        sampling: SamplingTensors,
        spec: Optional[SpecDecodeMetadata],
        target: Optional[TargetStep],
    ) -> SamplerOutput:
        num_sampled = int(inputs.sample_rows.shape[0])
        if num_sampled == 0:  # an idle DP rank's dummy batch, or prompt chunks that sample nothing
            if self.spec is not None:  # a method drafting after sampling runs its passes too
                self.spec.draft_next(target, None, sampling)
            return SamplerOutput(out.logits.new_empty(0, dtype=torch.int64))
        if (
            self.spec is not None
        ):  # verify the drafts; only a step without drafts feeds pending rows
            argmax = out.tokens[: out.logits.shape[0]] if out.tokens is not None else None
            sampled = self.spec.sample(out.logits, argmax, sampling, self.sampler, spec)
            sampled = self.spec.draft_next(target, sampled, sampling)
            if spec is None and self.tokens is not None:  # no drafts: the next step may run ahead
                self.tokens.keep(
                    sampled.sampled_token_ids.view(-1, self.spec.readback_width)[:, 1].contiguous(),
                    sampling.same_on_every_rank,
                    self.tp,
                )
            return sampled
        if out.tokens is not None and sampling.is_plain_greedy:
            # The request graph's argmax (which also fed the next step's pending rows).
            return SamplerOutput(out.tokens[:num_sampled])
        sampled = self.sampler(out.logits, sampling)
        if self.tokens is not None:
            self.tokens.keep(sampled.sampled_token_ids, sampling.same_on_every_rank, self.tp)
        return sampled

    def run_model(
        self,
        input_ids: torch.Tensor,
        decision: ForwardDecision,
        logits_indices: Union[torch.Tensor, slice],
        split: Optional[SplitStep] = None,
    ) -> ModelOutput:
        """The forward the step's ForwardDecision names: eager, ReqGraph.replay, or the token graph;
        an eager step with a `split` runs its two microbatches (workers/runner/ubatch.py).

        Under TOKEN_GRAPH the forward context says tr_graph="replay" and the model's `@token_graph`
        unit replays its recording; under REQ_GRAPH the request bucket's graph replays (unpacking
        the staged step first), and so does a TOKEN_GRAPH decode step with a `req_key`, its token
        graph joined with the unpack, the attention regions' request graphs and the request graph's
        outputs: its hidden states land in `forward_vars["outputs"]`, and its output is every
        row's logits, which a `slice` of `logits_indices` (the rows a decode step samples) takes as
        they are. Otherwise logits are computed for `logits_indices` rows only.
        """
        num_rows = input_ids.shape[0]
        if decision.req_key is not None:  # a request graph, or TR_HYBRID's whole decode step
            self.buffers.check_staged(decision, num_rows)
            logits, tokens = self.graphs.replay(
                decision
            )  # every row's, valid until the next replay
            hidden_states = self.buffers.forward_vars["outputs"][:num_rows]
            if isinstance(
                logits_indices, slice
            ):  # rows 0..n-1 sample: the graph computed their logits
                return ModelOutput(logits[logits_indices], hidden_states, tokens)
        elif split is not None:
            hidden_states = self.ubatch.forward(
                self.model, input_ids, split, self.buffers.forward_vars, decision
            )
        else:
            hidden_states = self.model(input_ids, self.buffers.forward_vars["positions"][:num_rows])
        return ModelOutput(
            self.model.compute_logits(hidden_states[logits_indices]), hidden_states, None
        )

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """The argmax of a request graph's logits [rows, vocab], recorded after them: a plain greedy
        step takes its tokens from here with no sampler launch. Under async scheduling they go to
        the token pool too, as `TokenPool.keep` would put them (a step that samples otherwise
        overwrites them after the replay)."""
        tokens = greedy_argmax(logits)
        if self.tokens is not None:
            self.tokens.prev_tokens[: tokens.shape[0]].copy_(tokens)
        return tokens

    def start_readback(self, out: SamplerOutput) -> Readback:
        """Start copying a step's tokens (and logprobs) to the host; `Readback.wait` returns them."""
        return self.readbacks.start(out)

    # ---------------------------------------------------------------- capture

    @torch.inference_mode()
    def capture_cudagraph(self) -> float:
        """Record the graphs of the step kinds the CUDA-graph mode replays (graph_runner.py);
        returns the seconds it took."""
        return self.graphs.capture(self)

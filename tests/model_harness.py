"""A tiny engine-free driver for model tests: paged KV cache, ragged prefill, greedy decode.

It lays the batch out exactly as the runner does (cu_seqlens_q, context_lens, block_tables with
-1 past the end, slot_mapping with -1 on padded rows), with blocks handed out in a shuffled order
so that paging is exercised, and sets the forward context around each forward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from atomrt.runtime.config import Config
from atomrt.runtime.forward_context import AttentionMetaData, Context, set_forward_context
from atomrt.workers.layers.attention import collect_attention_layers
from atomrt.workers.runner.kv_cache import allocate_kv_cache, kv_layer_specs


@dataclass
class HarnessResult:
    logits: list[torch.Tensor] = field(default_factory=list)  # per step: [num_seqs, vocab] float32
    sequences: list[list[int]] = field(default_factory=list)  # prompt + greedy tokens per sequence


class PagedHarness:
    def __init__(
        self,
        model: nn.Module,
        max_len: int,
        num_seqs: int,
        block_size: int = 4,
        seed: int = 0,
        config: Optional[Config] = None,
    ) -> None:
        """`config`: the forward context's (the default runs no speculation)."""
        self.model = model
        self.block_size = block_size
        self.layers = collect_attention_layers(model)
        param = next(model.parameters())
        self.max_blocks_per_seq = -(-max_len // block_size)
        num_blocks = num_seqs * self.max_blocks_per_seq + 1
        order = list(range(num_blocks))
        random.Random(seed).shuffle(order)
        self.block_tables = [
            order[s * self.max_blocks_per_seq : (s + 1) * self.max_blocks_per_seq]
            for s in range(num_seqs)
        ]
        # every layer's kind of cache (k/v pairs, latent rows) as the runner lays it out
        self.kv_cache_data = allocate_kv_cache(
            kv_layer_specs(self.layers), num_blocks, block_size, param.dtype, param.device
        )
        self.config = config or Config(enforce_eager=True)

    def step(
        self, new_tokens: list[list[int]], num_computed: list[int], num_pad_rows: int = 0
    ) -> torch.Tensor:
        """Run one step: sequence s appends new_tokens[s] after num_computed[s] cached tokens.

        Returns the logits of each sequence's last row, [num_seqs, vocab] float32.
        """
        device = next(self.model.parameters()).device
        input_ids, positions, slots, cu = [], [], [], [0]
        for s, (tokens, start) in enumerate(zip(new_tokens, num_computed)):
            for j, token in enumerate(tokens):
                pos = start + j
                input_ids.append(token)
                positions.append(pos)
                slots.append(
                    self.block_tables[s][pos // self.block_size] * self.block_size
                    + pos % self.block_size
                )
            cu.append(cu[-1] + len(tokens))
        input_ids += [0] * num_pad_rows
        positions += [0] * num_pad_rows
        slots += [-1] * num_pad_rows
        context_lens = [start + len(t) for t, start in zip(new_tokens, num_computed)]
        block_tables = [
            bt[: -(-n // self.block_size)]
            + [-1] * (self.max_blocks_per_seq - -(-n // self.block_size))
            for bt, n in zip(self.block_tables, context_lens)
        ]
        num_seqs = len(new_tokens)
        md = AttentionMetaData(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_seqlen_q=max(len(t) for t in new_tokens),
            max_seqlen_k=max(context_lens),
            num_seqs=num_seqs,
            num_tokens=cu[-1],
            cu_seqlens_q_cpu=cu,
            context_lens_cpu=context_lens,
        )
        positions_t = torch.tensor(positions, dtype=torch.int64, device=device)
        context = Context(
            positions=positions_t,
            is_prefill=any(len(t) > 1 for t in new_tokens),
            batch_size=num_seqs,
            running_bs=num_seqs,
            running_tokens=len(input_ids),
        )
        with (
            torch.inference_mode(),
            set_forward_context(
                md,
                self.config,
                context,
                no_compile_layers=self.layers,
                kv_cache_data=self.kv_cache_data,
            ),
        ):
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.int64, device=device), positions_t
            )
            last_rows = torch.tensor(cu[1:], device=device) - 1
            return self.model.compute_logits(hidden[last_rows])


def run_prefill_and_decode(
    model: nn.Module,
    prompts: list[list[int]],
    num_decode_steps: int,
    block_size: int = 4,
    num_pad_rows: int = 0,
) -> HarnessResult:
    """Prefill every prompt in one ragged batch, then decode greedily `num_decode_steps` times."""
    max_len = max(len(p) for p in prompts) + num_decode_steps + 1
    harness = PagedHarness(model, max_len, len(prompts), block_size)
    result = HarnessResult(sequences=[list(p) for p in prompts])
    new_tokens = [list(p) for p in prompts]
    num_computed = [0] * len(prompts)
    for _ in range(num_decode_steps + 1):
        logits = harness.step(new_tokens, num_computed, num_pad_rows)
        result.logits.append(logits)
        num_computed = [n + len(t) for n, t in zip(num_computed, new_tokens)]
        next_tokens = logits.argmax(dim=-1).tolist()
        for seq, token in zip(result.sequences, next_tokens):
            seq.append(token)
        new_tokens = [[t] for t in next_tokens]
    return result


def load_hf(folder) -> nn.Module:
    """transformers' model of a saved folder, float32, eager attention: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_greedy(folder, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' `generate` greedy tokens of each prompt alone (no end-of-sequence stop)."""
    hf_model = load_hf(folder)
    out = []
    for prompt in prompts:
        with torch.no_grad():
            ids = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
            )
        out.append(ids[0, len(prompt) :].tolist())
    return out


def engine_greedy(folder, prompts: list[list[int]], max_tokens: int, **settings) -> tuple:
    """Greedy tokens through the engine (`LLM(folder, **settings)`), after a first run of
    prompts[0] alone that fills the prefix cache; returns them with what happened (preemptions,
    prefix-hit tokens, two-batch-overlap split steps)."""
    from atomrt import SamplingParams
    from atomrt.runtime.entrypoints.llm import LLM

    llm = LLM(str(folder), **settings)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:1], params)
        outs = llm.generate(prompts, params)
        seen = dict(
            preemptions=sum(o.metrics.num_preemptions for o in outs),
            prefix_hits=llm.engine.schedulers[0].block_manager.num_prefix_hit_tokens,
            split_steps=llm.engine.stats.split_steps,
        )
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], seen


def max_logit_diff(result: HarnessResult, hf_model: nn.Module, prompts: list[list[int]]) -> float:
    """Largest |ours - transformers| over every step's logits (prefill, then each decode), with
    transformers run over each whole sequence at once."""
    worst = 0.0
    for s, prompt in enumerate(prompts):
        with torch.no_grad():
            logits = hf_model(torch.tensor([result.sequences[s][:-1]])).logits[0].float()
        got = torch.stack([step[s] for step in result.logits]).to(logits.device)
        worst = max(worst, (got - logits[len(prompt) - 1 :]).abs().max().item())
    return worst


def _gloo_tp_worker(
    rank: int, tp_size: int, folder: str, prompts: list, init_file: str, out_file: str
) -> None:
    import os
    import traceback

    import torch.distributed as dist

    from atomrt.distributed.communication_op import TPInfo
    from atomrt.workers.loading.loader import load_model

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp_size
    )
    try:
        tp = TPInfo(rank, tp_size, dist.group.WORLD)
        loaded = load_model(Config(model=folder), "cpu", torch.float32, tp)
        result = run_prefill_and_decode(loaded.model, prompts, 2)
        if rank == 0:
            torch.save({"logits": result.logits, "sequences": result.sequences}, out_file)
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    # gloo's teardown can abort the process ("terminate called without an active exception") when
    # its threads race destroy_process_group; what is checked is already written, so leave
    # without running C++ destructors.
    os._exit(0)


def gloo_tp_run(folder, prompts: list[list[int]], work_dir, tp_size: int = 2) -> HarnessResult:
    """run_prefill_and_decode (2 new tokens) of the checkpoint in `folder` at TP=`tp_size`, one
    process per rank over gloo on CPU; rank 0's logits and sequences."""
    import torch.multiprocessing as mp

    out_file = f"{work_dir}/rank0.pt"
    args = (tp_size, str(folder), prompts, f"{work_dir}/init", out_file)
    mp.spawn(_gloo_tp_worker, args=args, nprocs=tp_size)
    saved = torch.load(out_file)
    return HarnessResult(saved["logits"], saved["sequences"])


class NoHostRead(list):
    """A host copy of the step's lengths that a graph-safe launch must not read."""

    def __getitem__(self, index):
        raise AssertionError("a graph-safe launch read the step's host lengths")

    def __iter__(self):
        raise AssertionError("a graph-safe launch read the step's host lengths")


def record_as_request_graphs(monkeypatch) -> None:
    """Every harness step from here on carries a request graph's metadata (FULL records the whole
    step inline): `graph_safe`, and host copies of the lengths whose read fails the test."""

    metadata = AttentionMetaData

    def graph_safe_metadata(**fields) -> AttentionMetaData:
        fields["cu_seqlens_q_cpu"] = NoHostRead(fields["cu_seqlens_q_cpu"])
        fields["context_lens_cpu"] = NoHostRead(fields["context_lens_cpu"])
        return metadata(**fields, graph_safe=True)

    monkeypatch.setattr(f"{__name__}.AttentionMetaData", graph_safe_metadata)

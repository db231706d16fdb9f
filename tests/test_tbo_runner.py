"""Two-batch overlap on one worker (CPU, in-process): the interleaved stage order and context
switches, and a split step's logits against the unsplit step's on a tiny MoE model -- an eager
prefill whose cut straddles a request (its second part must see the first part's KV), an eager
decode cut at the rank's own requests with padding between, and the TBO graph's forward (the
bucket's cut, metadata as views of the step's buffers) run without recording.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from atomrt.distributed.messages import WorkerSamplingParams
from atomrt.runtime.config import Config, ModelConfig, ParallelConfig, SchedulerConfig
from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.runtime.forward_context import (
    Context,
    ForwardContext,
    get_forward_context,
    set_forward_context,
)
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.model_runner import ModelRunner, resolve_device
from atomrt.workers.runner.sampler import SamplingTensors
from atomrt.workers.runner.ubatch import run_ubatches

BLOCK = 16


def test_stage_order_and_contexts() -> None:
    """Microbatch 0 leads by one stage, then they alternate; every stage runs under its own
    microbatch's forward context, and the step's context is back afterwards."""
    seen: list[tuple[int, int, int]] = []

    def forward_ubatch(ids: torch.Tensor, positions: torch.Tensor):
        mb = int(ids[0])
        for stage in range(3):
            seen.append((mb, stage, get_forward_context().context.running_tokens))
            yield
        seen.append((mb, 3, get_forward_context().context.running_tokens))
        return ids.float()[:, None] * 10

    contexts = tuple(
        ForwardContext(context=Context(positions=torch.zeros(n), running_tokens=n)) for n in (2, 3)
    )
    trace: list[tuple[int, int]] = []
    outer = Context(running_tokens=5)
    with set_forward_context(None, None, outer):
        out = run_ubatches(
            forward_ubatch, torch.tensor([0, 0, 1, 1, 1]), contexts, (2, 3), trace=trace
        )
        assert get_forward_context().context is outer
    assert trace == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (0, 3), (1, 2), (1, 3)]
    assert [(mb, stage) for mb, stage, _ in seen] == trace
    assert all(rows == (2 if mb == 0 else 3) for mb, _, rows in seen)
    assert out.squeeze(1).tolist() == [0, 0, 10, 10, 10]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    config = Config(
        model="tiny-qwen3-moe",
        device="cpu",
        model_config=ModelConfig(load_format="dummy", max_model_len=256),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        parallel_config=ParallelConfig(enable_tbo="all"),
    )
    r = ModelRunner(config, resolve_device(config))
    r.allocate_kv_cache(32)
    return r


def _inputs(q_lens: list[int], computed: list[int], seed: int) -> StepInputs:
    """Sequence s owns blocks 4 s .. 4 s + 3; token ids drawn from `seed`."""
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n = int(cu[-1])
    seq_of_row = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = np.asarray(computed)[seq_of_row] + np.arange(n) - cu[:-1][seq_of_row]
    tables = np.asarray([[4 * s + b for b in range(4)] for s in range(len(q_lens))], np.int32)
    rng = np.random.default_rng(seed)
    return StepInputs(
        seq_ids=np.arange(len(q_lens), dtype=np.int64),
        input_ids=rng.integers(2, 200, n).astype(np.int64),
        positions=positions.astype(np.int64),
        slot_mapping=(tables[seq_of_row, positions // BLOCK] * BLOCK + positions % BLOCK).astype(
            np.int64
        ),
        cu_seqlens_q=cu,
        context_lens=(np.asarray(computed) + np.asarray(q_lens)).astype(np.int32),
        block_tables=tables,
        sample_seq_idx=np.arange(len(q_lens), dtype=np.int64),
        sample_rows=cu[1:].astype(np.int64) - 1,
    )


class _Spy:
    """Keeps the logits the sampler is given."""

    def __init__(self, sampler) -> None:
        self.sampler, self.logits = sampler, None

    def __call__(self, logits, sampling):
        self.logits = logits.clone()
        return self.sampler(logits, sampling)


def _logits(runner: ModelRunner, inputs: StepInputs, decision: ForwardDecision) -> torch.Tensor:
    """The sampled rows' logits of one step through `ModelRunner.execute`."""
    n = inputs.num_seqs
    params = [WorkerSamplingParams(temperature=0.0, logprobs=1)] * n  # not plain greedy: samples
    sampling = SamplingTensors.from_params(params, [[0]] * n, [[]] * n, runner.arch.vocab_size)
    spy = _Spy(runner.sampler)
    runner.sampler = spy
    try:
        runner.execute(inputs, decision, sampling)
    finally:
        runner.sampler = spy.sampler
    return spy.logits


def _split(d: ForwardDecision, split_bs, r0: int) -> ForwardDecision:
    return replace(d, ubatch_split_bs=split_bs, ubatch_split_tokens=r0)


def test_split_steps_match_the_unsplit_step(runner: ModelRunner) -> None:
    # A prefill of a 3-row and a 9-row prompt on a rank whose peer runs 14 rows: microbatches of 7
    # rows, this rank cut at its row 6, which the second prompt straddles (3 rows before, 6 after).
    prefill = _inputs([3, 9], [0, 0], seed=1)
    eager = ForwardDecision(ForwardKind.EAGER, 2, 14, True)
    plain = _logits(runner, prefill, eager)
    split = _logits(runner, prefill, _split(eager, None, 7))
    assert (split - plain).abs().max().item() < 1e-4
    assert torch.equal(split.argmax(-1), plain.argmax(-1))
    # The first part's KV matters: the straddler's last 6 rows alone give other logits.
    alone = replace(_inputs([6], [0], seed=1), input_ids=prefill.input_ids[6:].copy())
    alone.slot_mapping[:] = -1  # keep the cache as the prefill left it
    assert (
        _logits(runner, alone, ForwardDecision(ForwardKind.EAGER, 1, 6, True)) - plain[1]
    ).abs().max() > 1e-2

    # A decode over that context and a fresh one-row sequence, on a rank whose peer runs 5
    # requests: the decision cuts 2 | 3 rows, this rank its own 1 | 2, a padding row between.
    decode = _inputs([1, 1, 1], [3, 9, 0], seed=2)
    eager = ForwardDecision(ForwardKind.EAGER, 5, 5, False)
    plain = _logits(runner, decode, eager)
    split = _logits(runner, decode, _split(eager, 2, 2))
    assert (split - plain).abs().max().item() < 1e-4


def test_microbatches_carry_their_index_to_attention(runner: ModelRunner, monkeypatch) -> None:
    """Each microbatch's attention metadata names it (0, 1): on CUDA its split decode launches use
    that microbatch's counters, since the two microbatches' launches may overlap."""
    from atomrt.workers.layers import attention

    seen: list[int] = []
    layer_state = attention.paged_layer_state

    def spy(layer_idx: int):
        layer, md, kv = layer_state(layer_idx)
        seen.append(md.ubatch)
        return layer, md, kv

    monkeypatch.setattr(attention, "paged_layer_state", spy)
    decode = _inputs([1, 1, 1], [3, 9, 0], seed=2)
    eager = ForwardDecision(ForwardKind.EAGER, 5, 5, False)
    _logits(runner, decode, _split(eager, 2, 2))
    assert sorted(set(seen)) == [0, 1]
    seen.clear()
    _logits(runner, decode, eager)
    assert set(seen) == {0}


def test_tbo_graph_forward_matches_the_model(runner: ModelRunner) -> None:
    """What a TBO graph records, run eagerly: the bucket of 8 cut at 4 requests, this rank's 5
    requests staged into it (microbatch 1 has one real request and three padded ones)."""
    _logits(
        runner,
        _inputs([6, 4, 5, 3, 2], [0] * 5, seed=3),
        ForwardDecision(ForwardKind.EAGER, 5, 20, True),
    )  # their context
    inputs = _inputs([1] * 5, [6, 4, 5, 3, 2], seed=4)
    plain = _logits(runner, inputs, ForwardDecision(ForwardKind.EAGER, 5, 5, False))
    graph = ForwardDecision(
        ForwardKind.REQ_GRAPH, 8, 8, False, req_key=(8, 0), ubatch_split_bs=4, ubatch_split_tokens=4
    )
    md, ctx = runner.buffers.prepare(inputs, graph)
    fv = runner.buffers.forward_vars
    scope = dict(no_compile_layers=runner.attn_layers, kv_cache_data=runner.kv_cache)
    with torch.inference_mode(), set_forward_context(md, runner.config, ctx, **scope):
        hidden = runner.ubatch.forward_bucket(runner.model, fv["input_ids"][:8], fv, graph)
        split = runner.model.compute_logits(hidden[:5])
    assert (split - plain).abs().max().item() < 1e-4


@pytest.mark.parametrize("tbo", ["all", "auto"])
def test_full_capture_records_tbo_graphs(runner: ModelRunner, tbo: str) -> None:
    """Under FULL a bucket of more than two requests is recorded as a TBO graph (`all`: only as
    one; `auto`: beside its plain graph, for the measurement), and a split step replays it. The
    recording's forward runs here on CPU with a logging segment backend."""
    from test_region_graph_cpu import FakeBackend

    from atomrt.graphs.region_graph import ReqGraph
    from atomrt.runtime.config import CompilationConfig
    from atomrt.workers.runner.graph_runner import GraphRunner

    config = replace(
        runner.config,
        compilation_config=CompilationConfig(
            cudagraph_mode="FULL", cudagraph_capture_sizes=[1, 2, 4]
        ),
        parallel_config=ParallelConfig(enable_tbo=tbo),
    )
    graphs = GraphRunner(config, enabled=True)
    log: list = []
    graphs.req_graph, graphs.tbo_graph = ReqGraph(FakeBackend(log)), ReqGraph(FakeBackend(log))
    for bs in (4, 2, 1):
        graphs._capture_one(runner, bs, max_q_len=1)
    plain = [(1, 0), (2, 0)] + ([(4, 0)] if tbo == "auto" else [])
    assert graphs.req_graph.keys() == plain and graphs.tbo_graph.keys() == [(4, 0)]
    assert graphs.captured_buckets(runner.model).tbo_req_keys == ((4, 0),)
    split = ForwardDecision(
        ForwardKind.REQ_GRAPH, 4, 4, False, req_key=(4, 0), ubatch_split_bs=2, ubatch_split_tokens=2
    )
    segment = graphs.tbo_graph._recordings[(4, 0)].segments[0]
    log.clear()
    graphs.replay(split)
    assert log == [("replay", segment)]


def test_auto_measures_each_bucket_and_the_driver_follows(caplog) -> None:
    """`enable_tbo: auto` on CPU: at start-up every capture size that splits is measured unsplit and
    split (both eager here), the times and the verdicts are logged, and decode steps split exactly
    in the buckets whose split was faster; the tokens are those without overlap."""
    import logging

    from atomrt import SamplingParams
    from atomrt.runtime.config import CompilationConfig
    from atomrt.runtime.decision import BatchShape
    from atomrt.runtime.entrypoints.llm import LLM

    kwargs = dict(
        load_format="dummy",
        device="cpu",
        enforce_eager=True,
        max_num_seqs=8,
        num_kv_blocks=32,
        compilation_config=CompilationConfig(cudagraph_capture_sizes=[2, 4, 8]),
    )
    prompts = [[5 + i, 9, 17 + 2 * i] for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for tbo in ("none", "auto"):
        with caplog.at_level(logging.INFO, logger="atomrt.runtime.driver.ubatch_policy"):
            llm = LLM("tiny-qwen3-moe", enable_tbo=tbo, **kwargs)
        try:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            tokens[tbo] = [o.outputs[0].token_ids for o in outs]
            policy = llm.engine.forward_mode.ubatch
        finally:
            llm.shutdown()
    assert tokens["auto"] == tokens["none"]
    verdicts = {v.running_bs: v for v in policy.verdicts}
    assert sorted(verdicts) == [4, 8]
    assert all(v.unsplit_ms > 0 and v.split_ms > 0 for v in verdicts.values())
    logged = [
        r.getMessage() for r in caplog.records if "two-batch overlap (auto)" in r.getMessage()
    ]
    assert logged == [f"two-batch overlap (auto): {line}" for line in policy.describe()]
    assert f"{verdicts[4].unsplit_ms:.3f} ms unsplit" in logged[0]
    for seqs, bucket in ((3, 4), (4, 4), (6, 8)):
        decision = llm.engine.forward_mode.decide([BatchShape(seqs, seqs, 1, False)])
        assert (decision.ubatch_rows is not None) == verdicts[bucket].splits

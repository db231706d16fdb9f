"""ModelRunner on CPU: static buffers are filled by slicing, padding rows zeroed, padded slots -1,
padded sequences empty, and the metadata are views of the static buffers (what graphs recorded)."""

import numpy as np
import pytest
import torch
from executor_harness import build_tiny_llama
from kernel_device import DEVICE

from atomrt.runtime.config import Config, SchedulerConfig
from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.model_runner import ModelRunner, resolve_device


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    config = Config(
        model=str(folder),
        device="cpu",
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
    )
    r = ModelRunner(config, resolve_device(config))
    r.allocate_kv_cache(32)
    return r


def _inputs(q_lens: list[int], computed: list[int], block_size: int) -> StepInputs:
    bs = len(q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_of_row = np.repeat(np.arange(bs), q_lens)
    positions = np.asarray(computed)[seq_of_row] + np.arange(cu[-1]) - cu[:-1][seq_of_row]
    tables = np.full((bs, 4), -1, dtype=np.int32)
    for i in range(bs):
        num_blocks = 1 + (computed[i] + q_lens[i] - 1) // block_size
        tables[i, :num_blocks] = np.arange(1 + i * 4, 1 + i * 4 + num_blocks)
    slots = (
        tables[seq_of_row, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    return StepInputs(
        seq_ids=np.arange(bs, dtype=np.int64),
        input_ids=np.arange(1, cu[-1] + 1, dtype=np.int64),
        positions=positions.astype(np.int64),
        slot_mapping=slots,
        cu_seqlens_q=cu,
        context_lens=(np.asarray(computed) + np.asarray(q_lens)).astype(np.int32),
        block_tables=tables,
        sample_seq_idx=np.arange(bs, dtype=np.int64),
        sample_rows=cu[1:].astype(np.int64) - 1,
    )


def test_padded_request_bucket_fills_static_buffers(runner: ModelRunner) -> None:
    fv = runner.buffers.forward_vars
    # A large eager step first leaves stale values that padding must overwrite.
    runner.buffers.prepare(
        _inputs([5, 7, 3], [0, 0, 0], runner.shape.block_size),
        ForwardDecision(ForwardKind.EAGER, 3, 15, True),
    )
    inputs = _inputs([1, 1, 1], [5, 7, 3], runner.shape.block_size)
    decision = ForwardDecision(
        ForwardKind.REQ_GRAPH, running_bs=8, running_tokens=8, is_prefill=False, req_key=(8, 0)
    )
    md, ctx = runner.buffers.prepare(inputs, decision)
    assert fv["input_ids"][:3].tolist() == [1, 2, 3] and fv["input_ids"][3:8].tolist() == [0] * 5
    assert fv["positions"][:3].tolist() == [5, 7, 3] and fv["positions"][3:8].tolist() == [0] * 5
    assert fv["slot_mapping"][:3].tolist() == inputs.slot_mapping.tolist()
    assert fv["slot_mapping"][3:8].tolist() == [-1] * 5
    assert fv["cu_seqlens_q"][:9].tolist() == [
        0,
        1,
        2,
        3,
        3,
        3,
        3,
        3,
        3,
    ]  # padded sequences: no rows
    assert fv["context_lens"][:8].tolist() == [6, 8, 4, 0, 0, 0, 0, 0]
    assert (fv["block_tables"][3:8] == -1).all()
    assert fv["block_tables"][0, :2].tolist() == inputs.block_tables[0, :2].tolist()
    # The metadata are views of the static buffers, sized by the bucket.
    assert (
        md.slot_mapping.data_ptr() == fv["slot_mapping"].data_ptr()
        and md.slot_mapping.shape[0] == 8
    )
    assert md.block_tables.shape[0] == 8 and md.cu_seqlens_q.shape[0] == 9
    assert md.graph_safe and md.num_seqs == 8 and md.num_tokens == 3
    assert (
        ctx.running_bs == 8
        and ctx.running_tokens == 8
        and ctx.batch_size == 3
        and not ctx.is_prefill
    )


def test_token_bucket_pads_rows_not_sequences(runner: ModelRunner) -> None:
    inputs = _inputs([4, 2], [0, 3], runner.shape.block_size)
    decision = ForwardDecision(
        ForwardKind.TOKEN_GRAPH, running_bs=2, running_tokens=16, is_prefill=True, token_bucket=16
    )
    md, ctx = runner.buffers.prepare(inputs, decision)
    assert md.num_seqs == 2 and md.cu_seqlens_q.tolist() == [0, 4, 6]
    assert md.slot_mapping.shape[0] == 16 and md.slot_mapping[6:].tolist() == [-1] * 10
    assert not md.graph_safe and md.cu_seqlens_q_cpu == [0, 4, 6] and md.context_lens_cpu == [4, 5]
    assert ctx.running_tokens == 16 and ctx.is_prefill


def test_eager_padded_rows_do_not_change_real_logits(runner: ModelRunner) -> None:
    """DP padding runs extra rows eagerly; the real rows' logits are those of the unpadded step."""
    from atomrt.runtime.forward_context import set_forward_context

    def logits(decision: ForwardDecision):
        inputs = _inputs([3, 2], [0, 0], runner.shape.block_size)
        md, ctx = runner.buffers.prepare(inputs, decision)
        with set_forward_context(
            md,
            runner.config,
            ctx,
            no_compile_layers=runner.attn_layers,
            kv_cache_data=runner.kv_cache,
        ):
            out = runner.run_model(
                runner.buffers.forward_vars["input_ids"][: ctx.running_tokens],
                decision,
                runner.buffers.forward_vars["logits_indices"][:0].new_tensor([2, 4]),
            )
        return out.logits

    plain = logits(ForwardDecision(ForwardKind.EAGER, 2, 5, True))
    padded = logits(ForwardDecision(ForwardKind.EAGER, 2, 12, True, dp_num_tokens=(5, 12)))
    assert (plain - padded).abs().max().item() <= 1e-5


def test_token_graph_records_kv_write_inline_and_breaks_only_at_attention(
    runner: ModelRunner,
) -> None:
    """Recorded with a logging backend: one eager call per layer, each the attention (`_attend`);
    the KV write, whose launch the row count fixes, stays inside the segments."""
    from test_region_graph_cpu import FakeBackend

    from atomrt.graphs.markers import token_graph_of
    from atomrt.runtime.forward_context import set_forward_context

    unit = runner.model.model
    log: list = []
    graph = token_graph_of(unit, backend=FakeBackend(log))
    inputs = _inputs([1, 1, 1, 1], [2, 3, 1, 5], runner.shape.block_size)
    decision = ForwardDecision(
        ForwardKind.TOKEN_GRAPH, running_bs=4, running_tokens=4, is_prefill=False, token_bucket=4
    )
    md, ctx = runner.buffers.prepare(inputs, decision)
    with set_forward_context(
        md,
        runner.config,
        ctx,
        no_compile_layers=runner.attn_layers,
        kv_cache_data=runner.kv_cache,
        tr_graph="record",
    ):
        runner.model(
            runner.buffers.forward_vars["input_ids"][:4],
            runner.buffers.forward_vars["positions"][:4],
        )
    num_layers = len(runner.attn_layers)
    assert graph.num_segments(4, "decode") == num_layers + 1
    rec = graph._recordings[(4, None)]
    assert [c.fn.__name__ for c in rec.eager_calls] == ["_attend"] * num_layers
    # The step's k/v went into the cache during the recording's eager pass (written inline).
    slot = int(inputs.slot_mapping[0])
    k_cache = runner.kv_cache["layers.0"].k_cache.reshape(
        -1, *runner.kv_cache["layers.0"].k_cache.shape[2:]
    )
    assert k_cache[slot].abs().sum().item() > 0


@pytest.mark.skipif(
    DEVICE != "cpu",
    reason="unpacks CPU buffers with the kernel, which only Triton's interpreter can launch; on "
    "CUDA the GPU tier's request-graph steps up to the packed bucket stage packed",
)
def test_packed_step_unpacks_to_what_the_per_buffer_fill_writes(runner: ModelRunner) -> None:
    """A request-graph step staged packed (one copy, unpacked by one kernel at the graph's head,
    here through Triton's interpreter) leaves the static buffers as the per-buffer copies do,
    padding included, over stale values; of the block tables only the step's live width travels,
    and the columns past it keep what they held (no kernel reads them)."""
    from atomrt.workers.runner.step_buffers import PackedStep

    fv = runner.buffers.forward_vars
    inputs = _inputs([1, 1, 1], [5, 7, 3], runner.shape.block_size)
    inputs.block_tables = inputs.block_tables[
        :, :2
    ]  # the live width, as SeqMirrors.build gathers it
    small = _inputs([1, 1], [2, 9], runner.shape.block_size)
    small.block_tables = small.block_tables[:, :3]
    decision = ForwardDecision(
        ForwardKind.REQ_GRAPH, running_bs=8, running_tokens=8, is_prefill=False, req_key=(8, 0)
    )
    stale = _inputs([5, 7, 3], [0, 0, 0], runner.shape.block_size)
    runner.buffers.prepare(stale, ForwardDecision(ForwardKind.EAGER, 3, 15, True))
    runner.buffers.prepare(inputs, decision)  # on CPU: the per-buffer path
    expected = {k: v.clone() for k, v in fv.items()}
    packed = PackedStep(
        max_seqs=8, max_rows=8, max_blocks=runner.shape.max_blocks_per_seq, device=runner.device
    )
    for bs in (8, 4, 8):  # a smaller bucket between: layouts are per bucket, the buffer is shared
        runner.buffers.prepare(stale, ForwardDecision(ForwardKind.EAGER, 3, 15, True))
        before = fv["block_tables"].clone()
        step = inputs if bs == 8 else small
        packed.stage(step, bs, bs)
        packed.unpack(fv, bs, bs)
    for name in ("input_ids", "positions", "slot_mapping"):
        assert fv[name][:8].tolist() == expected[name][:8].tolist(), name
    assert fv["cu_seqlens_q"][:9].tolist() == expected["cu_seqlens_q"][:9].tolist()
    assert fv["context_lens"][:8].tolist() == expected["context_lens"][:8].tolist()
    assert fv["block_tables"][:8, :2].tolist() == expected["block_tables"][:8, :2].tolist()
    assert (
        fv["block_tables"][:, 2:].tolist() == before[:, 2:].tolist()
    )  # past the live width: untouched
    assert fv["block_tables"][8:].tolist() == before[8:].tolist()  # past the bucket: untouched
    with pytest.raises(ValueError, match="exceeds"):
        packed.stage(inputs, 16, 16)
    wide = _inputs([1], [0], runner.shape.block_size)
    wide.block_tables = np.zeros((1, runner.shape.max_blocks_per_seq + 1), dtype=np.int32)
    with pytest.raises(ValueError, match="max_blocks"):
        packed.stage(wide, 1, 1)


def test_packed_step_gathers_pending_tokens_in_its_unpack(tmp_path_factory) -> None:
    """Async scheduling, packed: the unpack kernel gives each row the token the eager gather does:
    its own staged id, the previous step's sample (token_src >= TokenPool.prev_base), or for a padding
    row staged slot 0."""
    from atomrt.workers.runner.step_buffers import PackedStep

    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny_packed_async") / "model")
    config = Config(
        model=str(folder),
        device="cpu",
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=64, async_scheduling=True
        ),
    )
    r = ModelRunner(config, resolve_device(config))
    r.allocate_kv_cache(32)
    fv, base = r.buffers.forward_vars, r.tokens.prev_base
    fv["prev_tokens"][:3] = torch.tensor([71, 72, 73])
    inputs = _inputs([1, 1, 1], [3, 3, 1], r.shape.block_size)
    inputs.input_ids = np.array([5, 0, 0], dtype=np.int64)  # rows 1 and 2 are pending (staged id 0)
    inputs.token_src = np.array([0, base + 2, base + 0], dtype=np.int64)
    packed = PackedStep(
        max_seqs=8,
        max_rows=8,
        max_blocks=r.shape.max_blocks_per_seq,
        device=r.device,
        prev_token_base=base,
    )
    fv["input_ids"][:8] = -5  # stale
    packed.stage(inputs, 4, 4)
    packed.unpack(fv, 4, 4)
    assert fv["input_ids"][:4].tolist() == [5, 73, 71, 5]  # padding row 3 reads staged slot 0
    fv["input_ids"][:8] = -5
    r.buffers.prepare(
        inputs, ForwardDecision(ForwardKind.EAGER, 4, 4, False)
    )  # the per-buffer path, then its gather
    r.buffers.gather_input_ids(4)
    assert fv["input_ids"][:4].tolist() == [5, 73, 71, 5]


def test_async_pending_rows_and_padding_rows_gather_valid_tokens(tmp_path_factory) -> None:
    """Async scheduling: decode rows whose token is pending read the previous step's sample from the
    token pool; padding rows of the bucket read staged slot 0, which holds a valid id (a pending
    row's staged id is 0, never PENDING_TOKEN)."""
    from atomrt.distributed.messages import PENDING_TOKEN, NewRequest, RankBatch
    from atomrt.workers.runner.input_batch import SeqMirrors

    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny_async") / "model")
    config = Config(
        model=str(folder),
        device="cpu",
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=64, async_scheduling=True
        ),
    )
    r = ModelRunner(config, resolve_device(config))
    r.allocate_kv_cache(32)
    mirrors = SeqMirrors(r.shape.block_size)
    mirrors.apply(
        RankBatch(
            new_requests=[NewRequest(s, np.array([1, 2, 3], dtype=np.int32)) for s in (10, 11, 12)],
            new_block_seq_ids=np.array([10, 11, 12], dtype=np.int64),
            new_block_starts=np.zeros(3, dtype=np.int32),
            num_new_blocks=np.ones(3, dtype=np.int32),
            new_block_ids=np.array([1, 2, 3], dtype=np.int32),
        )
    )
    r.buffers.forward_vars["prev_tokens"][:3] = torch.tensor(
        [71, 72, 73]
    )  # the previous step sampled 12, 10, 11
    batch = RankBatch(
        seq_ids=np.array([10, 11, 12], dtype=np.int64),
        num_new_tokens=np.array([1, 1, 2], dtype=np.int32),
        num_computed_tokens=np.array([3, 3, 1], dtype=np.int32),
        input_ids=np.array([PENDING_TOKEN, PENDING_TOKEN, 2, 3], dtype=np.int32),
        sample_mask=np.ones(3, dtype=np.bool_),
    )
    r.tokens.record([12, 10, 11])
    inputs = mirrors.build(batch, r.tokens)
    assert inputs.input_ids.tolist() == [0, 0, 2, 3]
    assert inputs.token_src.tolist() == [r.tokens.prev_base + 1, r.tokens.prev_base + 2, 2, 3]
    decision = ForwardDecision(
        ForwardKind.REQ_GRAPH, running_bs=8, running_tokens=8, is_prefill=False, req_key=(8, 0)
    )
    r.buffers.prepare(inputs, decision)
    r.buffers.gather_input_ids(8)
    assert r.buffers.forward_vars["input_ids"][:8].tolist() == [72, 73, 2, 3, 0, 0, 0, 0]
    with pytest.raises(RuntimeError, match="sampled nothing"):
        r.tokens.record([12])
        mirrors.build(batch, r.tokens)


class _RecordedRequestGraph:
    """Stands in for a GraphRunner's request graphs on CPU (no CUDA graphs): replay returns fixed
    outputs, as a recording returns its outputs' addresses, [rows, vocab] logits and their argmax."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        self.logits, self.tokens, self.replays = logits, tokens, 0

    def replay(self, decision):
        self.replays += 1
        return self.logits, self.tokens


def test_plain_greedy_request_graph_step_takes_the_replayed_argmax(runner: ModelRunner) -> None:
    """A decode step replayed from a request graph: plain greedy sampling takes the graph's own
    argmax rows (no sampler); any other sampling (here a temperature) samples from the replayed
    logits; an eager step neither uses nor returns replayed tokens."""
    from atomrt.runtime.sampling_params import SamplingParams
    from atomrt.workers.runner.sampler import SamplingTensors

    vocab = runner.arch.vocab_size
    logits = torch.full((8, vocab), -1.0)
    logits[torch.arange(8), torch.arange(8) + 3] = 5.0  # argmax of row i: i + 3
    recorded = torch.tensor(
        [40, 41, 42, 43, 44, 45, 46, 47]
    )  # differs from it: where tokens come from shows
    saved = runner.graphs
    runner.graphs = _RecordedRequestGraph(logits, recorded)
    try:
        decision = ForwardDecision(
            ForwardKind.REQ_GRAPH, running_bs=8, running_tokens=8, is_prefill=False, req_key=(8, 0)
        )
        inputs = _inputs([1, 1, 1], [5, 7, 3], runner.shape.block_size)
        greedy = SamplingTensors.from_params(
            [SamplingParams(temperature=0)] * 3, [[1]] * 3, [[]] * 3, vocab
        )
        assert greedy.is_plain_greedy
        assert runner.execute(inputs, decision, greedy).sampled_token_ids.tolist() == [40, 41, 42]
        hot = SamplingTensors.from_params(
            [SamplingParams(temperature=1e-3, seed=1)] * 3, [[1]] * 3, [[]] * 3, vocab
        )
        assert not hot.is_plain_greedy
        assert runner.execute(inputs, decision, hot).sampled_token_ids.tolist() == [3, 4, 5]
        assert runner.graphs.replays == 2
        eager = ForwardDecision(ForwardKind.EAGER, running_bs=3, running_tokens=3, is_prefill=False)
        assert runner.execute(inputs, eager, greedy).sampled_token_ids.tolist() != [40, 41, 42]
    finally:
        runner.graphs = saved


def test_runner_state_has_owners(runner) -> None:
    """The runner holds at most 17 attributes: step state lives in its owners (buffers, graphs,
    token pool, readbacks, speculator, microbatch runner, a bench's expert tally), not on the
    runner."""
    names = sorted(vars(runner))
    assert len(names) <= 17, " ".join(names)
    assert runner.rank == 0


def test_token_bucket_with_region_graphs_stages_the_request_bucket(runner: ModelRunner) -> None:
    """A TR_HYBRID decode step whose bucket replays with its region graphs (`req_key` on a
    TOKEN_GRAPH decision) is staged as that request bucket's: sequences padded, graph-safe."""
    inputs = _inputs([1, 1, 1], [5, 7, 3], runner.shape.block_size)
    decision = ForwardDecision(
        ForwardKind.TOKEN_GRAPH,
        running_bs=8,
        running_tokens=8,
        is_prefill=False,
        req_key=(8, 0),
        token_bucket=8,
    )
    md, ctx = runner.buffers.prepare(inputs, decision)
    fv = runner.buffers.forward_vars
    assert md.graph_safe and md.num_seqs == 8 and md.num_tokens == 3
    assert md.cu_seqlens_q.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    assert fv["context_lens"][:8].tolist() == [6, 8, 4, 0, 0, 0, 0, 0]
    assert (fv["block_tables"][3:8] == -1).all() and md.slot_mapping[3:].tolist() == [-1] * 5
    assert decision.tr_graph == "replay" and decision.tr_req_key == (8, 0)
    assert ctx.running_bs == 8 and ctx.running_tokens == 8

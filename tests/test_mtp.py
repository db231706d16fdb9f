"""MTP speculative decoding (`speculative_config={"method": "mtp", ...}`) on a tiny DeepSeek-V3
made by transformers with a multi-token-prediction layer added to its folder (mtp_harness.py), CPU:

- the MTP layer's forward equals the formula written out in float64 (transformers' decoder layer
  as its block); a checkpoint whose copy of the embedding is not the target's is refused;
- every draft the engine proposes equals the formula's (float64, its k passes chained on the
  sequence as it stands after the step), and the greedy tokens equal those without speculation:
  k = 1 and 3, synchronous and async, chunked prefill, prefix caching over shared prefixes (the
  last hit block recomputed), preemption; through the mp executor at TP = 2 and DP = 2;
- a layer built to predict the target (`predicting_mtp`): position 0 accepted more than 80% of the
  time and fewer engine steps than without speculation; the same layer with its hidden-state norm
  100x too large: position 0 accepted under 30% of the time, which the per-position figures of
  SpecDecodeStats and /metrics show, and the same tokens;
- capture: the drafter's first pass recorded at each request bucket's rows (bs x (k + 1)) and its
  later passes at each capture size, for k = 1 and 3; replay, and eager passes counted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from mtp_harness import (
    MTPReference,
    build_mtp_folder,
    reference_mtp_hidden,
    reference_mtp_logits,
    save_mtp_layer,
    target_hidden,
)

from atomrt.distributed.messages import CoreOutputs, decode, encode
from atomrt.runtime.config import Config
from atomrt.runtime.driver.engine import LLMEngine
from atomrt.runtime.entrypoints.engine_core import core_stats
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.entrypoints.openai.metrics import ServerMetrics
from atomrt.runtime.forward_context import AttentionMetaData, Context, set_forward_context
from atomrt.runtime.sampling_params import SamplingParams
from atomrt.workers.layers.attention import collect_attention_layers
from atomrt.workers.loading.loader import load_model, load_mtp_layers

SHARED = [5, 9, 14, 2, 77, 31, 8, 150, 66, 4, 12, 90]  # three blocks of 4: prefix-cache hits
PROMPTS = [
    [3, 17, 42, 99, 5, 8, 61],
    SHARED + [7, 3],
    [5, 6, 7, 8] * 4 + [5, 6],
    SHARED + [101, 102, 103],
    [7, 1, 120],
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 10, 16, 8, 6)
]
COMMON = dict(
    device="cpu", enforce_eager=True, num_kv_blocks=64, max_num_seqs=8, worker_timeout_s=90.0
)
MIN_MARGIN = 1e-4  # the reference's drafts must not be near-ties (float32 could round them over)


def _mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def random_layer(tmp_path_factory) -> tuple[Path, MTPReference]:
    folder = tmp_path_factory.mktemp("mtp_random")
    return folder, build_mtp_folder(folder, seed=1)


@pytest.fixture(scope="module")
def reference_tokens(random_layer) -> list[list[int]]:
    return _generate(random_layer[0])[0]


def _generate(folder: Path, prompts=PROMPTS, params=PARAMS, **kwargs):
    llm = LLM(str(folder), **{**COMMON, **kwargs})
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine
    finally:
        llm.shutdown()


# ------------------------------------------------------------------ the layer against the formula


def test_mtp_layer_forward_equals_the_float64_formula(random_layer):
    folder, ref = random_layer
    config = Config(model=str(folder), device="cpu", speculative_config=_mtp(1))
    model = load_model(config, "cpu", torch.float32).model
    mtp = load_mtp_layers(model, config, "cpu", torch.float32).mtp  # the drafter's own
    assert not any(n.startswith("mtp.") for n, _ in model.named_parameters())
    ids = [3, 17, 42, 99, 5, 8, 61, 7, 120, 11, 40, 2]
    r64 = ref.double()
    hidden = target_hidden(r64, ids)[:-1]  # h_t, t = 0..T-2
    nxt, pos = torch.tensor(ids[1:]), torch.arange(len(ids) - 1)
    want = reference_mtp_hidden(r64, hidden, nxt, pos)
    want_logits = reference_mtp_logits(r64, want)
    rows = len(ids) - 1
    md = AttentionMetaData(cu_seqlens_q_cpu=[0, rows], num_seqs=1, num_tokens=rows)
    ctx = Context(positions=pos, is_prefill=True, batch_size=1, running_bs=1, running_tokens=rows)
    layers = {**collect_attention_layers(model), **collect_attention_layers(mtp)}
    assert sorted(layers) == [0, 1, 2, 3]  # the MTP layer's attention is layer num_hidden_layers
    with torch.inference_mode(), set_forward_context(md, config, ctx, no_compile_layers=layers):
        got = mtp(nxt, pos, hidden.float())
        logits = mtp.compute_logits(got)
    assert (got.double() - want).abs().max() < 1e-4  # seen: 1e-6
    assert (logits.double() - want_logits).abs().max() < 1e-4
    assert mtp.layer_for(0) == mtp.layer_for(2) == 0  # one layer, reused


def test_an_mtp_copy_of_the_embedding_must_be_the_targets(random_layer, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    shutil.copytree(random_layer[0], folder)
    tensors = load_file(str(folder / "mtp.safetensors"))
    tensors["model.layers.3.embed_tokens.weight"][5] += 1.0
    save_file(tensors, str(folder / "mtp.safetensors"))
    config = Config(model=str(folder), device="cpu", speculative_config=_mtp(1))
    target = load_model(config, "cpu", torch.float32).model
    with pytest.raises(ValueError, match="model.layers.3.embed_tokens.weight differs"):
        load_mtp_layers(target, config, "cpu", torch.float32)


def test_a_model_without_mtp_layers_is_refused_with_reasons(tmp_path):
    """A model with no MTP layers is refused before launch; a checkpoint whose config promises one
    but holds no tensors of it, when its weights load."""
    from deepseek_harness import build_deepseek_folder
    from executor_harness import build_tiny_llama

    from atomrt.runtime.config import ConfigError

    llama = build_tiny_llama(tmp_path / "llama")
    with pytest.raises(ConfigError, match="has no multi-token-prediction layers"):
        LLM(str(llama), **COMMON, speculative_config=_mtp(1))
    v3 = build_deepseek_folder(tmp_path / "v3", "v3")  # num_nextn_predict_layers: 1, no tensors
    assert json.loads((v3 / "config.json").read_text())["num_nextn_predict_layers"] == 1
    config = Config(model=str(v3), device="cpu", speculative_config=_mtp(1))
    target = load_model(config, "cpu", torch.float32).model
    with pytest.raises(ValueError, match="no tensors of the multi-token-prediction layer"):
        load_mtp_layers(target, config, "cpu", torch.float32)
    with pytest.raises(ValueError, match="no tensors of the multi-token-prediction layer"):
        LLM(str(v3), **COMMON, speculative_config=_mtp(1))  # the drafter's loading, on a worker


# ------------------------------------------------------------------ the engine's drafts


class _Drafts:
    """The drafts each running sequence holds after each step, by its tokens then."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: dict[tuple[int, ...], list[int]] = {}
        post = LLMEngine._postprocess

        def recording(engine, outs, results):
            out = post(engine, outs, results)
            for scheduler in engine.schedulers:
                for seq in scheduler.running:
                    if seq.proposed_at == seq.num_tokens:
                        self.seen[tuple(seq.token_ids)] = list(seq.proposed_drafts)
            return out

        monkeypatch.setattr(LLMEngine, "_postprocess", recording)


def reference_drafts(ref: MTPReference, tokens: list[int], k: int) -> list[int]:
    """The formula's k drafts after `tokens`: pass 0 over every position (h_t, x_{t+1}), its
    output at the last one draft 0; pass j one row further on, with pass j-1's output and draft."""
    hidden = target_hidden(ref, tokens)[:-1]
    nxt, pos = torch.tensor(tokens[1:]), torch.arange(len(tokens) - 1)
    drafts = []
    for _ in range(k):
        o = reference_mtp_hidden(ref, hidden, nxt, pos)
        logits = reference_mtp_logits(ref, o[-1:])[0]
        top = logits.topk(2).values
        assert top[0] - top[1] > MIN_MARGIN, "a near-tie: the reference cannot decide"
        drafts.append(int(logits.argmax()))
        hidden = torch.cat([hidden, o[-1:]])
        nxt = torch.cat([nxt, torch.tensor(drafts[-1:])])
        pos = torch.cat([pos, pos[-1:] + 1])
    return drafts


@pytest.mark.parametrize(
    "k, extra",
    [
        (1, {}),
        (3, dict(async_scheduling=True)),
        (3, dict(max_num_batched_tokens=8, block_size=4)),  # chunked prefill, cache hits
        (3, dict(num_kv_blocks=14, block_size=4, enable_prefix_caching=False)),  # preemption
        pytest.param(1, dict(executor="mp", tensor_parallel_size=2), id="mp-tp2"),
        pytest.param(3, dict(executor="mp", data_parallel_size=2), id="mp-dp2"),
    ],
)
def test_every_draft_is_the_formulas_and_tokens_do_not_change(
    random_layer, reference_tokens, monkeypatch, k, extra
):
    folder, ref = random_layer
    drafts = _Drafts(monkeypatch)
    tokens, engine = _generate(folder, speculative_config=_mtp(k), **extra)
    assert tokens == reference_tokens
    stats = engine.stats.spec_decode
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= k * stats.num_drafts - 2 * k
    assert len(stats.accepted_per_position) == k and stats.num_eager_draft_passes == 0
    if extra.get("num_kv_blocks") == 14:
        assert engine.schedulers[0].num_preemptions > 0
    if extra.get("block_size") == 4 and "num_kv_blocks" not in extra:
        assert engine.schedulers[0].block_manager.num_prefix_hit_tokens > 0
    assert len(drafts.seen) >= 20
    r64 = ref.double()
    for seq_tokens, got in drafts.seen.items():
        assert got == reference_drafts(r64, list(seq_tokens), k), len(seq_tokens)


# ------------------------------------------------------------------ acceptance that means something

RANDOM_PROMPTS = [[(37 * i + 11 * j) % 157 + 2 for j in range(8)] for i in range(8)]
LONG = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def predicting(tmp_path_factory) -> dict[str, Path]:
    """A layer built to predict the target, and the same layer with its hidden-state norm's
    weights 100x too large (a wrongly normalised hidden state swamps its input)."""
    good = tmp_path_factory.mktemp("mtp_predicting")
    ref = build_mtp_folder(good, seed=1, predicting=True)
    bad = tmp_path_factory.mktemp("mtp_bad_hnorm")
    for f in good.iterdir():
        shutil.copy(f, bad / f.name)
    hidden_size = json.loads((good / "config.json").read_text())["hidden_size"]
    save_mtp_layer(bad, ref, hnorm_scale=torch.full((hidden_size,), 100.0))
    return {"good": good, "bad": bad}


def _run(folder: Path, **kwargs):
    return _generate(folder, RANDOM_PROMPTS, LONG, **kwargs)


def _per_position_metric(engine: LLMEngine) -> list[float]:
    """Acceptance per draft position as /metrics exports it (the engine core's stats through the
    wire codec, as they reach the API process): accepted at the position over drafts."""
    stats = decode(encode(CoreOutputs(stats=core_stats(engine)))).stats
    metrics = ServerMetrics("m")
    metrics.engine_stats(stats)
    text = metrics.render().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        values[name] = float(value)
    drafts = values['atomrt:spec_decode_num_drafts_total{model_name="m"}']
    k = engine.speculation.k
    per_pos = 'atomrt:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="%d"}'
    return [values[per_pos % i] / drafts for i in range(k)]


def test_a_layer_that_predicts_the_target_is_accepted_and_its_collapse_shows(predicting):
    plain_tokens, plain = _run(predicting["good"])
    tokens, engine = _run(predicting["good"], speculative_config=_mtp(3))
    assert tokens == plain_tokens
    stats = engine.stats.spec_decode
    rates = stats.acceptance_rate_per_position
    assert rates[0] > 0.8, stats.summary()  # seen: 0.94
    steps, plain_steps = sum(engine.stats.steps.values()), sum(plain.stats.steps.values())
    assert steps < 0.7 * plain_steps, (steps, plain_steps)  # seen: 16 against 32
    assert _per_position_metric(engine) == pytest.approx(rates)
    bad_tokens, bad = _run(predicting["bad"], speculative_config=_mtp(3))
    assert bad_tokens == plain_tokens  # the drafts never change a greedy token
    bad_rates = bad.stats.spec_decode.acceptance_rate_per_position
    assert bad_rates[0] < 0.3, bad.stats.spec_decode.summary()  # seen: 0.12
    assert _per_position_metric(bad) == pytest.approx(bad_rates)
    assert sum(bad.stats.steps.values()) > 0.9 * plain_steps


# ------------------------------------------------------------------ graphs
# Bookkept on CPU with the logging fake segment backend of tests/test_region_graph_cpu.py (real
# recordings: tests/gpu/test_mtp_gpu.py).


@pytest.mark.parametrize("k", [1, 3])
def test_capture_and_replay_keys_follow_the_guide(random_layer, k):
    """`max_q_len = mtp_k + 1`: the target's request buckets are `request_bucket(bs, k + 1) ==
    (bs, k)`; the drafter records its first pass at each of their row counts (bs * (k + 1)) and its
    later passes at each capture size, largest first; a verify step of 3 requests replays bucket
    (4, k) and both drafter recordings of its shape, on every DP rank alike; a missing recording
    runs eagerly and is counted, a step the target ran eagerly is not."""
    from test_region_graph_cpu import FakeBackend

    from atomrt.graphs.buckets import request_bucket
    from atomrt.graphs.draft_graph import DraftGraph
    from atomrt.runtime.config import CompilationConfig
    from atomrt.runtime.decision import BatchShape, CapturedBuckets, ForwardKind
    from atomrt.runtime.driver.forward_mode import ForwardMode
    from atomrt.workers.runner.input_batch import dummy_decode_inputs
    from atomrt.workers.runner.model_runner import ModelRunner
    from atomrt.workers.spec_decode.recordings import DraftRecordings

    sizes = [1, 2, 4]
    config = Config(
        model=str(random_layer[0]),
        device="cpu",
        speculative_config=_mtp(k),
        compilation_config=CompilationConfig(cudagraph_capture_sizes=sizes),
    )
    assert config.max_q_len == k + 1 and config.capture_q_lens == (k + 1,)
    assert [request_bucket(bs, config.max_q_len) for bs in sizes] == [(bs, k) for bs in sizes]
    runner = ModelRunner(config, torch.device("cpu"))
    runner.allocate_kv_cache(16)
    drafter = runner.spec.proposer.drafter
    assert drafter.row_layers == ([0] if k > 1 else [])
    recordings = drafter.recordings = DraftRecordings(True, [])
    recordings.graphs = {
        key: DraftGraph(backend=FakeBackend([])) for key in ["step", *drafter.row_layers]
    }
    drafter.capture(runner, sizes)
    step_graph = recordings.graphs["step"]
    step_rows = [bs * (k + 1) for bs in sizes]
    assert step_graph.captured_sizes("decode") == step_rows
    assert [n for n, _ in step_graph._recordings] == step_rows[::-1]  # largest first
    assert step_graph.num_segments(step_rows[0], "decode") == 2  # broken at its attention
    for layer in drafter.row_layers:
        assert recordings.graphs[layer].captured_sizes("decode") == sizes

    captured = CapturedBuckets(req_keys=tuple((bs, k) for bs in sizes))
    mode = ForwardMode(config, captured, k)
    shapes = [BatchShape(3, 3 * (k + 1), k + 1, False), BatchShape(1, k + 1, k + 1, False)]
    decision = mode.decide(shapes)  # two DP ranks: one decision
    assert decision.kind is ForwardKind.REQ_GRAPH and decision.req_key == (4, k)
    assert (decision.running_tokens, "decode") in step_graph
    row_counts = set()
    for shape in shapes:  # each DP rank stages its own batch: its later passes run the same rows
        drafter.stage(dummy_decode_inputs(shape.num_seqs, k + 1), decision)
        row_counts.add(drafter._step.row_bs)
    assert row_counts == ({4} if k > 1 else {0})

    rows = 3 * (k + 1)  # never recorded
    assert drafter._replays_step(decision.running_tokens, decision)
    assert recordings.num_eager_passes == 0
    assert not drafter._replays_step(rows, decision) and recordings.num_eager_passes == 1
    eager = type(decision)(ForwardKind.EAGER, 3, rows, False, k)
    assert not drafter._replays_step(rows, eager)
    assert recordings.num_eager_passes == 1  # the target ran eagerly too: not counted
    for layer in drafter.row_layers:
        assert drafter._replays_rows(4, layer) and not drafter._replays_rows(8, layer)
        assert recordings.num_eager_passes == 1  # 8 rows: beyond the ladder, eager as the target
        del recordings.graphs[layer]._recordings[(4, None)]  # a bucket lost: counted
        assert not drafter._replays_rows(4, layer) and recordings.num_eager_passes == 2
    counted = recordings.num_eager_passes  # what the step's result reports, then from 0
    assert runner.spec.take_eager_passes() == counted and recordings.num_eager_passes == 0


@pytest.mark.slow
def test_served_metrics_show_acceptance_per_position(predicting, tmp_path):
    """`atomrt serve --speculative-config` with the predicting layer, over real HTTP with the
    official client: /metrics carries vLLM's speculative-decoding counters, per position."""
    from executor_harness import VOCAB, build_tiny_llama
    from test_server import CPU_FLAGS, Server

    words = build_tiny_llama(tmp_path / "words")  # its tokenizer: token i is the word "w<i>"
    for f in words.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, predicting["good"] / f.name)
    spec = json.dumps(_mtp(3))
    model = ["--model", str(predicting["good"]), "--served-model-name", "mtp"]
    server = Server([*model, *CPU_FLAGS, "--speculative-config", spec])
    try:
        client = server.client()
        for prompt in RANDOM_PROMPTS:
            out = client.completions.create(
                model="mtp",
                prompt=" ".join(f"w{t % VOCAB}" for t in prompt),
                max_tokens=24,
                temperature=0,
            )
            assert out.usage.completion_tokens > 0
        drafts = server.metric("atomrt:spec_decode_num_drafts_total")
        at = 'atomrt:spec_decode_num_accepted_tokens_per_pos_total{model_name="mtp",position="%d"}'
        per_pos = [server.metric(at % i) / drafts for i in range(3)]
        assert drafts > 0 and per_pos[0] > 0.8 and per_pos[0] >= per_pos[1] >= per_pos[2]
        accepted = server.metric("atomrt:spec_decode_num_accepted_tokens_total")
        assert accepted <= server.metric("atomrt:spec_decode_num_draft_tokens_total")
    finally:
        assert server.stop() == 0

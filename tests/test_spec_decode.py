"""Speculative decoding through the engine, on CPU with tiny random Llamas (same vocabulary).

- Greedy output with speculation is token-for-token the output without it, for n-gram drafts, a
  draft model that is a different (weaker) model, and one that is the target itself (every draft
  accepted), synchronously and with async scheduling, in a mixed batch (prompt lengths, EOS stops
  and length limits, a penalised and a logprobs request that decode without drafts beside
  speculating ones, n > 1 samples) and under a KV pool small enough to preempt.
- Seeded sampled requests give the tokens they give without speculation, alone and beside other
  requests, with n-gram drafts and a draft model, synchronously and with async scheduling; so do
  the samples of a seeded n > 1 request (sample i is the request seeded `seed + i`).
- Sampled requests drafting with the target itself accept every draft (q is each draft's own).
- On repetitive text the n-gram proposer takes fewer engine steps than tokens produced, and the
  acceptance figures reach EngineStats.
- Through the mp executor: TP=2 (the drafter on rank 0, its drafts broadcast) and DP=2.
- The draft model's DraftGraphs: capture records every capture size, largest first, broken at the
  attention eager regions; a pass replays its padded bucket; a pass the ladder holds that finds no
  recording (or a drafter never captured while graphs are on) runs eagerly and is counted; a pass
  beyond the ladder runs eagerly as the target's steps do, uncounted.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from executor_harness import COMMON, PROMPTS, build_target_and_draft
from test_region_graph_cpu import FakeBackend

from atomrt.graphs.draft_graph import DraftGraph
from atomrt.graphs.region_graph import TokenGraph
from atomrt.runtime.config import Config, ConfigError, SchedulerConfig, SpeculativeConfig
from atomrt.runtime.driver.speculation import SpecPolicy
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import SamplingParams
from atomrt.workers.runner.step_buffers import RunnerShape
from atomrt.workers.spec_decode.draft_model import DraftModel

REPETITIVE = [5, 6, 7, 8] * 5 + [5, 6]
MIXED_PROMPTS = PROMPTS + [REPETITIVE, [9, 9, 9]]


def _mixed_params() -> list[SamplingParams]:
    greedy = dict(temperature=0.0)
    return [
        SamplingParams(**greedy, max_tokens=20, ignore_eos=True),
        SamplingParams(**greedy, max_tokens=7, ignore_eos=True),
        SamplingParams(**greedy, max_tokens=24),  # may stop at EOS
        SamplingParams(**greedy, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(**greedy, max_tokens=24, ignore_eos=True, n=2),
        SamplingParams(**greedy, max_tokens=10, ignore_eos=True, logprobs=2),
    ]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    return build_target_and_draft(tmp_path_factory.mktemp("spec_decode"))


def _spec(kind: str, models: tuple[Path, Path], k: int = 3) -> dict:
    if kind == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        }
    model = models[1] if kind == "draft" else models[0]
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def _generate(model: Path, prompts, params, **kwargs):
    llm = LLM(str(model), **{**COMMON, **kwargs})
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, llm.engine
    finally:
        llm.shutdown()


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(models):
    outs, _ = _generate(models[0], MIXED_PROMPTS, _mixed_params())
    return outs


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "kind, async_scheduling",
    [
        ("ngram", False),
        ("ngram", True),
        ("draft", False),
        pytest.param("draft", True, marks=SLOW),
        pytest.param("self_draft", False, marks=SLOW),
        ("self_draft", True),
    ],
)
def test_greedy_with_speculation_is_greedy_without(models, reference, kind, async_scheduling):
    outs, engine = _generate(
        models[0],
        MIXED_PROMPTS,
        _mixed_params(),
        speculative_config=_spec(kind, models),
        async_scheduling=async_scheduling,
    )
    assert _tokens(outs) == _tokens(reference)
    assert [[c.finish_reason for c in o.outputs] for o in outs] == [
        [c.finish_reason for c in o.outputs] for o in reference
    ]
    for got, want in zip(outs[-1].outputs[0].logprobs, reference[-1].outputs[0].logprobs):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
    stats = engine.stats.spec_decode
    assert stats.num_drafts > 0 and stats.num_eager_draft_passes == 0
    if kind == "self_draft":  # the target drafting for itself: every draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.mean_acceptance_length == 4.0


@pytest.mark.parametrize("kind", [pytest.param("ngram", marks=SLOW), "self_draft"])
def test_greedy_identity_under_preemption(models, reference, kind):
    prompts, params = MIXED_PROMPTS[:5], _mixed_params()[:5]
    outs, engine = _generate(
        models[0],
        prompts,
        params,
        speculative_config=_spec(kind, models),
        async_scheduling=True,
        num_kv_blocks=12,
        block_size=4,
        enable_prefix_caching=False,
    )
    assert engine.schedulers[0].num_preemptions > 0
    assert _tokens(outs) == _tokens(reference[:5])


# Seeded sampled requests: a sharp one (n-gram drafts get accepted) and a loose one; n=3 samples
# seeded 7 + i.
SEEDED = [
    SamplingParams(temperature=0.1, seed=7, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=8, max_tokens=16, ignore_eos=True),
]
SAMPLES = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def seeded_plain(models):
    """Without speculation, each alone: the seeded requests on REPETITIVE, and n=1 requests seeded
    like SAMPLES' samples on PROMPTS[1]."""
    llm = LLM(str(models[0]), **COMMON)
    try:
        run = lambda prompt, params: llm.generate([prompt], params, use_tqdm=False)[0]  # noqa: E731
        seeded = [run(REPETITIVE, p).outputs[0].token_ids for p in SEEDED]
        samples = [run(PROMPTS[1], SAMPLES.for_sample(i)).outputs[0].token_ids for i in range(3)]
    finally:
        llm.shutdown()
    return seeded, samples


@pytest.mark.parametrize(
    "kind, async_scheduling",
    [
        ("ngram", False),
        ("draft", True),
        pytest.param("ngram", True, marks=SLOW),
        pytest.param("draft", False, marks=SLOW),
    ],
)
def test_seeded_sampling_is_sampling_without_speculation(
    models, seeded_plain, kind, async_scheduling
):
    """A seeded request gives the tokens it gives without speculation, alone or in a batch; sample
    i of an n=3 request seeded s gives an n=1 request's seeded s + i."""
    want, want_samples = seeded_plain
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    llm = LLM(
        str(models[0]),
        **COMMON,
        speculative_config=_spec(kind, models),
        async_scheduling=async_scheduling,
    )
    try:
        alone = [
            llm.generate([REPETITIVE], p, use_tqdm=False)[0].outputs[0].token_ids for p in SEEDED
        ]
        crowd = llm.generate(
            [PROMPTS[0], REPETITIVE, PROMPTS[1], REPETITIVE, PROMPTS[2]],
            [other, SEEDED[0], SAMPLES, SEEDED[1], other],
            use_tqdm=False,
        )
        stats = llm.engine.stats.spec_decode
    finally:
        llm.shutdown()
    assert alone == want
    assert [crowd[1].outputs[0].token_ids, crowd[3].outputs[0].token_ids] == want
    assert [c.token_ids for c in crowd[2].outputs] == want_samples
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_sampled_drafts_of_the_target_itself_are_all_accepted(models):
    """With the target as its own draft model, q equals p (up to rounding): rejection sampling
    accepts every draft only if each draft's q is its own row's, in the rejection sampler's order."""
    params = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True)
    outs, engine = _generate(
        models[0], PROMPTS[:3], params, speculative_config=_spec("self_draft", models)
    )
    stats = engine.stats.spec_decode
    assert stats.num_draft_tokens > 20
    assert stats.num_accepted_tokens >= 0.99 * stats.num_draft_tokens


def test_ngram_takes_fewer_steps_than_tokens_on_repetitive_text(models):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs, engine = _generate(
        models[0], [REPETITIVE], params, speculative_config=_spec("ngram", models, k=4)
    )
    num_steps = sum(engine.stats.steps.values())
    assert len(outs[0].outputs[0].token_ids) == 40
    assert num_steps < 40, num_steps
    stats = engine.stats.spec_decode
    assert stats.mean_acceptance_length > 1.5
    assert len(stats.acceptance_rate_per_position) == 4
    assert stats.acceptance_rate_per_position[0] >= stats.acceptance_rate_per_position[-1]


@pytest.mark.parametrize(
    "layout, kind",
    [
        (dict(tensor_parallel_size=2), "self_draft"),
        pytest.param(dict(data_parallel_size=2), "ngram", marks=SLOW),
    ],
    ids=["mp-tp2-draft", "mp-dp2-ngram"],
)
def test_mp_executor_layouts(models, reference, layout, kind):
    outs, engine = _generate(
        models[0],
        MIXED_PROMPTS[3:],
        _mixed_params()[3:],
        executor="mp",
        async_scheduling=True,
        speculative_config=_spec(kind, models),
        **layout,
    )
    assert _tokens(outs) == _tokens(reference[3:])
    assert engine.stats.spec_decode.num_accepted_tokens > 0


# ------------------------------------------------------------------ adaptive speculation


def test_spec_policy_backs_off_while_speculation_loses_and_keeps_it_while_it_wins():
    with pytest.raises(ConfigError, match="adaptive"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "adaptive": 1})
    # capture records plain decode buckets too where the policy may pause speculation
    ngram = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    fixed = SpeculativeConfig.parse({**vars(ngram), "adaptive": False})
    on = SchedulerConfig(async_scheduling=True)
    assert Config(speculative_config=ngram, scheduler_config=on).capture_q_lens == (4, 1)
    assert Config(speculative_config=ngram).capture_q_lens == (4,)  # synchronous: always drafts
    assert Config(speculative_config=fixed, scheduler_config=on).capture_q_lens == (4,)
    assert Config().capture_q_lens == (1,)
    p = SpecPolicy()
    now = 0.0

    def run(steps: int, tokens: int, seconds: float) -> None:
        nonlocal now
        for _ in range(steps):
            now += seconds
            p.step_done(tokens, now)

    assert p.speculating and p.left == SpecPolicy.PROBE
    # speculation: 2 tokens per 4 ms step (500/s); plain: 1 token per 1 ms step (1000/s)
    plain_lens = []
    for _ in range(7):
        assert p.speculating
        run(p.left, 2, 0.004)
        assert not p.speculating
        plain_lens.append(p.left)
        run(p.left, 1, 0.001)
    assert p.spec_rate == pytest.approx(500) and p.plain_rate == pytest.approx(1000)
    assert plain_lens == [8, 16, 32, 64, 128, 256, 256]  # doubling to MAX_PLAIN
    assert p.spec_len == SpecPolicy.PROBE
    # speculation now wins (5 tokens per 2 ms): long speculating phases, short plain probes
    run(p.left, 5, 0.002)
    run(p.left, 1, 0.001)
    assert p.speculating and p.left == SpecPolicy.LONG and p.plain_len == SpecPolicy.PROBE
    # an idle gap between results is not counted as a step's time (that result's interval drops)
    run(p.left - 1, 5, 0.002)
    now += 30.0
    run(1, 5, 0.002)
    counted = SpecPolicy.LONG - SpecPolicy.SWITCH
    assert not p.speculating and p.spec_rate == pytest.approx(counted * 5 / ((counted - 1) * 0.002))


def test_spec_policy_totals_are_what_its_rates_counted():
    """Each kind's totals sum its finished phases: every result, and the tokens and seconds the
    rates counted (the switch's results left out); the bench reports their difference over a run."""
    from atomrt.runtime.bench.spec_decode import _policy_delta, _policy_totals

    p, now = SpecPolicy(), 0.0
    before = _policy_totals(p)
    for tokens, seconds in ((2, 0.004), (1, 0.001)):  # one speculating phase, one plain
        for _ in range(SpecPolicy.PROBE):
            now += seconds
            p.step_done(tokens, now)
    counted = SpecPolicy.PROBE - SpecPolicy.SWITCH
    spec, plain = p.totals[True], p.totals[False]
    assert (spec.phases, spec.results, spec.tokens) == (1, SpecPolicy.PROBE, 2 * counted)
    assert spec.seconds == pytest.approx(counted * 0.004)
    assert (plain.phases, plain.results, plain.tokens) == (1, SpecPolicy.PROBE, counted)
    assert spec.tokens / spec.seconds == pytest.approx(p.spec_rate)
    assert plain.tokens / plain.seconds == pytest.approx(p.plain_rate)
    delta = _policy_delta(before, _policy_totals(p))
    assert delta == {
        "speculating": {"phases": 1, "results": 8, "tokens_per_s_per_seq": 500.0},
        "plain": {"phases": 1, "results": 8, "tokens_per_s_per_seq": 1000.0},
    }
    assert (
        _policy_delta(_policy_totals(p), _policy_totals(p))["plain"]["tokens_per_s_per_seq"] is None
    )
    assert _policy_totals(None) is None and _policy_delta(None, None) is None


def test_spec_policy_leaves_a_long_phase_when_the_workload_stops_matching():
    """Speculation wins (long phases), then its drafts stop being accepted: the long phase ends
    after `PROBE` counted results, not `LONG`, and the next cycle backs off."""
    p, now = SpecPolicy(), 0.0

    def run(steps: int, tokens: int, seconds: float) -> None:
        nonlocal now
        for _ in range(steps):
            now += seconds
            p.step_done(tokens, now)

    run(p.left, 5, 0.002)  # speculating probe: 2500 tokens/s
    run(p.left, 1, 0.001)  # plain probe: 1000 tokens/s
    assert p.speculating and p.left == SpecPolicy.LONG
    steps = 0
    while p.speculating:  # the workload changes: 1 token per 2 ms step (500/s)
        run(1, 1, 0.002)
        steps += 1
    assert steps == SpecPolicy.SWITCH + SpecPolicy.PROBE
    assert p.spec_rate == pytest.approx(500)
    run(p.left, 1, 0.001)  # the plain phase after it: speculation now loses
    assert p.speculating and p.left == SpecPolicy.PROBE and p.plain_len == 2 * SpecPolicy.PROBE


def test_the_policy_weighs_tokens_per_sequence():
    """The engine reports a step's tokens and the sequences that emitted them; the policy counts
    tokens per sequence, so a phase in which requests finish (8 running, then 1) is not read as
    slower for emitting fewer tokens in all."""
    from atomrt.runtime.driver.speculation import Speculation

    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    spec = Speculation(config, async_scheduling=True)
    p = spec.policy
    for num_tokens, num_seqs in [(16, 8)] * SpecPolicy.SWITCH + [(16, 8), (2, 1), (0, 0)]:
        spec.step_done(num_tokens, num_seqs)
    assert p.seen == SpecPolicy.SWITCH + 3 and p.tokens == pytest.approx(2 + 2 + 0)


@pytest.mark.parametrize("accepted, speculates", [(1.06, False), (2.5, True)])
def test_spec_policy_leaves_the_switch_out_of_a_probe(accepted, speculates):
    """Steps as an H200 ran them for a 135M model at bs=1: plain async steps 0.65 ms a token, but
    the first two results of a plain phase take a verify step's 2 ms (no step was in flight);
    verify steps 2 ms for `1 + accepted` tokens. Plain steps emit 1540 tokens/s against
    speculation's 1030 (accepting 1.06) or 1750 (2.5): the policy must settle on the faster,
    though an 8-step plain probe with its switch counted runs at only 1010 tokens/s."""
    rng = random.Random(5)
    p, now, spec_steps = SpecPolicy(), 0.0, 0
    for _ in range(4000):
        if p.speculating:
            now += 0.002
            n = 1 + int(accepted) + (rng.random() < accepted % 1)
            spec_steps += 1
        else:
            now += 0.002 if p.seen < SpecPolicy.SWITCH else 0.00065
            n = 1
        p.step_done(n, now)
    share = spec_steps / 4000
    assert share > 0.8 if speculates else share < 0.15, share


def test_toggled_speculation_keeps_greedy_tokens_and_runs_plain_steps_ahead(
    models, reference, monkeypatch
):
    """The policy switched at random after every step result: greedy tokens stay those without
    speculation (mixed batch: penalties, logprobs, n=2, EOS), so do a seeded sampled request's,
    and steps without drafts go out while another is in flight, the seeded request's too."""
    rng = np.random.default_rng(11)

    def toggle(self, num_tokens, now):
        self.speculating = bool(rng.random() < 0.5)

    monkeypatch.setattr(SpecPolicy, "step_done", toggle)
    seeded = SamplingParams(temperature=0.1, seed=3, max_tokens=16, ignore_eos=True)
    prompts, params = MIXED_PROMPTS + [REPETITIVE], _mixed_params() + [seeded]
    llm = LLM(
        str(models[0]), **COMMON, speculative_config=_spec("ngram", models), async_scheduling=True
    )
    ahead = []
    submit = llm.engine.executor.submit

    def counting_submit(plan):
        running = llm.engine.schedulers[0].running
        seeded_runs = any(s.sampling_params.seed is not None for s in running)
        ahead.append((len(llm.engine._inflight), seeded_runs))
        return submit(plan)

    llm.engine.executor.submit = counting_submit
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.speculation.policy is not None
        assert llm.engine.stats.spec_decode.num_drafts > 0
    finally:
        llm.shutdown()
    assert _tokens(outs[:-1]) == _tokens(reference)
    assert (1, True) in ahead  # a step went out with another in flight, the seeded one running
    plain, _ = _generate(models[0], [REPETITIVE], seeded)
    assert outs[-1].outputs[0].token_ids == plain[0].outputs[0].token_ids


# ------------------------------------------------------------------ the draft model's DraftGraphs
# Bookkept on CPU with the logging fake segment backend of tests/test_region_graph_cpu.py (real
# recordings: tests/gpu/test_spec_decode_gpu.py).


@pytest.fixture(scope="module")
def drafter(models) -> DraftModel:
    config = Config(
        model=str(models[0]),
        device="cpu",
        speculative_config={"model": str(models[1]), "num_speculative_tokens": 2},
    )
    shape = RunnerShape(max_model_len=256, block_size=16, max_num_seqs=8, max_num_tokens=64)
    dm = DraftModel(config, torch.device("cpu"), torch.float32, shape, graphs_enabled=True)
    dm.allocate_kv_cache(16)
    return dm


def _rows(dm: DraftModel, n: int):
    z = np.zeros(n, np.int64)
    return dm._padded(z, z, z - 1, np.arange(n + 1, dtype=np.int32), np.ones(n, np.int32), z)


def test_capture_records_each_size_largest_first_and_replay_dispatch(drafter):
    log: list = []
    rec = drafter.recordings
    graph = rec.graphs[None] = DraftGraph(backend=FakeBackend(log))
    assert isinstance(graph, TokenGraph)
    drafter.capture([1, 2, 4])
    assert rec.capture_sizes == [1, 2, 4]
    assert log.count("session") == 3
    num_layers = len(drafter.attn_layers)
    for bs in (1, 2, 4):  # one segment per layer's attention break, plus one
        assert graph.num_segments(bs, "decode") == num_layers + 1
    p = _rows(drafter, 3)
    assert p.rows == 4 and p.slot_mapping[3] == -1  # padded to the bucket, the padding writes no KV
    assert drafter._replays(p) and rec.num_eager_passes == 0
    beyond = _rows(drafter, 5)
    assert beyond.rows == 5 and not drafter._replays(beyond) and rec.num_eager_passes == 0
    del graph._recordings[(4, None)]  # a bucket lost: its pass runs eagerly, counted
    assert not drafter._replays(p) and rec.num_eager_passes == 1


def test_a_drafter_never_captured_counts_every_pass(drafter):
    rec = drafter.recordings
    rec.graphs[None], rec.capture_sizes, rec.num_eager_passes = DraftGraph(FakeBackend([])), [], 0
    assert not drafter._replays(_rows(drafter, 1))
    assert not drafter._replays(_rows(drafter, 64))
    assert rec.num_eager_passes == 2 and rec.take_eager_passes() == 2
    assert rec.num_eager_passes == 0


def test_a_draft_model_must_share_the_vocabulary_and_cover_the_context(models, tmp_path):
    import json

    from atomrt.runtime.config import ConfigError
    from atomrt.runtime.driver.proposers import check_speculation
    from atomrt.workers.loading.loader import read_arch

    target = Config(model=str(models[0]), device="cpu")
    arch = read_arch(target)

    def draft_folder(**changes) -> str:
        folder = tmp_path / "_".join(changes)
        folder.mkdir()
        hf = json.loads((models[1] / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**hf, **changes}))
        (folder / "model.safetensors").write_bytes(b"")  # read_arch reads only the config
        return str(folder)

    def check(model: str, **kw) -> None:
        spec = {"model": model, "num_speculative_tokens": 2}
        check_speculation(Config(model=str(models[0]), speculative_config=spec, **kw), arch)

    check(str(models[1]))
    with pytest.raises(ConfigError, match="speculative_config.model: the draft model's vocabulary"):
        check(draft_folder(vocab_size=64))
    with pytest.raises(ConfigError, match="model_config.max_model_len"):
        check(draft_folder(max_position_embeddings=128))
    with pytest.raises(ConfigError, match="speculative_config.model"):
        check(str(tmp_path / "missing"))

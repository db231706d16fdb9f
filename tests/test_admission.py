"""Admission rules: `scheduler_config.delay_factor` (vLLM's --scheduler-delay-factor) holds new
prompts while sequences run, so a burst that arrives one request per step prefills in one step;
with `dp_prefill_align` beside it, both rules must admit. A simulated clock drives the scheduler
(tests/test_scheduler.py's fake model), and greedy outputs equal the reference with or without
the delay."""

from types import SimpleNamespace

import pytest
from test_scheduler import fake_model, make, reference_output, seq

from atomrt.runtime.config import ConfigError, SchedulerConfig
from atomrt.runtime.driver.admission import Admission, PrefillDelay


def _rank(waiting=(), running=()):
    return SimpleNamespace(
        waiting=[SimpleNamespace(arrival_time=t) for t in waiting], running=list(running)
    )


def test_prompts_wait_for_a_multiple_of_the_last_prompt_steps_latency() -> None:
    delay = PrefillDelay(1.0)
    busy = ["a running sequence"]
    assert delay.admits([_rank(waiting=[0.0], running=busy)], now=0.0) == [True]  # no history yet
    delay.observe([SimpleNamespace(is_prefill=True)], now=1.000)
    # the next schedule 40 ms later: the last prompt step took 40 ms
    assert delay.admits([_rank(running=busy)], now=1.040) == [True]
    assert delay.last_prompt_latency == pytest.approx(0.040)
    rank = _rank(waiting=[1.050, 1.060], running=busy)
    assert delay.admits([rank], now=1.070) == [False]  # the oldest waited 20 ms of 40
    assert delay.admits([rank], now=1.0899) == [False]
    assert delay.admits([rank], now=1.0901) == [True]
    assert delay.num_held_steps == 2
    # nothing running: the step would be the prompts' alone, so nothing is held
    assert delay.admits([_rank(waiting=[1.089])], now=1.0901) == [True]


def test_each_rank_is_held_on_its_own_and_both_rules_must_admit() -> None:
    clock = iter([0.0, 0.010, 0.050])  # admits, observe (a prompt step), admits 40 ms later
    adm = Admission(dp_prefill_align=0, delay_factor=1.0, dp_size=2, clock=lambda: next(clock))
    assert adm.aligner is None and adm.delay is not None
    adm.admits([_rank(), _rank()])
    adm.observe([SimpleNamespace(is_prefill=True), SimpleNamespace(is_prefill=False)])
    ranks = [_rank(waiting=[0.045], running=["x"]), _rank(waiting=[0.045])]
    assert adm.admits(ranks) == [False, True]
    off = Admission(dp_prefill_align=0, delay_factor=0.0, dp_size=1)
    assert off.aligner is None and off.delay is None and not off.active
    assert off.admits([_rank(waiting=[0.0], running=["x"])]) == [True]
    both = Admission(dp_prefill_align=2, delay_factor=1.0, dp_size=2)
    lone = [_rank(waiting=[0.0]), _rank(running=["x"])]
    assert both.admits(lone) == [False, True]  # the aligner holds the lone prefill
    assert both.num_held_steps == 1


def _simulate(delay_factor: float) -> tuple[list[int], dict[str, list[int]]]:
    """One long request, then four prompts arriving one per 10 ms step while it decodes. Returns
    the steps that admitted new prompts and each request's output."""
    sched = make(budget=64, max_seqs=8)
    now = 0.0
    adm = Admission(dp_prefill_align=0, delay_factor=delay_factor, dp_size=1, clock=lambda: now)
    reqs = {"long": seq("long", list(range(1, 9)), max_tokens=40)}
    reqs["long"].arrival_time = now
    sched.add(reqs["long"])
    admitting_steps = []
    step = 0
    while sched.has_unfinished():
        if 5 <= step < 9:
            r = seq(f"p{step}", list(range(step, step + 6)), max_tokens=6)
            r.arrival_time = now
            reqs[r.request_id] = r
            sched.add(r)
        (admit,) = adm.admits([sched])
        out = sched.schedule(admit)
        adm.observe([out])
        if any(
            row.seq.request_id != "long" and row.num_computed_tokens == 0 for row in out.scheduled
        ):
            admitting_steps.append(step)
        sampled = {r.seq.seq_id: fake_model(r.seq.token_ids) for r in out.scheduled if r.is_sampled}
        sched.advance(out)
        sched.postprocess(out, sampled)
        now += 0.030 if out.is_prefill else 0.010
        step += 1
        assert step < 500
    outputs = {rid: r.token_ids[r.num_prompt_tokens :] for rid, r in reqs.items()}
    return admitting_steps, outputs


def test_a_burst_prefills_in_one_step_with_the_delay() -> None:
    plain_steps, plain = _simulate(0.0)
    delayed_steps, delayed = _simulate(1.0)
    assert plain_steps == [5, 6, 7, 8]  # each prompt prefills in its own step
    assert len(delayed_steps) == 1 and delayed_steps[0] > 8  # all four together, later
    for rid, tokens in delayed.items():
        first = 1 if rid == "long" else int(rid[1:])
        prompt = list(range(first, first + (8 if rid == "long" else 6)))
        assert tokens == plain[rid] == reference_output(prompt, len(tokens))


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), "1", True])
def test_a_bad_delay_factor_is_a_config_error(bad) -> None:
    with pytest.raises(ConfigError, match="delay_factor"):
        SchedulerConfig(delay_factor=bad)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    """The tiny BPE Llama (the embedded tokenizer, random weights): admission does not depend on
    the model, and the embedded one's two loads took ~15 s."""
    from grammar_harness import build_tiny_bpe

    from atomrt.runtime.entrypoints.llm import LLM

    model = str(build_tiny_bpe(tmp_path_factory.mktemp("admission") / "model"))
    settings = dict(device="cpu", enforce_eager=True, num_kv_blocks=64)
    plain = LLM(model, **settings)
    delayed = LLM(model, **settings, delay_factor=1000.0)  # hold until the running request is done
    yield plain, delayed
    plain.shutdown()
    delayed.shutdown()


def _staggered(llm) -> dict[str, list[int]]:
    """A long request, then three prompts added one per engine step while it decodes."""
    from atomrt import SamplingParams

    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    ids = {engine.add_request("Once upon a time", greedy): "long"}
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        if 2 <= steps < 5:
            ids[engine.add_request(f"Question {steps}: what is {steps} + {steps}?", greedy)] = (
                f"q{steps}"
            )
        for out in engine.step():
            if out.finished:
                tokens[ids[out.request_id]] = out.outputs[0].token_ids
        steps += 1
    return tokens


def test_the_engine_with_a_delay_gives_the_same_greedy_tokens(engines) -> None:
    plain, delayed = engines
    assert delayed.config.scheduler_config.delay_factor == 1000.0
    expected = _staggered(plain)
    got = _staggered(delayed)
    assert got == expected and len(got) == 4
    assert delayed.engine.admission.num_held_steps > 0
    assert plain.engine.admission.num_held_steps == 0


def test_the_flag_sets_the_config() -> None:
    from atomrt.runtime.entrypoints.cli import build_parser
    from atomrt.runtime.entrypoints.config_args import config_from_args

    args = build_parser().parse_args(
        ["generate", "--scheduler-delay-factor", "0.5", "--prompt", "x"]
    )
    assert config_from_args(args).scheduler_config.delay_factor == 0.5

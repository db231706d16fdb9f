"""Engine core: the right tokens and a live engine under any interleaving, interrupt and request.

- The randomized differential over interleavings is tests/test_engine_random.py.
- Interrupts: a KeyboardInterrupt from a timer at random points of `generate` (inproc, mp, Ray),
  then `generate` again gives the right tokens; an exception injected into a worker's step: the
  next step is right (in-process) or the engine is dead with an error naming the rank and the step.
- Requests: parameter fuzz through mp (rejected at add_request or served; the other request in
  the batch always finishes), and the bounds every request meets before it is queued.
- Liveness: a hung but alive worker is reported within heartbeat_timeout_s; device waits are bounded.
"""

from __future__ import annotations

import _thread
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
from executor_harness import PROMPTS, build_tiny_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workload_harness import Alone

from atomrt.runtime.config import CompilationConfig, Config, ConfigError
from atomrt.runtime.driver.engine import EngineDeadError
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.executors.base import WorkerError
from atomrt.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CPU = dict(device="cpu", enforce_eager=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_core") / "model")


@pytest.fixture(scope="module")
def alone(tiny) -> Alone:
    a = Alone(tiny)
    yield a
    a.llm.shutdown()


# ------------------------------------------------------------------------------------ interrupts


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test, as an interactive run has it: a shell starts a
    background job (CI scripts, `cmd &`) with SIGINT ignored, where the engine rightly leaves the
    signal alone and has nothing to hold back."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_trials(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, trials: int, span_s: float
) -> int:
    """Ctrl-C (a timer's interrupt_main) at random points of generate, then generate again."""
    assert llm.engine._guard.installed, "the engine must hold SIGINT back in its critical sections"
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    rng = random.Random(7)
    interrupted = 0
    for _ in range(trials):
        timer = threading.Timer(rng.uniform(0.0, span_s), _thread.interrupt_main)
        try:
            timer.start()
            try:
                llm.generate(prompts, params, use_tqdm=False)
            finally:
                timer.cancel()
                timer.join()
        except KeyboardInterrupt:
            interrupted += 1
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
    return interrupted


def test_keyboard_interrupt_in_process_then_generate_again(tiny, default_sigint):
    llm = LLM(str(tiny), **CPU, num_kv_blocks=64, max_num_seqs=4, async_scheduling=True)
    try:
        start = time.monotonic()
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        span = time.monotonic() - start
        assert _interrupt_trials(llm, PROMPTS, GREEDY, trials=25, span_s=span) >= 5
    finally:
        llm.shutdown()


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_keyboard_interrupt_through_workers_then_generate_again(tiny, executor, default_sigint):
    llm = LLM(
        str(tiny),
        **CPU,
        executor=executor,
        num_kv_blocks=64,
        max_num_seqs=4,
        async_scheduling=True,
        worker_timeout_s=90.0,
    )
    try:
        start = time.monotonic()
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        span = time.monotonic() - start
        assert _interrupt_trials(llm, PROMPTS, GREEDY, trials=8, span_s=span) >= 2
    finally:
        llm.shutdown()


def test_exception_in_an_in_process_step_leaves_the_next_step_right(tiny):
    from atomrt.workers.runner.model_runner import ModelRunner

    llm = LLM(str(tiny), **CPU, num_kv_blocks=64, max_num_seqs=4)
    original = ModelRunner.execute
    calls = {"n": 0}

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return original(self, *args, **kwargs)

    try:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        ModelRunner.execute = failing
        with pytest.raises(RuntimeError, match="injected step failure"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        ModelRunner.execute = original
        assert [
            o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        ] == want
        assert llm.engine.dead is None
    finally:
        ModelRunner.execute = original
        llm.shutdown()


FAULTS = textwrap.dedent("""
    import os, time
    if os.environ.get("ATOMRT_TEST_FAULT"):
        from atomrt.workers import worker as _w
        _launch = _w.Worker.launch
        _kind, _step = os.environ["ATOMRT_TEST_FAULT"].split(":")

        def launch(self, plan):
            if plan.step == int(_step):
                if _kind == "raise":
                    raise RuntimeError("injected step failure")
                time.sleep(3600)  # hang: alive, but no progress
            return _launch(self, plan)

        _w.Worker.launch = launch
""")


@pytest.fixture
def worker_faults(tmp_path, monkeypatch):
    """Spawned workers import this sitecustomize: ATOMRT_TEST_FAULT=raise:N or hang:N at step N."""
    (tmp_path / "sitecustomize.py").write_text(FAULTS)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    return monkeypatch


def test_exception_in_an_mp_worker_step_is_a_dead_engine_naming_rank_and_step(tiny, worker_faults):
    worker_faults.setenv("ATOMRT_TEST_FAULT", "raise:2")
    llm = LLM(
        str(tiny), **CPU, executor="mp", num_kv_blocks=64, max_num_seqs=4, worker_timeout_s=90.0
    )
    try:
        with pytest.raises(WorkerError) as err:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert (
            "rank 0" in str(err.value)
            and "step 2" in str(err.value)
            and "injected" in str(err.value)
        )
        assert "expected" not in str(err.value)
        with pytest.raises(EngineDeadError, match="injected step failure"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_hung_but_alive_mp_worker_is_reported_within_the_heartbeat_timeout(tiny, worker_faults):
    worker_faults.setenv("ATOMRT_TEST_FAULT", "hang:3")
    hb = 3.0  # the idle loop stamps progress far more often (the frozen-rank tests take 2 s)
    llm = LLM(
        str(tiny),
        **CPU,
        executor="mp",
        num_kv_blocks=64,
        max_num_seqs=4,
        worker_timeout_s=120.0,
        heartbeat_timeout_s=hb,
    )
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError, match="no progress") as err:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        elapsed = time.monotonic() - start
        assert elapsed < hb + 6.0, f"reported after {elapsed:.1f} s"
        assert "rank 0" in str(err.value) and "heartbeat_timeout_s" in str(err.value)
    finally:
        llm.shutdown()


def test_device_waits_are_bounded_and_report_progress():
    from atomrt.workers.runner.readback import DeviceTimeout, wait_event

    class NeverDone:
        def query(self) -> bool:
            return False

    beats = []
    start = time.monotonic()
    with pytest.raises(DeviceTimeout, match="did not finish within"):
        wait_event(NeverDone(), 0.5, lambda: beats.append(1), "step 7")
    assert 0.5 <= time.monotonic() - start < 2.0 and len(beats) >= 3


# -------------------------------------------------------------------------------------- requests


def test_bounds_every_request_meets(tiny):
    llm = LLM(str(tiny), **CPU, num_kv_blocks=64, max_num_seqs=4)
    engine = llm.engine
    try:
        for kwargs, field in [
            (dict(seed=-1), "seed"),
            (dict(seed=2**64), "seed"),
            (dict(top_k=2**64), "top_k"),
            (dict(logprobs=2**64), "logprobs"),
            (dict(temperature=math.inf), "temperature"),
        ]:
            with pytest.raises(ValueError, match=field):
                SamplingParams(**kwargs)
        with pytest.raises(ValueError, match="max_logprobs=20"):
            engine.add_request([5, 6], SamplingParams(logprobs=100000))
        params = SamplingParams(temperature=0.0)
        params.seed = -5  # changed after construction: checked again at add_request
        with pytest.raises(ValueError, match="seed"):
            engine.add_request([5, 6], params)
        with pytest.raises(ValueError, match="params"):
            engine.add_request([5, 6], {"temperature": 0})
        with pytest.raises(ValueError, match="request_id"):
            engine.add_request([5, 6], request_id=7)
        assert not engine.has_unfinished()  # nothing was queued by a rejected request
        out = llm.generate(
            [[5, 6]], SamplingParams(temperature=0, max_tokens=3, logprobs=20), use_tqdm=False
        )
        assert len(out[0].outputs[0].logprobs[0]) >= 20
    finally:
        llm.shutdown()


def test_max_model_len_beyond_the_models_context(tiny, monkeypatch, caplog):
    with pytest.raises(ConfigError, match="max_model_len.*ATOMRT_ALLOW_LONG_MAX_MODEL_LEN"):
        LLM(
            str(tiny), **CPU, num_kv_blocks=64, max_model_len=512
        )  # the tiny model's context is 256
    import dataclasses

    from atomrt.runtime.driver import validation

    monkeypatch.setattr(
        validation, "ENV", dataclasses.replace(validation.ENV, allow_long_max_model_len=True)
    )
    llm = LLM(str(tiny), **CPU, num_kv_blocks=64, max_model_len=512)
    try:
        assert llm.engine.max_model_len == 512
        assert any("exceeds the model's context" in r.getMessage() for r in caplog.records)
    finally:
        llm.shutdown()


def test_config_leaves_its_compilation_config_as_given():
    cc = CompilationConfig(level=3)
    eager = Config(compilation_config=cc, enforce_eager=True)
    assert eager.compilation_config.level == 0 and cc.level == 3 and cc.cudagraph_mode is None
    big = Config(compilation_config=cc)
    assert (
        big.compilation_config.cudagraph_mode.name == "TR_HYBRID" and big.capture_sizes[-1] == 256
    )
    assert cc.cudagraph_capture_sizes is None and cc.splitting_ops is None
    from atomrt.runtime.config import SchedulerConfig

    small = Config(
        compilation_config=cc, scheduler_config=SchedulerConfig(max_num_seqs=4)
    )  # reused: fine
    assert small.capture_sizes == [1, 2, 3, 4]


def test_stream_deltas_carry_the_logprobs_of_their_own_tokens_and_abort_ends_a_stream(tiny):
    llm = LLM(str(tiny), **CPU, num_kv_blocks=64, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    try:
        whole = llm.generate([[9, 8, 7]], params, use_tqdm=False)[0].outputs[0]
        rid = engine.add_request([9, 8, 7], params, stream=True)
        tokens, logprobs = [], []
        while engine.has_unfinished():
            for out in engine.step():
                delta = out.outputs[0]
                assert len(delta.logprobs) == len(delta.token_ids)
                tokens += delta.token_ids
                logprobs += delta.logprobs
        assert tokens == whole.token_ids and logprobs == whole.logprobs
        rid = engine.add_request(
            [9, 8, 7], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), stream=True
        )
        engine.step()
        engine.step()
        engine.abort(rid)
        outs = engine.step()
        assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs] == [
            (rid, True, "abort")
        ]
        assert not engine.has_unfinished()
    finally:
        llm.shutdown()


def test_a_parallel_layout_the_model_cannot_take_is_one_clean_line():
    """The embedded model has 9 attention heads: TP=2 is refused on the driver, before Ray starts."""
    start = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "atomrt.runtime.entrypoints.cli",
            "generate",
            "--executor",
            "ray",
            "--tp",
            "2",
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "ray" not in r.stderr.lower().replace(
        "--executor ray", ""
    )
    lines = [line for line in r.stderr.splitlines() if "atomrt: error" in line]
    assert (
        len(lines) == 1 and "num_attention_heads" in lines[0] and "tensor_parallel_size" in lines[0]
    )
    assert time.monotonic() - start < 60


# ------------------------------------------------------------------------------- parameter fuzz

ODD_INTS = st.one_of(
    st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63)])
)
ODD_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-30, 1e30])
)
ODD = st.one_of(
    ODD_INTS,
    ODD_FLOATS,
    st.booleans(),
    st.none(),
    st.text(max_size=5),
    st.lists(st.integers(-5, 2**40), max_size=3),
)
FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "stop_token_ids",
    "ignore_eos",
    "n",
]


@pytest.fixture(scope="module")
def mp_llm(tiny):
    llm = LLM(
        str(tiny), **CPU, executor="mp", num_kv_blocks=64, max_num_seqs=4, worker_timeout_s=90.0
    )
    yield llm
    llm.shutdown()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(values=st.dictionaries(st.sampled_from(FIELDS), ODD, min_size=1, max_size=4))
def test_parameter_fuzz_through_mp(mp_llm, alone, values):
    engine = mp_llm.engine
    companion = engine.add_request(
        PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    )
    odd: Optional[str] = None
    try:
        params = SamplingParams(**{**dict(max_tokens=4), **values})
        odd = engine.add_request(PROMPTS[1], params)
    except ValueError:
        pass  # rejected, naming the field: nothing was queued
    done = {}
    for _ in range(600):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert engine.dead is None
    assert done[companion].outputs[0].token_ids == alone.tokens(PROMPTS[0], 5)
    if odd is not None:
        assert done[odd].outputs[0].finish_reason in ("stop", "length")

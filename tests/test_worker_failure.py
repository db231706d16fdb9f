"""A worker that dies mid-generation: the caller gets a `WorkerError` naming the rank within 10 s,
nothing hangs, and afterwards no process of the engine is left (checked by PID).

Real processes, real Ray, real ZeroMQ: the test SIGKILLs a worker's pid while `generate` runs.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from executor_harness import COMMON, PROMPTS, build_tiny_llama, wait_gone

from atomrt import SamplingParams
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.executors.base import WorkerError

LONG = SamplingParams(
    temperature=0.0, max_tokens=200, ignore_eos=True
)  # never done before the kill
ERROR_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _kill_mid_generation(llm: LLM, rank: int, after_steps: int = 3) -> tuple[str, float]:
    """Run generate; SIGKILL `rank`'s process once `after_steps` steps ran. -> (error, seconds to it)."""
    pid = llm.engine.executor.worker_pids[rank]
    killed_at: list[float] = []

    def killer() -> None:
        deadline = time.monotonic() + 60
        while llm.engine.step_no < after_steps and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    with pytest.raises(WorkerError) as err:
        llm.generate(PROMPTS, LONG)
    raised_at = time.monotonic()
    thread.join(5)
    assert killed_at, "the killer thread never fired: generation ended first"
    return str(err.value), raised_at - killed_at[0]


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_killed_worker_ends_generation_with_error_and_leaves_no_process(
    tiny_model: Path, executor: str
) -> None:
    llm = LLM(str(tiny_model), executor=executor, tensor_parallel_size=2, **COMMON)
    pids = dict(llm.engine.executor.worker_pids)
    assert len(pids) == 2 and all(p != os.getpid() for p in pids.values())
    try:
        message, seconds = _kill_mid_generation(llm, rank=1)
    finally:
        llm.shutdown()
    print(f"{executor}: error after {seconds:.2f} s: {message}")
    assert seconds < ERROR_WITHIN_S, f"the error took {seconds:.1f} s"
    assert "rank 1 (dp 0, tp 1)" in message, message
    with pytest.raises(WorkerError, match="stopped"):  # the engine cannot step any more
        llm.engine.executor.submit(None)  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished(), "in-flight requests end with the failure"
    with pytest.raises(RuntimeError, match="rank 1"):  # new requests are refused, naming the rank
        llm.engine.add_request([1, 2, 3])
    assert wait_gone(pids.values()) == [], "worker processes left after shutdown"
    if executor == "ray":
        import ray

        assert not ray.is_initialized(), "the executor started Ray, so shutdown must stop it"


@pytest.mark.parametrize("executor", ["mp", pytest.param("ray", marks=pytest.mark.slow)])
def test_frozen_worker_is_named_after_its_missed_heartbeat(tiny_model: Path, executor: str) -> None:
    """SIGSTOP: the process is alive but answers nothing; the heartbeat names it, SIGKILL ends it."""
    hb = 2.0
    llm = LLM(
        str(tiny_model), executor=executor, tensor_parallel_size=2, heartbeat_timeout_s=hb, **COMMON
    )
    pids = dict(llm.engine.executor.worker_pids)
    try:
        pid = pids[1]
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="heartbeat") as err:
            llm.generate(PROMPTS, LONG)
        seconds = time.monotonic() - start
    finally:
        llm.shutdown()
    assert "rank 1 (dp 0, tp 1)" in str(err.value), err.value
    assert seconds < hb + ERROR_WITHIN_S, f"the error took {seconds:.1f} s"
    assert wait_gone(pids.values()) == []


_EXIT_WITHOUT_SHUTDOWN = """
import json, sys
from atomrt.runtime.entrypoints.llm import LLM
llm = LLM(sys.argv[1], executor="mp", tensor_parallel_size=2, **json.loads(sys.argv[2]))
out = llm.generate([[3, 4, 5]], {params})
print(json.dumps(list(llm.engine.executor.worker_pids.values())), flush=True)
"""  # no shutdown(): the interpreter's exit must still end the workers


def test_driver_exit_without_shutdown_leaves_no_process(tiny_model: Path) -> None:
    import json
    import subprocess
    import sys

    script = _EXIT_WITHOUT_SHUTDOWN.replace(
        "{params}",
        "__import__('atomrt', fromlist=['SamplingParams']).SamplingParams(max_tokens=2)",
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tiny_model), json.dumps(COMMON)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    pids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(pids) == 2
    assert wait_gone(pids, timeout_s=5) == []

"""The Ray recipes of docs/deploy.md against a real `ray start --head` on 127.0.0.1.

The recipes are read from the doc (`<!-- recipe: NAME -->` blocks) and run as written, with the
runtime env's cache root moved into a temporary directory:

- the generation job with the embedded model: its logs hold the generated text (default run);
- the prewarm job, then the read-only check job: the second engine start loads every piece,
  compiles nothing and writes nothing (slow: a cold Inductor compile; on a tiny Llama, and with the
  recipe's own config and model).

The cluster is private (its own ports and temp dir) and stopped by signalling the `ray start
--block` process: `ray stop` would stop every Ray on the machine.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from executor_harness import build_tiny_llama

from atomrt.distributed.net_utils import get_free_port

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "deploy.md"
RUNTIME_ENV = "deploy/ray/runtime-env.yaml"
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 180
JOB_TIMEOUT_S = 900
# Flags appended to the prewarm recipes in the default run: a tiny model, a small KV cache.
TINY_FLAGS = "--device cpu --max-num-seqs 8 --set cache_config.num_kv_blocks=64"


def recipes() -> dict[str, str]:
    """Every `<!-- recipe: NAME -->` shell block of docs/deploy.md, continuation lines joined."""
    found = re.findall(r"<!-- recipe: ([\w-]+) -->\n```sh\n(.*?)```", DOC.read_text(), re.S)
    return {name: re.sub(r"\\\n\s*", "", body).strip() for name, body in found}


@dataclass
class RayHead:
    dashboard: str  # http://127.0.0.1:<port>, what `ray job submit` takes as RAY_ADDRESS
    env: dict[str, str]  # the client's environment


def _start_head(temp_dir: str, log: Path, token: str) -> tuple[subprocess.Popen, int]:
    names = (
        "port",
        "dashboard-port",
        "ray-client-server-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "metrics-export-port",
        "node-manager-port",
        "object-manager-port",
        "runtime-env-agent-port",
    )
    taken: set[int] = set()
    while len(taken) < len(names):  # the OS may hand out a port it just gave: Ray refuses twins
        taken.add(get_free_port())
    ports = dict(zip(names, sorted(taken)))
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1"]
    cmd += [f"--{name}={port}" for name, port in ports.items()]
    cmd += ["--dashboard-host=127.0.0.1", "--num-cpus=2", f"--temp-dir={temp_dir}"]
    cmd += ["--disable-usage-stats"]
    env = dict(
        os.environ,
        PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
        RAY_AUTH_MODE="token",  # as docs/deploy.md's clusters: clients must show the token
        RAY_AUTH_TOKEN=token,
    )
    with log.open("w") as out:  # its own session: every process of this cluster is in it
        head = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return head, ports["dashboard-port"]


def _session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True).stdout
    return [int(p) for p, s in (line.split() for line in out.splitlines()) if int(s) == sid]


def _stop_head(head: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block` (it drains the node and stops what it started), then
    SIGKILL, by pid, whatever of its session is left."""
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(60)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait(10)
    deadline = time.monotonic() + 10
    while _session_pids(head.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in _session_pids(head.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    # Ray's unix sockets live under the temp dir: keep its path short.
    temp_dir = tempfile.mkdtemp(prefix="atomrt-ray-", dir="/tmp")
    log = tmp_path_factory.mktemp("ray_head") / "ray-start.log"
    token = secrets.token_hex(32)  # this cluster's own, whatever ~/.ray holds
    head, dashboard_port = _start_head(temp_dir, log, token)
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    env = dict(
        os.environ,
        PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
        RAY_ADDRESS=dashboard,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # the job server answers once the dashboard is up
            probe = subprocess.run(
                [str(BIN / "ray"), "job", "list"], env=env, capture_output=True, timeout=60
            )
            if probe.returncode == 0:
                break
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"ray start --head did not come up:\n{log.read_text()[-3000:]}\n"
                    f"`ray job list`: {probe.stderr.decode(errors='replace')[-2000:]}"
                )
            time.sleep(1)
        yield RayHead(dashboard, env)
    finally:
        _stop_head(head)
        subprocess.run(["rm", "-rf", temp_dir], check=False)
    assert _session_pids(head.pid) == [], "a process of the Ray cluster outlived it"


@dataclass
class Job:
    submission_id: str
    returncode: int
    output: str  # what `ray job submit` printed (the job's log, tailed)
    logs: str  # `ray job logs`


def submit(head: RayHead, recipe: str, runtime_env: Path, extra_flags: str = "") -> Job:
    """Run a recipe (its runtime env swapped for `runtime_env`), then read the job's logs."""
    assert recipe.startswith("ray job submit ") and RUNTIME_ENV in recipe
    command = recipe.replace(RUNTIME_ENV, str(runtime_env))
    proc = subprocess.run(
        ["bash", "-c", f"{command} {extra_flags}".strip()],
        cwd=REPO,
        env=head.env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    ids = re.findall(r"raysubmit_\w+", output)
    assert ids, f"no job was submitted:\n{output[-3000:]}"
    logs = subprocess.run(
        [str(BIN / "ray"), "job", "logs", ids[0]],
        env=head.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert logs.returncode == 0, logs.stderr[-2000:]
    return Job(ids[0], proc.returncode, output, logs.stdout)


def derived_runtime_env(tmp_path: Path, cache_root: Path) -> Path:
    """deploy/ray/runtime-env.yaml with the compile cache in `cache_root`."""
    env = yaml.safe_load((REPO / RUNTIME_ENV).read_text())
    assert set(env) == {"env_vars"} and "ATOMRT_CACHE_ROOT" in env["env_vars"]
    env["env_vars"]["ATOMRT_CACHE_ROOT"] = str(cache_root)
    # this process's Inductor scratch cache, not the machine's shared one
    env["env_vars"]["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root.parent / "inductor")
    path = tmp_path / "runtime-env.yaml"
    path.write_text(yaml.safe_dump(env))
    return path


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def test_recipes_are_in_the_doc():
    found = recipes()
    assert set(found) >= {
        "ray-generate",
        "ray-prewarm",
        "ray-prewarm-check",
        "ray-serve",
        "ray-bench-dp",
    }
    for name, command in found.items():
        assert command.startswith("ray job submit ") and f"--runtime-env {RUNTIME_ENV}" in command
        assert "<" not in command and "TODO" not in command, f"{name}: a placeholder"
    bench = shlex.split(found["ray-bench-dp"].split(" -- ", 1)[1])
    assert bench[:3] == ["atomrt", "bench", "dp"]
    from atomrt.runtime.bench.dp import _parse as parse_bench_dp

    assert parse_bench_dp(bench[3:]).executor == "ray"  # exits on a flag the bench does not take


def prewarm_then_check(head: RayHead, tmp_path: Path, extra_flags: str, pieces: int) -> None:
    cache_root = tmp_path / "cache"
    runtime_env = derived_runtime_env(tmp_path, cache_root)
    cold = submit(head, recipes()["ray-prewarm"], runtime_env, extra_flags)
    assert cold.returncode == 0, cold.output[-4000:]
    assert f"{pieces} Inductor compiles and 0 cache loads" in cold.logs
    (record,) = (cache_root / "torch_compile_cache").glob("*/prewarm.json")
    assert f"record: {record}" in cold.logs
    before = _tree(cache_root)
    check = submit(head, recipes()["ray-prewarm-check"], runtime_env, extra_flags)
    assert check.returncode == 0, check.output[-4000:]
    assert f"0 Inductor compiles and {pieces} cache loads" in check.logs
    assert "the read-only compile cache holds every piece" in check.logs
    assert _tree(cache_root) == before, "the read-only start wrote to the cache"


def test_generate_job_logs_hold_the_text(ray_head: RayHead, tmp_path: Path) -> None:
    from atomrt.runtime.envs import ENV

    runtime_env = derived_runtime_env(tmp_path, tmp_path / "cache")
    # the embedded model's tokenizer as this machine's cache root holds it (the engine tests before
    # saved it; tests/test_loader.py covers its build from the GGUF file, ~5 s here): the job loads
    # that copy rather than build it again
    saved = ENV.cache_root / "tokenizers"
    if saved.is_dir():
        shutil.copytree(saved, tmp_path / "cache" / "tokenizers")
    job = submit(ray_head, recipes()["ray-generate"], runtime_env)
    assert job.returncode == 0, job.output[-4000:]
    assert "### What is the capital of France?" in job.logs
    assert "Paris" in job.logs.split("### What is the capital of France?", 1)[1]
    # the driver joined the cluster through RAY_ADDRESS and placed its rank there
    assert "ray executor: 1 ranks on 1 node(s)" in job.logs


@pytest.mark.slow
def test_prewarm_job_then_a_start_that_compiles_nothing(ray_head: RayHead, tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "tiny")
    # level3.yaml with a tiny model: 2 attention layers split the backbone into 3 pieces
    prewarm_then_check(ray_head, tmp_path, f"--model {model} {TINY_FLAGS}", pieces=3)


@pytest.mark.slow
def test_prewarm_recipe_with_its_own_config(ray_head: RayHead, tmp_path: Path) -> None:
    """The recipes exactly as written: SmolLM2-135M-Instruct at level 3 (30 attention layers)."""
    prewarm_then_check(ray_head, tmp_path, "", pieces=31)

"""The OpenAI server as a Ray Serve application on a local Ray: two replicas, each with its own
engine, answer the official openai client through Serve's HTTP proxy, and requests reach both."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
from executor_harness import build_tiny_llama, wait_gone

from atomrt.distributed.net_utils import get_free_port

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_serve_app") / "model")


def test_two_replicas_answer_through_the_serve_proxy(tiny):
    from ray import serve

    from atomrt.runtime.entrypoints.serve_app import build

    port = get_free_port("127.0.0.1")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    engine_pids: set[int] = set()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build(
            {
                "model": str(tiny),
                "device": "cpu",
                "enforce_eager": True,
                "set": ["cache_config.num_kv_blocks=64"],
                "served_model_name": "tiny",
                "num_replicas": 2,
            }
        )
        serve.run(app, name="atomrt", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            status = serve.status().applications.get("atomrt")
            if status is not None and status.status == "RUNNING":
                break
            time.sleep(1.0)
        else:
            raise AssertionError(f"the application did not start: {serve.status()}")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        whole = client.completions.create(
            model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0
        )
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0, stream=True
            )
        )
        assert whole.usage.completion_tokens == 6 and streamed == whole.choices[0].text
        for _ in range(40):  # Serve's proxy spreads requests over the replicas
            engine_pids.add(httpx.get(f"{url}/health").json()["engine_pid"])
            if len(engine_pids) == 2:
                break
        assert len(engine_pids) == 2, engine_pids
        assert httpx.get(f"{url}/ready").status_code == 200
        assert "atomrt:generation_tokens_total" in httpx.get(f"{url}/metrics").text
    finally:
        serve.shutdown()
        ray.shutdown()
    assert wait_gone(engine_pids) == [], "Serve's shutdown must stop every replica's engine"


def test_build_checks_its_arguments():
    from atomrt.runtime.entrypoints.serve_app import build

    with pytest.raises(ValueError, match="port"):
        build({"port": 9000})
    with pytest.raises(ValueError, match="bad arguments"):
        build({"no_such_flag": 1})

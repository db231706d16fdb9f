"""GPU tier: a level-3 start built from Dynamo's kept trace gives the greedy tokens of the start
that traced, under FULL and TR_HYBRID, each in fresh processes sharing one compile cache; both
give eager's (level 0) tokens. Dummy weights of SmolLM2-135M's shape (seeded: every process has
the same), float32.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_trace_cache_gpu.py`.
"""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

_CHILD = """
import json, random, sys
from atomrt.compile import compilation_counter
from atomrt import SamplingParams
from atomrt.runtime.config import CompilationConfig
from atomrt.runtime.entrypoints.llm import LLM
level, mode, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
cc = CompilationConfig(level=level, cudagraph_mode=mode, cuda_graph_sizes=[16], cache_dir=cache)
llm = LLM(model="SmolLM2-135M", load_format="dummy", dtype="float32", device="cuda",
          compilation_config=cc, max_num_seqs=16, async_scheduling=True)
rng = random.Random(0)
prompts = [[rng.randrange(1, 49000) for _ in range(rng.randrange(1, 90))] for _ in range(16)]
params = [SamplingParams(temperature=0.0, max_tokens=4 + i % 9, ignore_eos=True) for i in range(16)]
out = llm.generate(prompts, params, use_tqdm=False)
print("RESULT " + json.dumps({"tokens": [o.outputs[0].token_ids for o in out],
                              "trace_loads": compilation_counter.num_trace_loads}), flush=True)
llm.shutdown()
"""


def _child(level: int, mode: str, cache: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(level), mode, cache],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("mode", ["FULL", "TR_HYBRID"])
def test_a_start_from_the_kept_trace_gives_the_traced_starts_tokens(mode, tmp_path):
    cache = str(tmp_path / "cache")
    eager = _child(0, "NONE", cache)
    traced = _child(3, mode, cache)
    loaded = _child(3, mode, cache)
    assert traced["trace_loads"] == 0 and loaded["trace_loads"] == 1
    assert loaded["tokens"] == traced["tokens"] == eager["tokens"]

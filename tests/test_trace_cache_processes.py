"""A kept trace across processes: a warm start never runs a graph that other code or state built.

A cold process (tests/trace_child.py) fills one cache directory; warm processes share it. One warm
process has the cold one's code and builds each model twice: first with the cold one's state (the
control: it must build from the kept trace), then with one thing changed: the value of a module
global `forward` reads, of a class attribute it reads, two parameters tied after construction or
not, other weights, other constructor arguments, or the entry damaged in between. Another warm
process runs a copy of the package whose `LlamaModel.forward` scales the embeddings, first on
`PYTHONPATH`. In every case each warm result equals a level-0 run of that process's own code and
state; where the change matters, it also differs from the cold result, so a warm process that ran
the cold process's graph would fail here.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_compile_models import TINY

TESTS = Path(__file__).parent
CHILD_TIMEOUT_S = 400
PACKAGES = ("runtime", "workers", "compile", "graphs", "distributed")
EDIT = (
    "residual, update = self.embed_tokens(input_ids), None",
    "residual, update = self.embed_tokens(input_ids) * 2.0, None",
)

# name: (the cold process's model, the warm one's change, whether the warm one may use the trace)
SCENARIOS = {
    "module global": (dict(toy="global", tag="g", scale=2.0), dict(scale=3.0), False),
    "class attribute": (dict(toy="class", tag="c", factor=2.0), dict(factor=3.0), False),
    "tied, then untied": (dict(toy="pair", tag="t", tie=True), dict(tie=False), False),
    "untied, then tied": (dict(toy="pair", tag="u", tie=False), dict(tie=True), False),
    "other weights": (dict(toy="global", tag="w", seed=0), dict(seed=1), True),
    "other constructor arguments": (dict(toy="class", tag="k"), dict(width=8), False),
    "damaged entry": (dict(toy="pair", tag="d"), {}, False),
}


def _run(cache: Path, level: int, use_inductor: bool, plan: list, pythonpath: str = "") -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import trace_child; trace_child.main(sys.argv[1:])"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(cache),
            str(level),
            str(int(use_inductor)),
            json.dumps(plan),
        ],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def _edited_copy(root: Path) -> Path:
    """The package's sources copied under `root`, with LlamaModel.forward scaling the embeddings."""
    for name in PACKAGES:
        source = Path(importlib.import_module(f"atomrt.{name}").__path__[0])
        shutil.copytree(
            source, root / "atomrt" / name, ignore=shutil.ignore_patterns("__pycache__")
        )
    llama = root / "atomrt" / "workers" / "models" / "llama.py"
    text = llama.read_text()
    assert EDIT[0] in text
    llama.write_text(text.replace(EDIT[0], EDIT[1]))
    return root


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(False, id="eager-pieces"),
        pytest.param(True, id="inductor", marks=pytest.mark.slow),
    ],
)
def runs(request, tmp_path_factory) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    use_inductor = request.param
    tmp = tmp_path_factory.mktemp("kept_trace")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(tmp / "llama", safe_serialization=True)
    llama = dict(toy="llama", model=str(tmp / "llama"))
    cache = tmp / "cache"
    cold_plan = [dict(cold, name=name) for name, (cold, _, _) in SCENARIOS.items()]
    cold = _run(cache, 3, use_inductor, [*cold_plan, dict(llama, name="llama")])
    assert cold["damaged entry"]["entries_written"]  # what the warm process must meet damaged
    for path in cold["damaged entry"]["entries_written"]:
        Path(path).write_bytes(Path(path).read_bytes()[:64])
    # the damaged entry's first warm build must meet the damage: no control before it
    controls = [
        dict(spec, name=f"{spec['name']} (control)")
        for spec in cold_plan
        if spec["name"] != "damaged entry"
    ]
    changed = [dict(cold, **change, name=name) for name, (cold, change, _) in SCENARIOS.items()]
    warm = _run(cache, 3, use_inductor, [*controls, *changed, dict(llama, name="llama (control)")])
    edited = _run(
        cache,
        3,
        use_inductor,
        [dict(llama, name="llama")],
        pythonpath=str(_edited_copy(tmp / "copy")),
    )
    return {"cold": cold, "warm": warm, "edited": edited}


def _close(a: list, b: list) -> bool:
    pairs = [(torch.tensor(x), torch.tensor(y)) for x, y in zip(a, b)]
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.allclose(x, y, atol=1e-5, rtol=1e-5) for x, y in pairs
    )


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_warm_process_computes_its_own_code_and_state(runs: dict, name: str) -> None:
    cold, changed = runs["cold"][name], runs["warm"][name]
    assert _close(cold["compiled"], cold["eager"])
    assert _close(changed["compiled"], changed["eager"]), "the warm process ran another graph"
    assert changed["trace_loads"] == int(SCENARIOS[name][2])
    if name != "damaged entry":
        control = runs["warm"][f"{name} (control)"]
        assert _close(control["compiled"], control["eager"])
        assert control["trace_loads"] == 1  # the kept trace is used where nothing changed
    if name not in ("untied, then tied", "damaged entry"):
        assert not _close(changed["eager"], cold["eager"])  # the change matters


def test_a_copy_of_the_package_with_another_forward_traces_its_own(runs: dict) -> None:
    cold, control, edited = (
        runs["cold"]["llama"],
        runs["warm"]["llama (control)"],
        runs["edited"]["llama"],
    )
    assert _close(cold["compiled"], cold["eager"])
    assert control["trace_loads"] == 1 and _close(control["compiled"], cold["compiled"])
    assert not _close(edited["eager"], cold["eager"])  # the edit changes the logits
    assert _close(edited["compiled"], edited["eager"]), "the copy ran the first checkout's graph"
    assert edited["trace_loads"] == 0

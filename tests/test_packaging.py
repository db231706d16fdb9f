"""The folder -> package mapping in pyproject.toml lists every package, and the CLI is wired."""

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).parent.parent


def test_every_package_folder_is_listed():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setup["package-dir"]
    folders = {f"atomrt.{top}": top for top in mapping.values()}
    found = set()
    for pkg, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    assert found == set(setup["packages"])
    for folder in mapping.values():  # a folder of modules without __init__.py would not ship
        for module in (ROOT / folder).rglob("*.py"):
            assert (module.parent / "__init__.py").exists(), f"{module.parent} lacks __init__.py"
    assert set(mapping) == {
        f"atomrt.{k}" for k in ("runtime", "workers", "compile", "graphs", "distributed")
    }


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

"""runtime/bytecode_cache.py: a package without bytecode in a folder that takes none gets its
bytecode under <cache root>/pycache, compiled by the first process and read by the next; nothing
changes for a package with bytecode, under PYTHONPYCACHEPREFIX, or with bytecode writing off. Each
case runs in a fresh interpreter (the prefix is process-wide). The folder's writability is given
(these tests run as root, whom no permission bit stops)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atomrt.runtime import bytecode_cache

SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
import bytecode_cache
prefix = bytecode_cache.enable_bytecode_cache(
    "slowpkg", cache_root=sys.argv[3], writable=lambda p: not p.startswith(sys.argv[1])
)
import slowpkg
print(json.dumps({"prefix": prefix, "cached": slowpkg.__cached__, "value": slowpkg.VALUE}))
"""


def _run(tmp_path: Path, **env: str) -> dict:
    """One interpreter: the module's function on `slowpkg` in tmp_path/site (reported read-only),
    then slowpkg's import."""
    module_dir = Path(bytecode_cache.__file__).parent
    args = [sys.executable, "-c", SCRIPT, str(tmp_path / "site"), str(module_dir)]
    args.append(str(tmp_path / "cache"))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | env
    out = subprocess.run(args, capture_output=True, text=True, env=full_env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def site(tmp_path: Path) -> Path:
    pkg = tmp_path / "site" / "slowpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 42\n")
    return pkg


def test_a_read_only_package_without_bytecode_gets_a_cache(site: Path, tmp_path: Path) -> None:
    first = _run(tmp_path)
    prefix = str(tmp_path / "cache" / "pycache")
    assert first["prefix"] == prefix and first["value"] == 42
    assert first["cached"].startswith(prefix) and Path(first["cached"]).exists()
    assert not (site / "__pycache__").exists()  # nothing written beside the source
    second = _run(tmp_path)  # the next process reads what the first compiled
    assert second["cached"] == first["cached"]


def test_nothing_changes_where_python_caches_it_already(site: Path, tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(site)], check=True)
    assert _run(tmp_path)["prefix"] is None  # the package ships its bytecode
    for name in os.listdir(site / "__pycache__"):
        os.remove(site / "__pycache__" / name)
    own = tmp_path / "own"
    assert _run(tmp_path, PYTHONPYCACHEPREFIX=str(own))["prefix"] is None
    assert _run(tmp_path, PYTHONDONTWRITEBYTECODE="1")["prefix"] is None


WIRING = """
import json, sys, types
calls = []
fake = types.ModuleType("atomrt.runtime.bytecode_cache")
fake.enable_bytecode_cache = lambda: calls.append("torch" in sys.modules)
sys.modules[fake.__name__] = fake
import atomrt.workers.kernels.device_info
print(json.dumps({"calls": calls, "torch": "torch" in sys.modules}))
"""


def test_the_first_import_of_any_atomrt_module_enables_it_before_torch() -> None:
    """`import atomrt.<anything>` runs the top-level package first, which calls the function once,
    before the module's own import of torch (here a worker module's)."""
    out = subprocess.run([sys.executable, "-c", WIRING], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"calls": [False], "torch": True}

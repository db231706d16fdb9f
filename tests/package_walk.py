"""The package's modules, for tests that check a rule over every module of a kind."""

import importlib
import pkgutil
from collections.abc import Iterator
from types import ModuleType

PACKAGES = ("workers", "runtime", "compile", "graphs", "distributed")


def modules_mentioning(text: str) -> Iterator[ModuleType]:
    """Every atomrt module whose source contains `text`, imported (the others are not)."""
    for package in PACKAGES:
        root = importlib.import_module(f"atomrt.{package}")
        for info in pkgutil.walk_packages(root.__path__, f"atomrt.{package}."):
            spec = info.module_finder.find_spec(info.name, None)
            if spec is None or not spec.origin or not spec.origin.endswith(".py"):
                continue
            with open(spec.origin, encoding="utf-8") as f:
                if text not in f.read():
                    continue
            yield importlib.import_module(info.name)

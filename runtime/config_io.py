"""Loading a `Config` from YAML and applying command-line overrides.

A YAML file mirrors `Config.to_dict()`:

    model: SmolLM2-135M-Instruct
    enforce_eager: false
    compilation_config: {level: 3, cudagraph_mode: FULL}
    scheduler_config: {max_num_seqs: 64}

Overrides are dotted keys with YAML values: `compilation_config.level=3`,
`compilation_config.cuda_graph_sizes=[64]`. Unknown keys and bad values raise `ConfigError`
naming the key.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import yaml

from atomrt.runtime.config import Config, ConfigError


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: no such file: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {p}: the top level must be a mapping, got {type(data).__name__}"
        )
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], yaml-parsed value)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. compilation_config.level=3")
    key, raw = item.split("=", 1)
    path = [k for k in key.strip().split(".") if k]
    if not path:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(
    data: dict[str, Any], overrides: Iterable[tuple[list[str], Any]]
) -> dict[str, Any]:
    out = copy.deepcopy(data)
    for path, value in overrides:
        node = out
        for k in path[:-1]:
            child = node.get(k)
            if child is None:
                child = node[k] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(path)}: {k} is not a section")
            node = child
        node[path[-1]] = value
    return out


def build_config(
    config_file: Optional[str] = None,
    overrides: Iterable[str] = (),
    base: Optional[dict[str, Any]] = None,
) -> Config:
    """YAML file (if any), then `base` (CLI flags), then `--set` overrides, in that order."""
    data: dict[str, Any] = load_yaml(config_file) if config_file else {}
    if base:
        data = apply_overrides(data, _flatten(base))
    data = apply_overrides(data, (parse_override(o) for o in overrides))
    return Config.from_dict(data)


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def _flatten(d: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[list[str], Any]]:
    items: list[tuple[list[str], Any]] = []
    for k, v in d.items():
        if isinstance(v, dict) and v and k.endswith("_config"):
            items.extend(_flatten(v, prefix + (k,)))
        else:
            items.append((list(prefix + (k,)), v))
    return items

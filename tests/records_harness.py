"""The check every bench test runs on the records its run wrote: each file validates against the
declared JSON Schema (benchmarks/record.schema.json, through jsonschema) and loads through
`load_records`, which checks what a schema cannot (ratios, verdicts)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from atomrt.runtime.bench.records import Record, load_records

SCHEMA = json.loads(
    (Path(__file__).parent.parent / "benchmarks" / "record.schema.json").read_text()
)


def check_records(folder: Path, bench: str) -> list[Record]:
    """The records in `folder`, oldest first, every one of them from `bench`."""
    paths = sorted(folder.glob("*.json"))
    assert paths, f"no record in {folder}"
    for path in paths:
        jsonschema.validate(json.loads(path.read_text()), SCHEMA)
    records = [r for _, r in load_records(folder)]
    assert [r.bench for r in records] == [bench] * len(records)
    return records

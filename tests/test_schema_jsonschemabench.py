"""Real-world schemas from JSONSchemaBench (tests/data/jsonschemabench/, its licence beside them):
each one either compiles and every output validates with `jsonschema` (the schema's own draft,
formats checked), or is refused with an error naming the keyword and its path in the schema (or
saying no value satisfies it); none crashes or hangs. Sampled at temperature 1 on a tiny random
model (its own output is noise: the grammar does all the work). A few per subset by default, all
of them under `-m slow`; the counts are printed."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import jsonschema
import pytest
from grammar_harness import build_tiny_bpe

from atomrt import SamplingParams
from atomrt.runtime.entrypoints.llm import LLM

DATA = Path(__file__).parent / "data" / "jsonschemabench"


# Valid schemas whose grammar takes xgrammar 5-30 s to compile on the CPU machine (dozens of
# optional long strings beside minProperties): in the full run only
SLOW = ("Snowplow/sp_0_Normalized.json", "Github_ultra/o21185.json")


def _schemas(per_subset: int, skip: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    out = []
    for subset in sorted(p for p in DATA.iterdir() if p.is_dir()):
        names = [f"{subset.name}/{f.name}" for f in sorted(subset.glob("*.json"))]
        for name in [n for n in names if n not in skip][:per_subset]:
            out.append((name, json.loads((DATA / name).read_text())))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bpe(tmp_path_factory.mktemp("jsonschemabench") / "model")


def run(model: Path, schemas: list[tuple[str, dict]], max_tokens: int) -> collections.Counter:
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs={"json": s}
        )
        for i, (_, s) in enumerate(schemas)
    ]
    settings = dict(device="cpu", enforce_eager=True, max_num_seqs=64, num_kv_blocks=4096)
    settings["grammar_compile_timeout_s"] = 600  # correctness here, not a busy machine's budget
    with LLM(str(model), **settings) as llm:
        outs = llm.generate(["Answer in JSON."] * len(schemas), params, use_tqdm=False)
    counts: collections.Counter = collections.Counter()
    for (name, schema), out in zip(schemas, outs):
        c = out.outputs[0]
        if out.error is not None:
            keyword = re.search(r"the keyword '([^']+)' at #", out.error)
            assert keyword or "can never be satisfied" in out.error, (name, out.error)
            assert c.finish_reason == "abort" and not c.token_ids, (name, out)
            counts["refused"] += 1
            counts[f"refused: {keyword.group(1) if keyword else 'unsatisfiable'}"] += 1
            continue
        if c.finish_reason == "length":  # cut at max_tokens: not a whole value to check
            counts["compiled"] += 1
            counts["cut"] += 1
            continue
        assert c.finish_reason == "stop", (name, c)
        checker = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
        try:
            value = json.loads(c.text)
            checker(schema, format_checker=checker.FORMAT_CHECKER).validate(value)
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{name}: {c.text[:300]!r}: {str(e)[:500]}") from None
        counts["compiled"] += 1
        counts["valid"] += 1
    print(
        f"\nJSONSchemaBench, {len(schemas)} schemas: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    )
    return counts


def test_a_few_real_world_schemas_of_each_subset(tiny) -> None:
    schemas = _schemas(2, skip=SLOW)
    counts = run(tiny, schemas, 250)
    assert counts["compiled"] + counts["refused"] == len(schemas)
    assert counts["valid"] >= len(schemas) // 4


@pytest.mark.slow
@pytest.mark.timeout(3600)  # about 15 min on an idle 2-core machine
def test_every_kept_real_world_schema(tiny) -> None:
    schemas = _schemas(1000)
    counts = run(tiny, schemas, 400)
    assert counts["compiled"] + counts["refused"] == len(schemas) >= 200

"""Every constrained output is valid: random JSON schemas (objects, arrays, enums, numbers with bounds,
strings with patterns and lengths, nested anyOf), random regexes and random choice lists, sampled at
temperature 1 on a tiny random model (its own output is noise: the grammar does all the work) and on
the embedded SmolLM2-135M; every output parses and validates (jsonschema, `re.fullmatch`) and ends
with its grammar (finish_reason "stop"). Hundreds of cases in CI, more under `-m slow`."""

from __future__ import annotations

import json
import random
import re
import string
from pathlib import Path

import jsonschema
import pytest
from grammar_harness import build_tiny_bpe

from atomrt import SamplingParams
from atomrt.runtime.config import DEFAULT_MODEL
from atomrt.runtime.entrypoints.llm import LLM

PATTERNS = [
    "^[a-z]{1,6}$",
    "^[A-Z][a-z]{0,4}$",
    "^[0-9]{3}-[0-9]{2}$",
    "^(red|green|blue)$",
    "^x?y{1,3}$",
]


def _string(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    lo = rng.randint(0, 3)
    return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 6)}


def _number(rng: random.Random) -> dict:
    lo = rng.randint(-1000, 1000)
    out: dict = {"type": rng.choice(["integer", "number"])}
    if rng.random() < 0.8:
        out["minimum"] = lo
    if rng.random() < 0.8:
        out["maximum"] = lo + rng.randint(0, 2000)
    return out


def _enum(rng: random.Random) -> dict:
    pool = ["a", "b c", 'q"uote', "ünï", 1, 2.5, -3, True, None]
    return {"enum": rng.sample(pool, rng.randint(1, 4))}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    leaves = [_string, _number, _enum, lambda r: {"type": r.choice(["boolean", "null"])}]
    if depth >= 2:
        return rng.choice(leaves)(rng)
    kind = rng.choice(["object", "object", "array", "anyOf", "leaf"])
    if kind == "leaf":
        return rng.choice(leaves)(rng)
    if kind == "array":
        lo = rng.randint(0, 2)
        item = random_schema(rng, depth + 1)
        return {"type": "array", "items": item, "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    names = rng.sample(
        ["id", "name", "age", "tags", "when", "ok", "score", "x y"], rng.randint(1, 4)
    )
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required}


def random_regex(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 4)):
        atom = rng.choice(
            [
                re.escape(rng.choice(string.ascii_letters + string.digits + "-_@.: ")),
                "[a-f]",
                "[0-9]",
                "[A-Z0-9]",
                "(" + "|".join(rng.sample(["ab", "xyz", "42", "q", "hello"], 2)) + ")",
            ]
        )
        lo = rng.randint(0, 2)
        parts.append(atom + rng.choice(["", "?", f"{{{lo},{lo + rng.randint(0, 4)}}}"]))
    return "".join(parts)


def random_choices(rng: random.Random) -> list[str]:
    alphabet = string.ascii_letters + string.digits + ' "\\\n{}é€'
    return list(
        {"".join(rng.choices(alphabet, k=rng.randint(1, 12))) for _ in range(rng.randint(1, 5))}
    )


def cases(seed: int, num: int) -> list[tuple[str, object]]:
    rng = random.Random(seed)
    out: list[tuple[str, object]] = []
    for i in range(num):
        kind = ("json", "json", "regex", "choice")[i % 4]
        value = {"json": random_schema, "regex": random_regex, "choice": random_choices}[kind](rng)
        out.append((kind, value))
    return out


def check(kind: str, value: object, text: str) -> None:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), value)
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{json.dumps(value)}: {text!r}: {e}") from None
    elif kind == "regex":
        assert re.fullmatch(value, text), (value, text)
    else:
        assert text in value, (value, text)


def run(model: str, todo: list[tuple[str, object]], max_tokens: int, **kwargs) -> None:
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs={kind: value}
        )
        for i, (kind, value) in enumerate(todo)
    ]
    settings = dict(device="cpu", enforce_eager=True, max_num_seqs=64, **kwargs)
    with LLM(model, **settings) as llm:
        outs = llm.generate(["Answer in the asked format."] * len(todo), params, use_tqdm=False)
    for (kind, value), out in zip(todo, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (kind, value, c.text)
        check(kind, value, c.text)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bpe(tmp_path_factory.mktemp("random") / "model")


def test_random_constraints_on_a_random_model(tiny) -> None:
    run(str(tiny), cases(0, 240), 400, num_kv_blocks=2048, async_scheduling=True)


@pytest.mark.slow
def test_more_random_constraints_on_a_random_model(tiny) -> None:
    run(str(tiny), cases(1, 1200), 400, num_kv_blocks=2048)


def test_random_constraints_on_the_embedded_model() -> None:
    run(DEFAULT_MODEL, cases(2, 8), 128, num_kv_blocks=512)


@pytest.mark.slow
def test_more_random_constraints_on_the_embedded_model() -> None:
    run(DEFAULT_MODEL, cases(3, 96), 200, num_kv_blocks=1024, async_scheduling=True)

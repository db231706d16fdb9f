"""Random JSON schemas drawn from the keywords the schema walk claims to enforce
(`json_schema.ENFORCED`, and the ones it rewrites into them: `allOf`, disjoint `oneOf`, keywords
beside `$ref` / `anyOf`, `required` outside `properties`, `false` properties, a length beside a
pattern), sampled at temperature 1 on a tiny random model (its own output is noise: the grammar
does all the work): every output validates with `jsonschema` (formats checked too). And random
schemas holding one keyword it does not claim: every request is refused, naming the keyword."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
from grammar_harness import build_tiny_bpe

from atomrt import SamplingParams
from atomrt.runtime.driver.json_schema import ENFORCED, REWRITTEN
from atomrt.runtime.entrypoints.llm import LLM

FORMATS = ["date", "email", "ipv4", "ipv6", "uuid", "date-time", "hostname"]
DRAFT7 = "http://json-schema.org/draft-07/schema#"
NAMES = ["id", "name", "age", "tags", "when", "ok", "score", "x y"]


def _string(rng: random.Random) -> dict:
    pick = rng.random()
    if pick < 0.25:
        return {"type": "string", "format": rng.choice(FORMATS)}
    if pick < 0.5:  # a length beside a pattern of one class: folded into the pattern
        lo = rng.randint(0, 3)
        atom = rng.choice(["[a-z]", "\\d", "[A-F0-9]"])
        return {"type": "string", "pattern": f"^{atom}+$", "maxLength": lo + rng.randint(1, 5)}
    if pick < 0.7:
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,6}$", "^(red|green)$"])}
    lo = rng.randint(0, 3)
    return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 6)}


def _integer(rng: random.Random) -> dict:
    lo = rng.randint(-500, 500)
    out: dict = {"type": "integer"}
    out["exclusiveMinimum" if rng.random() < 0.3 else "minimum"] = lo
    if rng.random() < 0.8:
        out["exclusiveMaximum" if rng.random() < 0.3 else "maximum"] = lo + rng.randint(2, 900)
    if rng.random() < 0.4 and len(out) == 3:  # beside bounds: the enum of its multiples
        out["multipleOf"] = rng.choice([2, 3, 5, 7, 10])
    if rng.random() < 0.1:
        out = {"type": "integer", "multipleOf": rng.choice([3, 4, 9])}
    return out


def _number(rng: random.Random) -> dict:
    lo = rng.uniform(-100, 100)
    out = {"type": "number", "minimum": round(lo, 2)}
    if rng.random() < 0.7:
        out["exclusiveMaximum"] = round(lo + rng.uniform(0.5, 50), 2)
    return out


def _values(rng: random.Random) -> dict:
    pool = ["a", "b c", 'q"uote', "ünï", 1, 2.5, -3, True, None, [1, "x"], {"k": 1}]
    if rng.random() < 0.3:
        return {"const": rng.choice(pool)}
    if rng.random() < 0.3:  # enum beside a type: only the values of that type remain
        return {"type": "string", "enum": ["a", "b", 3, None]}
    return {"enum": rng.sample(pool, rng.randint(1, 4))}


def _leaf(rng: random.Random) -> dict:
    makers = [
        _string,
        _integer,
        _number,
        _values,
        lambda r: {"type": r.choice(["boolean", "null"])},
    ]
    return rng.choice(makers)(rng)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    if depth >= 2:
        return _leaf(rng)
    kind = rng.choice(["object", "object", "array", "tuple", "anyOf", "oneOf", "allOf", "leaf"])
    sub = lambda: random_schema(rng, depth + 1)  # noqa: E731
    if kind == "leaf":
        return _leaf(rng)
    if kind == "array":
        lo = rng.randint(0, 2)
        out = {"type": "array", "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
        if rng.random() < 0.7:
            out["items"] = sub()  # else any JSON value
        out["uniqueItems"] = False
        return out
    if kind == "tuple":
        items = [sub() for _ in range(rng.randint(1, 2))]
        return {"type": "array", "prefixItems": items, "items": rng.choice([False, _leaf(rng)])}
    if kind == "anyOf":  # a keyword beside it holds in every branch
        return {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}, {"type": "string"}]}
    if kind == "oneOf":  # disjoint branches: by type, or by a tag property's const
        if rng.random() < 0.5:
            return {"oneOf": [_string(rng), _integer(rng), {"type": "null"}]}
        return {
            "oneOf": [
                {"properties": {"kind": {"const": t}, "v": sub()}, "required": ["kind", "v"]}
                for t in ("a", "b")
            ]
        }
    if kind == "allOf":
        return {
            "allOf": [
                {"type": "object", "properties": {"a": _leaf(rng)}, "required": ["a"]},
                {"properties": {"b": _leaf(rng)}, "required": ["b"]},
            ]
        }
    names = rng.sample(NAMES, rng.randint(1, 4))
    props = {n: sub() for n in names}
    required = [n for n in names if rng.random() < 0.6]
    out = {"type": "object", "properties": props, "required": required}
    if rng.random() < 0.2:
        out["required"] = required + ["extra"]  # outside properties: any JSON value, required
    if rng.random() < 0.2:
        out["additionalProperties"] = {"type": "integer", "maximum": 9}
        out["maxProperties"] = len(names) + 1
    elif rng.random() < 0.25:  # (beside additionalProperties it is refused: see below)
        out["properties"]["never"] = False
    if rng.random() < 0.2:
        out["minProperties"] = 1
    if rng.random() < 0.15 and "additionalProperties" not in out and len(names) > 1:
        out["dependentRequired"] = {names[0]: [names[1]]}  # present: the other one too
    elif rng.random() < 0.15 and "additionalProperties" not in out and len(names) > 1:
        out["dependentSchemas"] = {names[0]: {"required": [names[1]]}}
        out["unevaluatedProperties"] = False
    if rng.random() < 0.15 and "additionalProperties" not in out:  # on the listed names
        out["patternProperties"] = {"^(x|s)": {}, "^zz": {"type": "null"}}
        out["propertyNames"] = {"maxLength": 5}
    return out


def with_refs(rng: random.Random, schema: dict) -> dict:
    """Sometimes the schema behind a `$ref`, with a sibling keyword beside it; sometimes a draft-7
    tuple (`items` as a list, `additionalItems`) instead."""
    if rng.random() < 0.04:
        props = {"a": _leaf(rng), "b": _leaf(rng)}
        return {"$schema": DRAFT7, "properties": props, "dependencies": {"a": ["b"]}}
    if rng.random() < 0.06:
        items = [_leaf(rng) for _ in range(rng.randint(1, 3))]
        extra = rng.choice([False, _leaf(rng)])
        return {"$schema": DRAFT7, "type": "array", "items": items, "additionalItems": extra}
    if rng.random() < 0.15:
        key = rng.choice(["$defs", "definitions"])
        return {key: {"s": schema}, "$ref": f"#/{key}/s", "title": "t"}
    if rng.random() < 0.1:
        return {
            "$defs": {"n": {"type": "integer"}},
            "$ref": "#/$defs/n",
            "minimum": 3,
            "maximum": 9,
        }
    return schema


def _keywords(schema) -> set:
    found = set()
    if isinstance(schema, dict):
        for k, v in schema.items():
            found.add(k)
            if k not in ("enum", "const", "properties", "$defs", "definitions"):
                found |= _keywords(v)
            elif k in ("properties", "$defs", "definitions"):
                for s in v.values():
                    found |= _keywords(s)
    elif isinstance(schema, list):
        for s in schema:
            found |= _keywords(s)
    return found


def _generate(model: Path, schemas: list, max_tokens: int = 300) -> list:
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs={"json": s}
        )
        for i, s in enumerate(schemas)
    ]
    settings = dict(device="cpu", enforce_eager=True, max_num_seqs=64, num_kv_blocks=2048)
    settings["grammar_compile_timeout_s"] = 300  # all compile at once here: no busy budget
    with LLM(str(model), **settings) as llm:
        return llm.generate(["Answer in JSON."] * len(schemas), params, use_tqdm=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bpe(tmp_path_factory.mktemp("schema-random") / "model")


def test_random_schemas_of_enforced_keywords_give_valid_outputs(tiny) -> None:
    rng = random.Random(0)
    schemas = [with_refs(rng, random_schema(rng)) for _ in range(120)]
    used = set().union(*(_keywords(s) for s in schemas))
    claimed = {k for ks in ENFORCED.values() for k in ks} | set(REWRITTEN)
    assert claimed <= used, claimed - used
    stopped = 0
    for schema, out in zip(schemas, _generate(tiny, schemas)):
        c = out.outputs[0]
        assert out.error is None, (schema, out.error)
        if c.finish_reason == "length":  # cut: not a whole value to check
            continue
        stopped += 1
        checker = jsonschema.validators.validator_for(schema)
        try:
            jsonschema.validate(
                json.loads(c.text), schema, checker, format_checker=checker.FORMAT_CHECKER
            )
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{json.dumps(schema)}: {c.text!r}: {e}") from None
    assert stopped >= 0.8 * len(schemas)


UNCLAIMED = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    ("not", {"not": {"type": "string"}}),
    ("if", {"if": {"type": "integer"}, "then": {"minimum": 3}}),
    ("dependentRequired", {"dependentRequired": {"a": ["b"]}, "additionalProperties": True}),
    ("dependentSchemas", {"dependentSchemas": {"a": {}}, "additionalProperties": {}}),
    ("dependencies", {"dependencies": {"a": ["b"]}, "additionalProperties": True}),
    ("contains", {"type": "array", "contains": {"type": "integer"}}),
    ("propertyNames", {"propertyNames": {"maxLength": 3}, "additionalProperties": True}),
    ("patternProperties", {"patternProperties": {"^x": {}}, "additionalProperties": {}}),
    ("unevaluatedItems", {"type": "array", "unevaluatedItems": False}),
    ("multipleOf", {"type": "number", "multipleOf": 0.25}),
    ("format", {"type": "string", "format": "credit-card"}),
    ("maxLength", {"type": "string", "format": "email", "maxLength": 20}),
    ("minLength", {"type": "string", "pattern": "^(ab|c)+$", "minLength": 3}),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 3}]}),
    ("pattern", {"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}),
]


def test_random_schemas_holding_an_unenforced_keyword_are_refused_by_name(tiny) -> None:
    rng = random.Random(1)
    todo = []
    for i in range(64):
        word, bad = UNCLAIMED[i % len(UNCLAIMED)]
        schema = random_schema(rng, 1)
        where = rng.choice(["root", "property", "items", "anyOf"])
        if where == "root":
            schema = bad
        elif where == "property":
            schema = {"type": "object", "properties": {"p": bad, "q": schema}, "required": ["p"]}
        elif where == "items":
            schema = {"type": "array", "items": bad, "minItems": 1}
        else:
            schema = {"anyOf": [schema, {"type": "object", "properties": {"z": bad}}]}
        todo.append((word, where, schema))
    outs = _generate(tiny, [s for _, _, s in todo], max_tokens=8)
    for (word, where, schema), out in zip(todo, outs):
        assert out.error is not None and f"keyword {word!r} at #" in out.error, (schema, out)
        path = {"root": "at # ", "property": "#/properties/p", "items": "#/items", "anyOf": "/z"}
        assert path[where] in out.error, (where, out.error)
        assert out.outputs[0].finish_reason == "abort" and not out.outputs[0].token_ids

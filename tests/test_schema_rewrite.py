"""The schema walk (runtime/driver/json_schema/) against the grammar the backend builds: each
keyword is enforced exactly after the rewrite, or the schema is refused naming the keyword and its
JSON pointer. The grammar is checked string by string (xgrammar's own acceptance test) and every
accepted string against `jsonschema`, the reference."""

from __future__ import annotations

import json

import jsonschema
import pytest
from xgrammar.testing import _is_grammar_accept_string

from atomrt import SamplingParams
from atomrt.runtime.driver.grammar_compiler import parse


def _grammar(schema):
    so = SamplingParams(structured_outputs={"json": schema}).structured_outputs
    return parse(so)


def _check(schema, accepted, refused) -> None:
    """`accepted` strings are in the grammar (and valid), `refused` are not (and are invalid: the
    grammar refuses nothing the schema allows among these)."""
    grammar = _grammar(schema)
    for text in accepted:
        jsonschema.validate(json.loads(text), schema, jsonschema.validators.validator_for(schema))
        assert _is_grammar_accept_string(grammar, text), (schema, text)
    for text in refused:
        assert not _is_grammar_accept_string(grammar, text), (schema, text)
        checker = jsonschema.validators.validator_for(schema)
        assert not checker(schema).is_valid(json.loads(text)), text


def _refused(schema, *words) -> str:
    with pytest.raises(ValueError) as e:
        _grammar(schema)
    for w in words:
        assert w in str(e.value), (schema, str(e.value))
    return str(e.value)


def test_required_names_outside_properties_are_required() -> None:
    for extra in ({}, {"additionalProperties": True}):
        _check({"type": "object", "required": ["zz"], **extra}, ['{"zz": 1}', '{"zz": {}}'], ["{}"])
    held = {"type": "object", "required": ["n"], "additionalProperties": {"type": "integer"}}
    _check(held, ['{"n": 3}'], ["{}", '{"n": "x"}'])
    _refused(
        {"type": "object", "required": ["n"], "additionalProperties": False},
        "can never be satisfied",
        "#/required",
    )


def test_keywords_beside_anyof_ref_and_allof_are_enforced() -> None:
    both = {"type": "integer", "anyOf": [{"minimum": 3}, {"type": "string"}, {"maximum": -5}]}
    _check(both, ["3", "70", "-5"], ['","', "null", "[-2]", '"x"', "0"])
    ref = {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "enum": ["x", "y", 3]}
    _check(ref, ['"x"', '"y"'], ['"z"', "3"])
    all_of = {"type": "integer", "maximum": 5, "allOf": [{"minimum": 3}]}
    _check(all_of, ["3", "5"], ["7134", "2", "6"])
    parts = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"enum": ["u", "v"]}}, "required": ["b"]},
        ]
    }
    _check(parts, ['{"a": 1, "b": "u"}'], ['{"a": 1}', '{"b": "u"}', '{"a": 1, "b": "w"}'])
    tool = {  # a tool's parameters: the same walk
        "type": "object",
        "properties": {"n": {"type": "integer", "anyOf": [{"minimum": 10}]}},
        "required": ["n"],
    }
    _check(tool, ['{"n": 10}'], ['{"n": 9}'])
    _refused({"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]}, "'pattern' at #")


def test_integer_multiple_of_is_enforced_or_refused() -> None:
    _check(
        {"type": "integer", "multipleOf": 3, "minimum": -10, "maximum": 10},
        ["-9", "0", "9"],
        ["-10", "4", "12"],
    )
    _check({"type": "integer", "multipleOf": 1.0, "minimum": 1.5}, ["2"], ["1"])
    _refused({"type": "number", "multipleOf": 0.5}, "'multipleOf' at #", "integers only")
    _refused({"type": "integer", "multipleOf": 4096}, "'multipleOf' at #")
    _refused({"properties": {"x": {"type": "integer", "multipleOf": 0.5}}}, "#/properties/x")


def test_a_schema_holding_a_set_is_a_value_error_naming_where() -> None:
    from atomrt.runtime.driver.grammar_compiler import cache_key

    so = SamplingParams(structured_outputs={"json": {"enum": {1, 2}}}).structured_outputs
    with pytest.raises(ValueError, match=r"structured_outputs.json: #/enum is a set.*use a list"):
        cache_key(so)


def test_satisfiable_arrays_and_objects_compile() -> None:
    _check({"type": "array", "minItems": 1}, ["[1]", '[{"a": 2}, "x"]'], ["[]"])
    _check(
        {"type": "object", "properties": {"a": False, "b": {"type": "integer"}}},
        ["{}", '{"b": 1}'],
        ['{"a": 1}'],
    )
    _refused(
        {"type": "object", "properties": {"a": False}, "required": ["a"]}, "can never be satisfied"
    )
    _check({"type": "object", "minProperties": 1}, ['{"a": 1}', '{"x": [], "y": null}'], ["{}"])


def test_one_of_is_enforced_where_disjoint_and_refused_where_it_may_overlap() -> None:
    _refused(
        {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]},
        "'oneOf' at #",
    )
    _check({"oneOf": [{"type": "integer"}, {"type": "string"}]}, ["1", '"a"'], ["null"])
    tagged = {
        "oneOf": [
            {"properties": {"k": {"const": "a"}, "n": {"type": "integer"}}, "required": ["k"]},
            {"properties": {"k": {"const": "b"}, "s": {"type": "string"}}, "required": ["k"]},
        ]
    }
    _check(tagged, ['{"k": "a", "n": 1}', '{"k": "b"}'], ['{"k": "c"}'])


def test_a_length_beside_a_pattern_is_folded_into_it_or_refused() -> None:
    _check({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, ['"abc"', '"a"'], ['"abcd"'])
    _check({"type": "string", "pattern": "^\\d{2,8}$", "minLength": 4}, ['"1234"'], ['"123"'])
    _refused(
        {"type": "string", "pattern": "^(ab)+$", "maxLength": 4},
        "'maxLength' at # beside 'pattern'",
    )
    _refused({"type": "string", "format": "email", "maxLength": 9}, "'maxLength' at #")


def test_unenforced_keywords_are_refused_with_their_path() -> None:
    for schema, words in (
        ({"properties": {"a": {"type": "array", "uniqueItems": True}}}, "'uniqueItems' at #/prop"),
        ({"$defs": {"d": {"not": {"type": "string"}}}, "$ref": "#/$defs/d"}, "'not' at #/$defs/d"),
        (
            {"type": "object", "patternProperties": {"^x": {}}, "additionalProperties": True},
            "'patternProperties' at #",
        ),
        ({"type": "string", "format": "phone"}, "'format' at #"),
        ({"items": {"anyOf": [{"type": "array", "contains": {}}]}}, "#/items/anyOf/0"),
    ):
        msg = _refused(schema, words)
        assert msg.startswith("structured_outputs.json: the keyword")
    from atomrt.runtime.driver.json_schema import prepare_schema

    assert prepare_schema({"type": "string", "x-extension": 1}) == {
        "type": "string",
        "x-extension": 1,
    }


def test_pattern_properties_and_property_names_hold_on_the_listed_properties() -> None:
    schema = {
        "type": "object",
        "properties": {"xa": {"type": ["integer", "string"]}, "long": {"type": "integer"}},
        "patternProperties": {"^x": {"type": "integer"}},
        "propertyNames": {"maxLength": 3},
    }
    _check(schema, ['{"xa": 1}', "{}"], ['{"xa": "s"}', '{"long": 1}'])
    _refused({**schema, "required": ["long"]}, "can never be satisfied")


def test_dependencies_hold_as_a_choice_of_absent_or_present_with_what_they_ask() -> None:
    props = {"a": {"type": "integer"}, "b": {"type": "string"}}
    _check(
        {"type": "object", "properties": props, "dependentRequired": {"a": ["b"]}},
        ['{"b": "x"}', '{"a": 1, "b": "x"}', "{}"],
        ['{"a": 1}'],
    )
    _check(
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": props,
            "dependencies": {"b": {"required": ["a"]}},
        },
        ['{"a": 1, "b": "x"}', '{"a": 1}'],
        ['{"b": "x"}'],
    )
    _refused(
        {"dependentRequired": {"a": ["b"]}, "additionalProperties": True},
        "'dependentRequired' at #",
    )

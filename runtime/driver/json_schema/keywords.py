"""The schema keywords by what the backend does with them (`ENFORCED`, `REWRITTEN`,
`UNENFORCED`), the families they belong to, and the refusals (`SchemaRefused`, naming the keyword
and its JSON pointer)."""

from __future__ import annotations

import math
from typing import Any, Optional


class SchemaRefused(ValueError):
    """A schema keyword the grammar cannot enforce (or a schema no value satisfies)."""

    def __init__(self, message: str, keyword: Optional[str] = None, path: str = "#") -> None:
        super().__init__(message)
        self.keyword = keyword
        self.path = path


# What reaches the backend, by the type of value it constrains; each is enforced exactly (the tests
# draw random schemas from these lists and check every output with `jsonschema`).
ENFORCED: dict[str, tuple[str, ...]] = {
    "any": ("type", "enum", "const", "$ref", "anyOf", "$defs", "definitions"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "integer": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
    "object": ("properties", "required", "additionalProperties", "minProperties", "maxProperties"),
}
# Rewritten into the above where exact (the package docstring), else refused by name.
REWRITTEN = (
    "allOf",
    "oneOf",
    "additionalItems",
    "unevaluatedProperties",
    "uniqueItems",
    "patternProperties",
    "propertyNames",
    *("dependencies", "dependentRequired", "dependentSchemas"),
)
# The JSON Schema assertion keywords (drafts 4 to 2020-12) the backend does not enforce.
UNENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "unevaluatedItems",
    "$dynamicRef",
    "$recursiveRef",
)
FAMILY = {
    "minimum": "number",
    "maximum": "number",
    "exclusiveMinimum": "number",
    "exclusiveMaximum": "number",
    "multipleOf": "number",
    "minLength": "string",
    "maxLength": "string",
    "pattern": "string",
    "format": "string",
    "items": "array",
    "prefixItems": "array",
    "additionalItems": "array",
    "minItems": "array",
    "maxItems": "array",
    "uniqueItems": "array",
    "contains": "array",
    "minContains": "array",
    "maxContains": "array",
    "unevaluatedItems": "array",
    "properties": "object",
    "required": "object",
    "additionalProperties": "object",
    "minProperties": "object",
    "maxProperties": "object",
    "patternProperties": "object",
    "propertyNames": "object",
    "dependencies": "object",
    "dependentRequired": "object",
    "dependentSchemas": "object",
    "unevaluatedProperties": "object",
}
DEPENDENCIES = ("dependencies", "dependentRequired", "dependentSchemas")
TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
APPLICATORS = ("$ref", "allOf", "anyOf", "oneOf")
CONTAINERS = ("$defs", "definitions")
ASSERTIONS = frozenset(FAMILY) | {"type", "enum", "const", *APPLICATORS, *UNENFORCED}
LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
MAX_BRANCHES = 64  # an anyOf that merging would multiply past this is refused
MAX_DEPTH = 64  # nesting (and $ref inlining) deeper than this is refused


def refuse(path: str, keyword: str, why: str = "") -> SchemaRefused:
    text = why or "cannot be enforced while decoding; remove it (and check it on the output)"
    return SchemaRefused(f"the keyword {keyword!r} at {path} {text}", keyword, path)


def never(path: str, why: str) -> SchemaRefused:
    return SchemaRefused(f"the schema at {path} can never be satisfied: {why}", None, path)


def ptr(path: str, *parts: Any) -> str:
    for p in parts:
        path += "/" + str(p).replace("~", "~0").replace("/", "~1")
    return path


def asserts(node: dict) -> bool:
    """Whether `node` has a keyword that constrains values (beyond annotations)."""
    return any(k in ASSERTIONS for k in node)


# ------------------------------------------------------------------------------ plain JSON values


def check_json_values(value: Any, path: str = "#") -> None:
    """A ValueError naming where `value` holds something JSON has no form for (a set, bytes, a
    NaN, a non-string key)."""
    if value is None or isinstance(value, (bool, str, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path} is {value!r}, which JSON cannot hold")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{path} has the key {k!r}: JSON object keys are strings")
            check_json_values(v, ptr(path, k))
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json_values(v, ptr(path, i))
        return
    kind = type(value).__name__
    hint = "; use a list" if isinstance(value, (set, frozenset)) else ""
    raise ValueError(f"{path} is a {kind}, which is not a JSON value{hint}")

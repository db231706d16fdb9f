"""A JSON schema as the grammar backend can enforce it exactly, or a ValueError naming the keyword.

xgrammar turns a schema into a grammar, but it drops or approximates some keywords: it takes the
first of `$ref` / `const` / `enum` / `anyOf` / `oneOf` / `allOf` and ignores the keywords beside
it, enforces `oneOf` as `anyOf` where branches may overlap, keeps a `pattern` and drops a length
beside it, and leaves many keywords unenforced. `prepare_schema` walks the schema first
(`ENFORCED` is the list of what reaches the backend) and either rewrites it into a schema whose
every keyword the backend enforces exactly, or refuses it (`SchemaRefused`, naming the keyword and
its JSON pointer in the schema). The rewrites:

- keywords beside `$ref`, `allOf`, `anyOf` and `oneOf` are merged into the referenced schema or
  into each branch (`allOf` branches into one schema), where the merge is exact: bounds take the
  tighter value, `type` and `enum` intersect, `required` unites, properties merge by name; two
  different `pattern`s or `prefixItems` do not merge (refused);
- `oneOf` becomes `anyOf` only where its branches are provably disjoint (types that share no
  value, `enum` / `const` sets that share none, or a required property whose `const` / `enum`
  values differ between branches); otherwise it is refused, never approximated;
- `enum` / `const` beside other keywords keeps only the values those keywords accept;
- a `required` name that `properties` does not list becomes a property of any JSON value (or of
  the `additionalProperties` schema); a property whose schema is `false` and that is not required
  is dropped where no other property is allowed;
- an array with `minItems` and no `items` gets items of any JSON value, an object with more
  `minProperties` than it lists properties of any JSON value beside them;
- `patternProperties` and `propertyNames` apply to the listed properties where no other property
  is generated (no `additionalProperties`): a listed name a pattern matches gets its schema too, a
  name `propertyNames` refuses cannot appear;
- `dependentRequired` / `dependentSchemas` / `dependencies` become an `anyOf` per property:
  absent, or present with what it asks (where only the listed properties are generated);
- a string length beside a `pattern` of one repeated character class is folded into the pattern;
  a string length without a pattern stays the backend's length rule, made JSON-safe
  (runtime/driver/xgrammar_backend.py);
- the formats `ipv4`, `date` and `date-time` become exact patterns (xgrammar's allow leading
  zeros and the 31st of February);
- an integer's bounds become inclusive integers (fractional ones rounded inward), its
  `multipleOf` beside bounds the `enum` of the multiples between them; draft-4's boolean `exclusiveMinimum` /
  `exclusiveMaximum` become the numeric form; `items` as a list becomes `prefixItems`;
- a schema without `type` whose keywords belong to one kind of value (`minimum`: numbers) takes
  that type, and a list of types becomes an `anyOf` of one type each.

Keywords outside the JSON Schema vocabulary (`x-...`, `javaType`, ...) are annotations to every
validator and are left as they are. Pure Python on the compile threads
(runtime/driver/grammar_compiler.py): never on the event loop or the step loop.
"""

from __future__ import annotations

from typing import Any

from atomrt.runtime.driver.json_schema.keywords import (
    CONTAINERS,
    ENFORCED,
    REWRITTEN,
    UNENFORCED,
    SchemaRefused,
    check_json_values,
    never,
    ptr,
)
from atomrt.runtime.driver.json_schema.walk import Walk

__all__ = [
    "ENFORCED",
    "REWRITTEN",
    "UNENFORCED",
    "SchemaRefused",
    "check_json_values",
    "prepare_schema",
]


def prepare_schema(schema: Any) -> Any:
    """`schema` (parsed JSON) rewritten so the backend enforces every keyword exactly; a
    `SchemaRefused` (a ValueError) naming the keyword and its JSON pointer otherwise."""
    check_json_values(schema)
    if schema is True or schema == {}:
        return {}
    if schema is False:
        raise never("#", "the schema is `false`")
    if not isinstance(schema, dict):
        raise SchemaRefused("the schema must be an object or a boolean")
    walk = Walk(schema)
    defs = {}
    for key in CONTAINERS:
        if isinstance(schema.get(key), dict):
            defs[key] = {
                name: walk.node(sub, ptr("#", key, name)) if sub is not False else False
                for name, sub in schema[key].items()
            }
    body = walk.node({k: v for k, v in schema.items() if k not in CONTAINERS}, "#")
    return {**body, **defs}

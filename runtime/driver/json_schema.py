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
  (runtime/driver/grammar_compiler.py);
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

import json
import math
import re
from typing import Any, Optional
from urllib.parse import unquote

__all__ = ["ENFORCED", "SchemaRefused", "check_json_values", "prepare_schema"]


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
# Rewritten into the above where exact (module docstring), else refused by name.
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
# String formats the backend enforces (xgrammar's built-in patterns).
FORMATS = (
    "date",
    "date-time",
    "time",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "uuid",
    "uri",
    "uri-reference",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
)
# Formats whose backend pattern is looser than the format (leading zeros in an address, the 31st
# of February): these patterns instead, exact.
_BYTE = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_YEAR = r"(000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d\d\d)"
_LEAP = r"(\d\d(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"
_DATE = (
    rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)"
    rf"|02-(0[1-9]|1\d|2[0-8]))|{_LEAP}-02-29)"
)
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
FORMAT_PATTERNS = {
    "ipv4": rf"^({_BYTE}\.){{3}}{_BYTE}$",
    "date": rf"^{_DATE}$",
    "date-time": rf"^{_DATE}T{_TIME}$",
}
INTEGER_MULTIPLE_OF_MAX = 1024  # xgrammar ignores (with a warning) an integer multipleOf above it
MAX_ENUM = 1024  # an integer multipleOf beside bounds becomes the enum of at most this many values
INTEGER_LIMIT = 2**53  # integer bounds past it are tightened to it (exact as a double)

_FAMILY = {
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
_DEPENDENCIES = ("dependencies", "dependentRequired", "dependentSchemas")
_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
_APPLICATORS = ("$ref", "allOf", "anyOf", "oneOf")
_CONTAINERS = ("$defs", "definitions")
_ASSERTIONS = frozenset(_FAMILY) | {"type", "enum", "const", *_APPLICATORS, *UNENFORCED}
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
MAX_BRANCHES = 64  # an anyOf that merging would multiply past this is refused
MAX_DEPTH = 64  # nesting (and $ref inlining) deeper than this is refused

# A pattern of one repeated character class (a length bound folds into it exactly)
_ONE_CLASS = re.compile(
    r"^\^?(?P<atom>\[(?:\\.|[^\]\\])+\]|\\[dwDW]|[A-Za-z0-9_ -])"
    r"(?P<quant>\*|\+|\?|\{\d+\}|\{\d+,\d*\})?\$?$"
)


def refuse(path: str, keyword: str, why: str = "") -> SchemaRefused:
    text = why or "cannot be enforced while decoding; remove it (and check it on the output)"
    return SchemaRefused(f"the keyword {keyword!r} at {path} {text}", keyword, path)


def never(path: str, why: str) -> SchemaRefused:
    return SchemaRefused(f"the schema at {path} can never be satisfied: {why}", None, path)


def _ptr(path: str, *parts: Any) -> str:
    for p in parts:
        path += "/" + str(p).replace("~", "~0").replace("/", "~1")
    return path


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
            check_json_values(v, _ptr(path, k))
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json_values(v, _ptr(path, i))
        return
    kind = type(value).__name__
    hint = "; use a list" if isinstance(value, (set, frozenset)) else ""
    raise ValueError(f"{path} is a {kind}, which is not a JSON value{hint}")


# ------------------------------------------------------------------------------ the walk


class _Walk:
    def __init__(self, root: Any) -> None:
        self.root = root

    # ---- references

    def resolve(self, ref: Any, path: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise refuse(path, "$ref", "must point inside this schema ('#/...')")
        node = self.root
        for raw in ref[1:].split("/")[1:] if ref != "#" else []:
            key = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                raise refuse(path, "$ref", f"points at {ref!r}, which this schema does not have")
        return node

    @staticmethod
    def kept_ref(ref: Any) -> bool:
        """A reference the backend resolves itself (into the root's definitions, or the root)."""
        return isinstance(ref, str) and (
            ref == "#" or re.fullmatch(r"#/(\$defs|definitions)/[^/]+", ref) is not None
        )

    # ---- one node to a flat form: no allOf, no $ref beside other keywords, no oneOf

    def flat(self, node: Any, path: str, depth: int = 0) -> dict:
        """`node` without `allOf`, with no keyword beside a `$ref`, and `oneOf` as `anyOf` (or
        refused); `False` raises (no value)."""
        if depth > MAX_DEPTH:
            raise refuse(path, "$ref", "nests too deep to merge (a recursive reference?)")
        if node is True:
            return {}
        if node is False:
            raise never(path, "the schema is `false`")
        if not isinstance(node, dict):
            raise SchemaRefused(f"the schema at {path} must be an object or a boolean", None, path)
        node = _draft4(dict(node), path)
        if "items" in node and isinstance(node["items"], list):  # the tuple form
            node["prefixItems"] = node.pop("items")
            extra = node.pop("additionalItems", True)
            node["items"] = extra
        elif "additionalItems" in node:
            node.pop("additionalItems")  # without a tuple it applies to nothing
        if "$ref" in node:
            ref = node["$ref"]
            rest = {k: v for k, v in node.items() if k != "$ref"}
            if self.kept_ref(ref) and not _asserts(rest):
                return node
            target = self.flat(self.resolve(ref, path), path, depth + 1)
            node = self.merge(target, self.flat(rest, path, depth + 1), path, depth + 1)
        if "allOf" in node:
            branches = node.pop("allOf")
            if not isinstance(branches, list) or not branches:
                raise refuse(path, "allOf", "must be a non-empty list")
            node = self.flat(node, path, depth + 1)
            for i, b in enumerate(branches):
                node = self.merge(
                    node, self.flat(b, _ptr(path, "allOf", i), depth + 1), path, depth
                )
        if any(k in node for k in _DEPENDENCIES):
            node = self.dependencies(node, path, depth)
        if "oneOf" in node:
            node = self.one_of(node, path, depth)
        if "anyOf" in node and _asserts({k: v for k, v in node.items() if k != "anyOf"}):
            node = self.spread(node, path, depth)
        return node

    def dependencies(self, node: dict, path: str, depth: int) -> dict:
        """`dependentRequired` / `dependentSchemas` / `dependencies` (a property's presence asks
        for more) as an `anyOf` per property: absent (where only the listed properties are
        generated, leaving it out of `properties` forbids it), or present with what it asks."""
        if node.get("additionalProperties", None) not in (None, False):
            key = next(k for k in _DEPENDENCIES if k in node)
            raise refuse(path, key, "beside 'additionalProperties' cannot be enforced")
        rules: list[tuple[str, Any, str]] = []
        for key in _DEPENDENCIES:
            deps = node.pop(key, None)
            if deps is None:
                continue
            if not isinstance(deps, dict):
                raise refuse(path, key, "must be an object")
            rules += [(name, then, key) for name, then in deps.items()]
        for name, then, key in rules:
            at = _ptr(path, key, name)
            if then is True or then == []:
                continue
            if isinstance(then, list):
                if not all(isinstance(n, str) for n in then):
                    raise refuse(at, key, "must list property names")
                present: Any = {"required": [name, *then]}
            elif then is False:
                present = None
            else:
                present = self.merge({"required": [name]}, self.flat(then, at, depth + 1), at)
            absent = {"properties": {name: False}}
            node = self.merge(
                node, {"anyOf": [absent] + ([present] if present is not None else [])}, path, depth
            )
        return node

    def one_of(self, node: dict, path: str, depth: int) -> dict:
        branches = node.pop("oneOf")
        if not isinstance(branches, list) or not branches:
            raise refuse(path, "oneOf", "must be a non-empty list")
        flat = []
        for i, b in enumerate(branches):
            try:
                flat.append(self.flat(b, _ptr(path, "oneOf", i), depth + 1))
            except SchemaRefused as e:
                if e.keyword is not None:
                    raise
                flat.append(None)  # a branch no value satisfies: never the one that matches
        live = [b for b in flat if b is not None]
        if not live:
            raise never(path, "no branch of 'oneOf' can be satisfied")
        rest = dict(node)  # anyOf beside oneOf too: both hold
        merged = []
        for b in live:
            try:
                merged.append(self.merge(rest, b, path, depth))
            except SchemaRefused as e:
                if e.keyword is not None:
                    raise
        if not merged:
            raise never(path, "no branch of 'oneOf' can be satisfied")
        for i in range(len(merged)):
            for j in range(i):
                if not self.disjoint(merged[i], merged[j]):
                    raise refuse(
                        path,
                        "oneOf",
                        "has branches a value may match together (exactly one must match); "
                        "make them disjoint (different types, or a required property with "
                        "different 'const' values) or use 'anyOf'",
                    )
        keep = {k: v for k, v in node.items() if not _asserts({k: v})}
        return {**keep, "anyOf": merged} if len(merged) > 1 else {**keep, **merged[0]}

    def spread(self, node: dict, path: str, depth: int) -> dict:
        """`anyOf` with other keywords beside it: those merged into each branch."""
        branches = node["anyOf"]
        if not isinstance(branches, list) or not branches:
            raise refuse(path, "anyOf", "must be a non-empty list")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        keep = {k: v for k, v in rest.items() if not _asserts({k: v})}
        out = []
        for i, b in enumerate(branches):
            try:
                out.append(
                    self.merge(rest, self.flat(b, _ptr(path, "anyOf", i), depth + 1), path, depth)
                )
            except SchemaRefused as e:
                if e.keyword is not None:
                    raise
        if not out:
            raise never(path, "no branch of 'anyOf' can be satisfied beside its sibling keywords")
        return {**keep, "anyOf": out} if len(out) > 1 else {**keep, **out[0]}

    # ---- merging two flat schemas into one that holds exactly where both hold

    def merge(self, a: dict, b: dict, path: str, depth: int = 0) -> dict:
        if depth > MAX_DEPTH:
            raise refuse(path, "allOf", "nests too deep to merge")
        a = self.flat(a, path, depth + 1) if any(k in a for k in _APPLICATORS[:2]) else a
        b = self.flat(b, path, depth + 1) if any(k in b for k in _APPLICATORS[:2]) else b
        for x, y in ((a, b), (b, a)):
            if "$ref" in x:  # a lone reference: merge with what it points at
                target = self.flat(self.resolve(x["$ref"], path), path, depth + 1)
                rest = {k: v for k, v in x.items() if k != "$ref"}
                return self.merge(self.merge(target, rest, path, depth + 1), y, path, depth + 1)
        if "anyOf" in a or "anyOf" in b:
            return self.merge_any(a, b, path, depth)
        out = dict(a)
        for k, v in b.items():
            if k not in out:
                out[k] = v
            elif out[k] == v and k not in ("properties", "additionalProperties"):
                continue
            elif k == "type":
                out[k] = _meet_types(out[k], v, path)
            elif k in ("enum", "const"):
                continue  # below
            elif k in _LOWER:
                out[k] = max(out[k], v)
            elif k in _UPPER:
                out[k] = min(out[k], v)
            elif k == "required":
                out[k] = list(dict.fromkeys(list(out[k]) + list(v)))
            elif k == "multipleOf" and all(_is_int(x) for x in (out[k], v)):
                out[k] = math.lcm(int(out[k]), int(v))
            elif k in ("items", "additionalProperties", "unevaluatedProperties"):
                out[k] = self.merge_sub(out[k], v, _ptr(path, k), depth)
            elif k == "properties":
                continue  # below
            elif k in ("$defs", "definitions", "$schema", "$id", "id", "$comment"):
                continue
            elif k in _ASSERTIONS:
                raise refuse(path, k, f"has two different values to merge ({out[k]!r}, {v!r})")
            # annotations: the first one's
        if "enum" in a or "const" in a or "enum" in b or "const" in b:
            values = None
            for x in (a, b):
                for k in ("enum", "const"):
                    if k in x:
                        mine = x[k] if k == "enum" else [x[k]]
                        values = mine if values is None else [v for v in values if _in(v, mine)]
            out.pop("const", None)
            out["enum"] = values
            if not values:
                raise never(path, "'enum' / 'const' values that the other keywords refuse")
        if "properties" in a or "properties" in b:
            out["properties"] = self.merge_properties(a, b, path, depth)
        return out

    def merge_sub(self, x: Any, y: Any, path: str, depth: int) -> Any:
        if x is False or y is False:
            return False
        if x is True or x == {}:
            return y
        if y is True or y == {}:
            return x
        return self.merge(self.flat(x, path, depth + 1), self.flat(y, path, depth + 1), path, depth)

    def merge_properties(self, a: dict, b: dict, path: str, depth: int) -> dict:
        pa, pb = a.get("properties", {}), b.get("properties", {})
        if not isinstance(pa, dict) or not isinstance(pb, dict):
            raise refuse(path, "properties", "must be an object")
        out = {}
        for name in list(dict.fromkeys([*pa, *pb])):
            # a name one side does not list must satisfy that side's additionalProperties
            x = pa.get(name, a.get("additionalProperties", True))
            y = pb.get(name, b.get("additionalProperties", True))
            try:
                out[name] = self.merge_sub(x, y, _ptr(path, "properties", name), depth)
            except SchemaRefused as e:
                if e.keyword is not None:
                    raise
                out[name] = False  # no value: the property cannot appear
        return out

    def merge_any(self, a: dict, b: dict, path: str, depth: int) -> dict:
        xs = a.get("anyOf", [a])
        ys = b.get("anyOf", [b])
        if len(xs) * len(ys) > MAX_BRANCHES:
            raise refuse(path, "anyOf", f"would merge into over {MAX_BRANCHES} branches")
        base_a = {k: v for k, v in a.items() if k != "anyOf"} if "anyOf" in a else {}
        base_b = {k: v for k, v in b.items() if k != "anyOf"} if "anyOf" in b else {}
        out = []
        for i, x in enumerate(xs):
            for y in ys:
                try:
                    fx = self.merge(
                        base_a, self.flat(x, _ptr(path, "anyOf", i), depth + 1), path, depth + 1
                    )
                    fy = self.merge(base_b, self.flat(y, path, depth + 1), path, depth + 1)
                    out.append(self.merge(fx, fy, path, depth + 1))
                except SchemaRefused as e:
                    if e.keyword is not None:
                        raise
        if not out:
            raise never(path, "no branch of 'anyOf' can be satisfied beside the other keywords")
        return {"anyOf": out} if len(out) > 1 else out[0]

    # ---- oneOf: branches no value matches together

    def disjoint(self, x: dict, y: dict) -> bool:
        if "anyOf" in x:
            return all(self.disjoint(b, y) for b in x["anyOf"])
        if "anyOf" in y:
            return all(self.disjoint(x, b) for b in y["anyOf"])
        tx, ty = _types_of(x), _types_of(y)
        if tx is not None and ty is not None and not (_widen(tx) & _widen(ty)):
            return True
        vx, vy = _values_of(x), _values_of(y)
        if vx is not None and vy is not None and not any(_in(v, vy) for v in vx):
            return True
        if vx is not None and ty is not None and not any(_type_of(v) & _widen(ty) for v in vx):
            return True
        if vy is not None and tx is not None and not any(_type_of(v) & _widen(tx) for v in vy):
            return True
        px, py = x.get("properties", {}), y.get("properties", {})
        both = set(x.get("required", ())) & set(y.get("required", ()))
        for name in both:
            sx, sy = px.get(name), py.get(name)
            if isinstance(sx, dict) and isinstance(sy, dict):
                ax, ay = _values_of(sx), _values_of(sy)
                if ax is not None and ay is not None and not any(_in(v, ay) for v in ax):
                    return True
        return False

    # ---- the whole schema, node by node

    def node(self, raw: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise SchemaRefused(f"the schema at {path} nests deeper than {MAX_DEPTH}", None, path)
        node = self.flat(raw, path, depth)
        if "$ref" in node:
            return node  # a lone reference into the definitions (walked there)
        if "anyOf" in node:
            out = {k: v for k, v in node.items() if not _asserts({k: v})}
            branches = []
            for i, b in enumerate(node["anyOf"]):
                try:
                    branches.append(self.node(b, _ptr(path, "anyOf", i), depth + 1))
                except SchemaRefused as e:
                    if e.keyword is not None:
                        raise
            if not branches:
                raise never(path, "no branch of 'anyOf' can be satisfied")
            out["anyOf"] = branches
            return out
        if "enum" in node or "const" in node:
            return self.values(node, path)
        types = node.get("type")
        if types is None:
            families = sorted({_FAMILY[k] for k in node if k in _FAMILY})
            if not families:
                return self.checked(node, None, path, depth)
            types = families
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types or not all(t in _TYPES for t in types):
            raise refuse(path, "type", f"must be one of {', '.join(_TYPES)} or a list of them")
        types = list(dict.fromkeys(types))
        if "number" in types and "integer" in types:
            types.remove("integer")
        if len(types) == 1:
            return self.checked({**node, "type": types[0]}, types[0], path, depth)
        keep = {k: v for k, v in node.items() if not _asserts({k: v})}
        keep["anyOf"] = [
            self.checked(
                {"type": t, **{k: v for k, v in node.items() if _FAMILY.get(k) == _family(t)}},
                t,
                path,
                depth,
            )
            for t in types
        ]
        return keep

    def values(self, node: dict, path: str) -> dict:
        """`enum` / `const` with other keywords beside: the values those keywords accept."""
        values = node["enum"] if "enum" in node else [node["const"]]
        if not isinstance(values, list) or not values:
            raise refuse(path, "enum", "must be a non-empty list")
        keep = {k: v for k, v in node.items() if not _asserts({k: v})}
        rest = {k: v for k, v in node.items() if _asserts({k: v}) and k not in ("enum", "const")}
        if rest:
            if _has_ref(rest):
                raise refuse(path, "enum", "beside a '$ref' cannot be checked; inline the schema")
            import jsonschema

            rest_checker = jsonschema.Draft202012Validator({**rest, "$defs": {}})
            values = [v for v in values if rest_checker.is_valid(v)]
            if not values:
                raise never(path, "no value of 'enum' / 'const' passes the keywords beside it")
        return {**keep, "enum": values}

    def checked(self, node: dict, kind: Optional[str], path: str, depth: int) -> dict:
        """One node of one type (or of any type): every keyword enforced, its subschemas walked."""
        out: dict = {}
        allowed = set(ENFORCED["any"]) | set(ENFORCED.get(kind or "", ()))
        if kind == "number" and node.get("multipleOf") is not None:
            raise refuse(path, "multipleOf", "is enforced on integers only (give type 'integer')")
        for k, v in node.items():
            if k in UNENFORCED:
                raise refuse(path, k)
            if k == "uniqueItems" and kind == "array":
                if v is True:
                    raise refuse(path, k)
                continue
            if k == "unevaluatedProperties" and kind == "object":
                if "additionalProperties" in node and v != node["additionalProperties"]:
                    raise refuse(path, k, "beside 'additionalProperties' cannot be enforced")
                out["additionalProperties"] = v
                continue
            if k in ("patternProperties", "propertyNames") and kind == "object":
                out[k] = v  # applied to the listed properties (`object`)
                continue
            if k in _FAMILY and k not in allowed:
                if _FAMILY[k] == _family(kind):  # this type's keyword, not enforced
                    raise refuse(path, k)
                continue  # another type's keyword: it constrains no value of this type
            out[k] = v
        if kind == "string":
            self.string(out, path)
        elif kind == "integer":
            self.integer(out, path)
        elif kind == "array":
            self.array(out, path, depth)
        elif kind == "object":
            self.object(out, path, depth)
        if kind in ("number", "integer"):
            lo = out.get("exclusiveMinimum", out.get("minimum"))
            hi = out.get("exclusiveMaximum", out.get("maximum"))
            for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if k in out and (not isinstance(out[k], (int, float)) or isinstance(out[k], bool)):
                    raise refuse(path, k, "must be a number")
            if lo is not None and hi is not None and lo > hi:
                raise never(path, f"no number is >= {lo} and <= {hi}")
        return out

    def string(self, out: dict, path: str) -> None:
        fmt = out.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise refuse(
                path, "format", f"{fmt!r} cannot be enforced (enforced: {', '.join(FORMATS)})"
            )
        if fmt in FORMAT_PATTERNS:
            if "pattern" in out:
                raise refuse(path, "format", "beside 'pattern' cannot be enforced; keep one")
            out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
            fmt = None
            if "minLength" in out or "maxLength" in out:
                which = "minLength" if "minLength" in out else "maxLength"
                raise refuse(path, which, "beside 'format' cannot be enforced while decoding")
        lo, hi = out.get("minLength"), out.get("maxLength")
        for k, v in (("minLength", lo), ("maxLength", hi)):
            if v is not None and (not _is_int(v) or v < 0):
                raise refuse(path, k, "must be an integer >= 0")
        if lo is None and hi is None:
            return
        lo, hi = int(lo or 0), None if hi is None else int(hi)
        if hi is not None and lo > hi:
            raise never(path, f"minLength {lo} > maxLength {hi}")
        which = "minLength" if "minLength" in out else "maxLength"
        if fmt is not None:
            raise refuse(
                path,
                which,
                "beside 'format' cannot be enforced while decoding; put the length in a "
                "'pattern' instead of the format (or check it on the output)",
            )
        pattern = out.get("pattern")
        if pattern is None:  # the backend's own length rule (made JSON-safe: grammar_compiler.py)
            out["minLength"] = lo
            if hi is not None:
                out["maxLength"] = hi
            return
        out.pop("minLength", None)
        out.pop("maxLength", None)
        m = _ONE_CLASS.match(pattern) if isinstance(pattern, str) else None
        if m is None:
            raise refuse(
                path,
                which,
                "beside 'pattern' cannot be enforced while decoding; put the length in the "
                "pattern (or check it on the output)",
            )
        q = m.group("quant") or "{1}"
        plo, phi = {"*": (0, None), "+": (1, None), "?": (0, 1)}.get(q, (None, None))
        if plo is None:
            a, _, b = q[1:-1].partition(",")
            plo, phi = int(a), (int(a) if not _ else (int(b) if b else None))
        lo2 = max(lo, plo)
        hi2 = phi if hi is None else (hi if phi is None else min(hi, phi))
        if hi2 is not None and lo2 > hi2:
            raise never(path, "the length bounds and the pattern's repeat count do not meet")
        out["pattern"] = f"^{m.group('atom')}{{{lo2},{'' if hi2 is None else hi2}}}$"

    def integer(self, out: dict, path: str) -> None:
        """Bounds as inclusive integers (within +-2**53: the backend reads them as doubles);
        `multipleOf` beside a bound as the `enum` of its values (the backend drops it there)."""
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            v = out.get(k)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                raise refuse(path, k, "must be a number")
        lows = [math.ceil(out.pop("minimum"))] if "minimum" in out else []
        lows += [math.floor(out.pop("exclusiveMinimum")) + 1] if "exclusiveMinimum" in out else []
        highs = [math.floor(out.pop("maximum"))] if "maximum" in out else []
        highs += [math.ceil(out.pop("exclusiveMaximum")) - 1] if "exclusiveMaximum" in out else []
        lo = max(max(lows), -INTEGER_LIMIT) if lows else None
        hi = min(min(highs), INTEGER_LIMIT) if highs else None
        if lo is not None and hi is not None and lo > hi:
            raise never(path, f"no integer is >= {lo} and <= {hi}")
        m = out.pop("multipleOf", None)
        if m is not None:
            if not isinstance(m, (int, float)) or isinstance(m, bool) or m <= 0:
                raise refuse(path, "multipleOf", "must be a number > 0")
            if not _is_int(m):
                raise refuse(path, "multipleOf", "is enforced on integers only when it is one")
            m = int(m)
        if m is not None and m > 1 and (lo is not None or hi is not None):
            if lo is None or hi is None or (hi - lo) // m + 1 > MAX_ENUM:
                raise refuse(
                    path,
                    "multipleOf",
                    f"beside a bound is enforced where both bounds hold at most {MAX_ENUM} "
                    "multiples (give 'minimum' and 'maximum', or an 'enum')",
                )
            values = list(range(-(-lo // m) * m, hi + 1, m))
            if not values:
                raise never(path, f"no multiple of {m} lies in [{lo}, {hi}]")
            out.pop("type", None)
            out["enum"] = values
            return
        if lo is not None:
            out["minimum"] = lo
        if hi is not None:
            out["maximum"] = hi
        if m is not None and m > INTEGER_MULTIPLE_OF_MAX:
            raise refuse(path, "multipleOf", f"above {INTEGER_MULTIPLE_OF_MAX} cannot be enforced")
        if m is not None and m > 1:
            out["multipleOf"] = m

    def array(self, out: dict, path: str, depth: int) -> None:
        prefix = out.get("prefixItems")
        if prefix is not None:
            if not isinstance(prefix, list):
                raise refuse(path, "prefixItems", "must be a list of schemas")
            out["prefixItems"] = [
                self.node(s, _ptr(path, "prefixItems", i), depth + 1) for i, s in enumerate(prefix)
            ]
        for k in ("minItems", "maxItems"):
            if k in out and (not _is_int(out[k]) or out[k] < 0):
                raise refuse(path, k, "must be an integer >= 0")
        if "items" in out:
            if out["items"] is not False:
                try:
                    out["items"] = self.node(out["items"], _ptr(path, "items"), depth + 1)
                except SchemaRefused as e:
                    if e.keyword is not None:
                        raise
                    out["items"] = False  # no item satisfies it: no items past the prefix
        elif out.get("minItems", 0) > len(prefix or ()):
            out["items"] = {}  # no `items`: any value (xgrammar's strict mode would allow none)
        if out.get("items") is False and out.get("minItems", 0) > len(prefix or ()):
            raise never(path, "minItems exceeds the items 'prefixItems' allows")
        if "maxItems" in out and out.get("minItems", 0) > out["maxItems"]:
            raise never(path, "minItems > maxItems")

    def names(
        self, out: dict, props: dict, required: list, extra: Any, path: str, depth: int
    ) -> None:
        """`patternProperties` and `propertyNames` where no property beyond the listed ones is
        generated: a listed property whose name matches a pattern gets that schema too, one whose
        name `propertyNames` refuses cannot appear."""
        patterns = out.pop("patternProperties", None)
        names = out.pop("propertyNames", None)
        for key, value in (("patternProperties", patterns), ("propertyNames", names)):
            if value is not None and extra not in (None, False):
                raise refuse(path, key, "beside 'additionalProperties' cannot be enforced")
        if patterns is not None:
            if not isinstance(patterns, dict):
                raise refuse(path, "patternProperties", "must be an object")
            for pattern, sub in patterns.items():
                try:
                    rx = re.compile(pattern)
                except (re.error, TypeError):
                    raise refuse(
                        path, "patternProperties", f"has a bad pattern {pattern!r}"
                    ) from None
                for name in props:
                    if rx.search(name):
                        at = _ptr(path, "properties", name)
                        try:
                            props[name] = self.merge_sub(props[name], sub, at, depth)
                        except SchemaRefused as e:
                            if e.keyword is not None:
                                raise
                            props[name] = False  # no value: cannot appear
        if names is not None:
            if _has_ref(names):
                raise refuse(path, "propertyNames", "with a '$ref' cannot be checked; inline it")
            import jsonschema

            try:
                valid = jsonschema.Draft202012Validator(names).is_valid
                for name in list(props):
                    if not valid(name):
                        props[name] = False  # cannot appear
            except jsonschema.SchemaError as e:
                raise refuse(path, "propertyNames", f"is not a valid schema: {e.message}") from None

    def object(self, out: dict, path: str, depth: int) -> None:
        props = out.get("properties", {})
        if not isinstance(props, dict):
            raise refuse(path, "properties", "must be an object")
        required = out.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise refuse(path, "required", "must be a list of strings")
        required = list(dict.fromkeys(required))
        extra = out.get("additionalProperties", None)
        props = dict(props)
        for name in required:
            if name not in props:  # exists, any value (or what additionalProperties allows)
                if extra is False:
                    raise never(
                        _ptr(path, "required"),
                        f"{name!r} is required but additionalProperties is false",
                    )
                props[name] = {} if extra in (None, True) else extra
        only_listed = "patternProperties" in out or "propertyNames" in out
        self.names(out, props, required, extra, path, depth)
        walked = {}
        left_out = False  # a property that must not appear, forbidden by leaving it out
        for name, sub in props.items():
            at = _ptr(path, "properties", name)
            if sub is False:
                if name in required:
                    raise never(at, f"the required property {name!r} has the schema `false`")
                if extra not in (None, False):
                    raise refuse(
                        at,
                        "false",
                        "(a property that must not appear) cannot be enforced while other "
                        "properties are allowed ('additionalProperties')",
                    )
                left_out = True
                continue  # objects hold only the listed properties: leaving it out forbids it
            try:
                walked[name] = self.node(sub, at, depth + 1)
            except SchemaRefused as e:
                if e.keyword is not None or name in required or extra not in (None, False):
                    raise
                left_out = True
        if props or "properties" in out:
            out["properties"] = walked
        if required:
            out["required"] = required
        if extra not in (None, True, False):
            out["additionalProperties"] = self.node(
                extra, _ptr(path, "additionalProperties"), depth + 1
            )
        for k in ("minProperties", "maxProperties"):
            if k in out and (not _is_int(out[k]) or out[k] < 0):
                raise refuse(path, k, "must be an integer >= 0")
        if extra is None and out.get("minProperties", 0) > len(walked):
            # more properties than it lists: others of any value (xgrammar would allow none)
            if left_out or only_listed:
                raise refuse(
                    path,
                    "minProperties",
                    "above the listed properties cannot be enforced beside properties that must "
                    "not appear",
                )
            out["additionalProperties"] = {}


def _draft4(node: dict, path: str) -> dict:
    """Draft 4's boolean exclusiveMinimum / exclusiveMaximum as the numeric form."""
    for ex, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(ex), bool):
            if node.pop(ex) and bound in node:
                node[ex] = node.pop(bound)
    return node


def _asserts(node: dict) -> bool:
    """Whether `node` has a keyword that constrains values (beyond annotations)."""
    return any(k in _ASSERTIONS for k in node)


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def _is_int(v: Any) -> bool:
    return not isinstance(v, bool) and (
        isinstance(v, int) or (isinstance(v, float) and math.isfinite(v) and v == int(v))
    )


def _family(kind: Optional[str]) -> Optional[str]:
    return "number" if kind in ("integer", "number") else kind


def _meet_types(x: Any, y: Any, path: str) -> Any:
    xs = {x} if isinstance(x, str) else set(x)
    ys = {y} if isinstance(y, str) else set(y)
    out = set()
    for a in xs:
        for b in ys:
            if a == b:
                out.add(a)
            elif {a, b} == {"integer", "number"}:
                out.add("integer")
    if not out:
        raise never(path, f"no value has type {x!r} and type {y!r}")
    ordered = [t for t in _TYPES if t in out]
    return ordered[0] if len(ordered) == 1 else ordered


def _types_of(node: dict) -> Optional[set]:
    t = node.get("type")
    if t is None:
        return None
    return {t} if isinstance(t, str) else set(t)


def _widen(types: set) -> set:
    """Types as sets of JSON kinds: an integer is a number."""
    return {"number" if t == "integer" else t for t in types}


def _type_of(value: Any) -> set:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, (int, float)):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    if isinstance(value, list):
        return {"array"}
    return {"object"}


def _values_of(node: dict) -> Optional[list]:
    if "const" in node:
        return [node["const"]]
    if "enum" in node and isinstance(node["enum"], list):
        return node["enum"]
    return None


def _canon(v: Any) -> str:
    """JSON equality (1 == 1.0, True != 1, keys in any order)."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (int, float)):
        return repr(float(v)) if v != int(v) else str(int(v))
    if isinstance(v, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_canon(v[k])}" for k in sorted(v)) + "}"
    return "[" + ",".join(_canon(x) for x in v) + "]"


def _in(v: Any, values: list) -> bool:
    c = _canon(v)
    return any(_canon(x) == c for x in values)


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
    walk = _Walk(schema)
    defs = {}
    for key in _CONTAINERS:
        if isinstance(schema.get(key), dict):
            defs[key] = {
                name: walk.node(sub, _ptr("#", key, name)) if sub is not False else False
                for name, sub in schema[key].items()
            }
    body = walk.node({k: v for k, v in schema.items() if k not in _CONTAINERS}, "#")
    return {**body, **defs}

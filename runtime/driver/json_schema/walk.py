"""The walk: the schema node by node, each keyword enforced as it is, rewritten (rewrites.py,
scalars.py) or refused, its subschemas walked."""

from __future__ import annotations

import re
from typing import Any, Optional

from atomrt.runtime.driver.json_schema.keywords import (
    ENFORCED,
    FAMILY,
    MAX_DEPTH,
    TYPES,
    UNENFORCED,
    SchemaRefused,
    asserts,
    never,
    ptr,
    refuse,
)
from atomrt.runtime.driver.json_schema.rewrites import Rewriter
from atomrt.runtime.driver.json_schema.scalars import integer_keywords, is_int, string_keywords


class Walk(Rewriter):
    """A `Rewriter` that walks the schema node by node (`node`)."""

    def node(self, raw: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise SchemaRefused(f"the schema at {path} nests deeper than {MAX_DEPTH}", None, path)
        node = self.flat(raw, path, depth)
        if "$ref" in node:
            return node  # a lone reference into the definitions (walked there)
        if "anyOf" in node:
            out = {k: v for k, v in node.items() if not asserts({k: v})}
            branches = []
            for i, b in enumerate(node["anyOf"]):
                try:
                    branches.append(self.node(b, ptr(path, "anyOf", i), depth + 1))
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
            families = sorted({FAMILY[k] for k in node if k in FAMILY})
            if not families:
                return self.checked(node, None, path, depth)
            types = families
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types or not all(t in TYPES for t in types):
            raise refuse(path, "type", f"must be one of {', '.join(TYPES)} or a list of them")
        types = list(dict.fromkeys(types))
        if "number" in types and "integer" in types:
            types.remove("integer")
        if len(types) == 1:
            return self.checked({**node, "type": types[0]}, types[0], path, depth)
        keep = {k: v for k, v in node.items() if not asserts({k: v})}
        keep["anyOf"] = [
            self.checked(
                {"type": t, **{k: v for k, v in node.items() if FAMILY.get(k) == _family(t)}},
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
        keep = {k: v for k, v in node.items() if not asserts({k: v})}
        rest = {k: v for k, v in node.items() if asserts({k: v}) and k not in ("enum", "const")}
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
            if k in FAMILY and k not in allowed:
                if FAMILY[k] == _family(kind):  # this type's keyword, not enforced
                    raise refuse(path, k)
                continue  # another type's keyword: it constrains no value of this type
            out[k] = v
        if kind == "string":
            string_keywords(out, path)
        elif kind == "integer":
            integer_keywords(out, path)
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

    def array(self, out: dict, path: str, depth: int) -> None:
        prefix = out.get("prefixItems")
        if prefix is not None:
            if not isinstance(prefix, list):
                raise refuse(path, "prefixItems", "must be a list of schemas")
            out["prefixItems"] = [
                self.node(s, ptr(path, "prefixItems", i), depth + 1) for i, s in enumerate(prefix)
            ]
        for k in ("minItems", "maxItems"):
            if k in out and (not is_int(out[k]) or out[k] < 0):
                raise refuse(path, k, "must be an integer >= 0")
        if "items" in out:
            if out["items"] is not False:
                try:
                    out["items"] = self.node(out["items"], ptr(path, "items"), depth + 1)
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
                        at = ptr(path, "properties", name)
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
                        ptr(path, "required"),
                        f"{name!r} is required but additionalProperties is false",
                    )
                props[name] = {} if extra in (None, True) else extra
        only_listed = "patternProperties" in out or "propertyNames" in out
        self.names(out, props, required, extra, path, depth)
        walked = {}
        left_out = False  # a property that must not appear, forbidden by leaving it out
        for name, sub in props.items():
            at = ptr(path, "properties", name)
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
                extra, ptr(path, "additionalProperties"), depth + 1
            )
        for k in ("minProperties", "maxProperties"):
            if k in out and (not is_int(out[k]) or out[k] < 0):
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


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def _family(kind: Optional[str]) -> Optional[str]:
    return "number" if kind in ("integer", "number") else kind

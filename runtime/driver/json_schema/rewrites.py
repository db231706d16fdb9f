"""The rewrites: a schema node flattened (no `allOf`, no keyword beside a `$ref`, `oneOf` as a
disjoint `anyOf`, dependencies as an `anyOf`), and two flat schemas merged into one that holds
exactly where both do."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Optional
from urllib.parse import unquote

from atomrt.runtime.driver.json_schema.keywords import (
    APPLICATORS,
    ASSERTIONS,
    DEPENDENCIES,
    LOWER,
    MAX_BRANCHES,
    MAX_DEPTH,
    TYPES,
    UPPER,
    SchemaRefused,
    asserts,
    never,
    ptr,
    refuse,
)
from atomrt.runtime.driver.json_schema.scalars import is_int


class Rewriter:
    """Flattening and merging over one schema (`root`, where its `$ref`s point)."""

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
            if self.kept_ref(ref) and not asserts(rest):
                return node
            target = self.flat(self.resolve(ref, path), path, depth + 1)
            node = self.merge(target, self.flat(rest, path, depth + 1), path, depth + 1)
        if "allOf" in node:
            branches = node.pop("allOf")
            if not isinstance(branches, list) or not branches:
                raise refuse(path, "allOf", "must be a non-empty list")
            node = self.flat(node, path, depth + 1)
            for i, b in enumerate(branches):
                node = self.merge(node, self.flat(b, ptr(path, "allOf", i), depth + 1), path, depth)
        if any(k in node for k in DEPENDENCIES):
            node = self.dependencies(node, path, depth)
        if "oneOf" in node:
            node = self.one_of(node, path, depth)
        if "anyOf" in node and asserts({k: v for k, v in node.items() if k != "anyOf"}):
            node = self.spread(node, path, depth)
        return node

    def dependencies(self, node: dict, path: str, depth: int) -> dict:
        """`dependentRequired` / `dependentSchemas` / `dependencies` (a property's presence asks
        for more) as an `anyOf` per property: absent (where only the listed properties are
        generated, leaving it out of `properties` forbids it), or present with what it asks."""
        if node.get("additionalProperties", None) not in (None, False):
            key = next(k for k in DEPENDENCIES if k in node)
            raise refuse(path, key, "beside 'additionalProperties' cannot be enforced")
        rules: list[tuple[str, Any, str]] = []
        for key in DEPENDENCIES:
            deps = node.pop(key, None)
            if deps is None:
                continue
            if not isinstance(deps, dict):
                raise refuse(path, key, "must be an object")
            rules += [(name, then, key) for name, then in deps.items()]
        for name, then, key in rules:
            at = ptr(path, key, name)
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
                flat.append(self.flat(b, ptr(path, "oneOf", i), depth + 1))
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
        keep = {k: v for k, v in node.items() if not asserts({k: v})}
        return {**keep, "anyOf": merged} if len(merged) > 1 else {**keep, **merged[0]}

    def spread(self, node: dict, path: str, depth: int) -> dict:
        """`anyOf` with other keywords beside it: those merged into each branch."""
        branches = node["anyOf"]
        if not isinstance(branches, list) or not branches:
            raise refuse(path, "anyOf", "must be a non-empty list")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        keep = {k: v for k, v in rest.items() if not asserts({k: v})}
        out = []
        for i, b in enumerate(branches):
            try:
                out.append(
                    self.merge(rest, self.flat(b, ptr(path, "anyOf", i), depth + 1), path, depth)
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
        a = self.flat(a, path, depth + 1) if any(k in a for k in APPLICATORS[:2]) else a
        b = self.flat(b, path, depth + 1) if any(k in b for k in APPLICATORS[:2]) else b
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
            elif k in LOWER:
                out[k] = max(out[k], v)
            elif k in UPPER:
                out[k] = min(out[k], v)
            elif k == "required":
                out[k] = list(dict.fromkeys(list(out[k]) + list(v)))
            elif k == "multipleOf" and all(is_int(x) for x in (out[k], v)):
                out[k] = math.lcm(int(out[k]), int(v))
            elif k in ("items", "additionalProperties", "unevaluatedProperties"):
                out[k] = self.merge_sub(out[k], v, ptr(path, k), depth)
            elif k == "properties":
                continue  # below
            elif k in ("$defs", "definitions", "$schema", "$id", "id", "$comment"):
                continue
            elif k in ASSERTIONS:
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
                out[name] = self.merge_sub(x, y, ptr(path, "properties", name), depth)
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
                        base_a, self.flat(x, ptr(path, "anyOf", i), depth + 1), path, depth + 1
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


def _draft4(node: dict, path: str) -> dict:
    """Draft 4's boolean exclusiveMinimum / exclusiveMaximum as the numeric form."""
    for ex, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(ex), bool):
            if node.pop(ex) and bound in node:
                node[ex] = node.pop(bound)
    return node


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
    ordered = [t for t in TYPES if t in out]
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

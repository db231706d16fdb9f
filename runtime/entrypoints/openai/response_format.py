"""`response_format` of a chat request checked for its shape (text, json_object, json_schema,
structural_tag), and vLLM's structural tag in either of its forms as xgrammar's."""

from __future__ import annotations

from typing import Optional

from atomrt.runtime.entrypoints.openai.errors import Json, RequestError


def check_response_format(fmt: Optional[Json]) -> None:
    kind = (fmt or {}).get("type", "text")
    if kind not in ("text", "json_object", "json_schema", "structural_tag"):
        raise RequestError(
            "response_format.type: 'text', 'json_object', 'json_schema' or 'structural_tag', "
            f"got {kind!r}",
            "response_format",
        )
    if kind == "structural_tag":
        structural_tag(fmt)  # its shape; what it means is the grammar compiler's check
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise RequestError(
                "response_format.json_schema: must be {name, schema, strict}", "response_format"
            )


def structural_tag(fmt: Json, param: str = "response_format") -> Json:
    """vLLM's `response_format` {"type": "structural_tag", ...} as xgrammar's structural tag: the
    current form, `{"format": {...}}`, as it is; the first form, `structures` (each
    `{begin, schema, end}`: between `begin` and `end`, JSON of `schema`) entered at `triggers`
    (free text elsewhere), as the equivalent `triggered_tags` format. A RequestError names what
    is wrong with its shape (`param`: the field that holds it)."""
    where = param if param == "response_format" else f"{param}.structural_tag"
    if "format" in fmt:
        if not isinstance(fmt["format"], dict):
            raise RequestError(f"{where}.format: must be a structural tag format object", param)
        return {"type": "structural_tag", "format": fmt["format"]}
    structures, triggers = fmt.get("structures"), fmt.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise RequestError(
            f"{where}: a structural_tag needs `format`, or `structures` and `triggers`", param
        )
    tags = []
    for i, item in enumerate(structures):
        ok = isinstance(item, dict) and isinstance(item.get("begin"), str) and item["begin"]
        ok = ok and isinstance(item.get("end"), str) and isinstance(item.get("schema"), dict)
        if not ok:
            raise RequestError(
                f"{where}.structures[{i}]: must be {{begin, schema, end}} (begin a non-empty "
                "string, schema a JSON schema object, end a string)",
                param,
            )
        content = {"type": "json_schema", "json_schema": item["schema"]}
        tags.append({"begin": item["begin"], "content": content, "end": item["end"]})
    if (
        not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        raise RequestError(f"{where}.triggers: must be a non-empty list of strings", param)
    for i, tag in enumerate(tags):
        if not any(tag["begin"].startswith(t) for t in triggers):
            raise RequestError(
                f"{where}.structures[{i}].begin: {tag['begin']!r} starts with none of triggers",
                param,
            )
    fmt_ = {"type": "triggered_tags", "triggers": list(triggers), "tags": tags}
    return {"type": "structural_tag", "format": fmt_}

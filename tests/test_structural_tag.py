"""`response_format: {"type": "structural_tag"}` (vLLM's) through `atomrt serve` with the official
`openai` client on a tiny random model over a real BPE vocabulary: xgrammar's current form
(`format`) and vLLM's first form (`structures` entered at `triggers`), whose outputs follow the
tags (checked with `jsonschema`); a malformed one is a 400 naming `response_format`."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import xgrammar as xgr
from test_server import Server
from xgrammar.testing import _is_grammar_accept_string

from atomrt.runtime.driver.grammar_compiler import check, parse
from atomrt.runtime.entrypoints.openai.protocol import structural_tag
from atomrt.runtime.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
LEGACY = {
    "type": "structural_tag",
    "structures": [{"begin": "<function=weather>", "schema": SCHEMA, "end": "</function>"}],
    "triggers": ["<function="],
}
CURRENT = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<call>",
        # JSON of SCHEMA without free whitespace (a random model would pad it to max_tokens)
        "content": {"type": "regex", "pattern": r'\{"city": "(Oslo|Rome)", "days": [1-7]\}'},
        "end": "</call>",
    },
}
MESSAGES = [{"role": "user", "content": "Weather?"}]


def test_the_first_form_means_free_text_with_tagged_json_after_a_trigger() -> None:
    grammar = xgr.Grammar.from_structural_tag(json.dumps(structural_tag(LEGACY)))
    good = 'Let me see. <function=weather>{"city": "Oslo", "days": 2}</function> Done.'
    assert _is_grammar_accept_string(grammar, "Plain text, no call.")
    assert _is_grammar_accept_string(grammar, good)
    assert not _is_grammar_accept_string(grammar, good.replace("Oslo", "Paris"))
    assert not _is_grammar_accept_string(grammar, "<function=weather>{}</function>")


def _tag_with(schema: dict) -> dict:
    return {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<call>",
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "</call>",
        },
    }


def test_a_schema_inside_a_tag_is_walked_like_a_json_constraint() -> None:
    # a keyword the backend would drop inside a tag is refused, naming where it stands
    tag = _tag_with({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    with pytest.raises(ValueError, match=r"format\.content\.json_schema: .*uniqueItems"):
        check(StructuredOutputsParams(structural_tag=tag))
    # a required name outside `properties` is enforced: the tag accepts only objects holding it
    tag = _tag_with({"type": "object", "required": ["zz"]})
    so = StructuredOutputsParams(structural_tag=json.dumps(tag))
    grammar = parse(so, check(so))
    assert _is_grammar_accept_string(grammar, '<call>{"zz": 1}</call>')
    assert not _is_grammar_accept_string(grammar, "<call>{}</call>")
    with pytest.raises(ValueError, match="structured_outputs.structural_tag"):
        check(StructuredOutputsParams(structural_tag="{not json"))


@pytest.fixture(scope="module")
def server(tiny_bpe_server: Server) -> Server:
    """The session's server on the tiny BPE Llama (conftest.py)."""
    return tiny_bpe_server


def test_structural_tag_response_format_is_followed(server) -> None:
    client = server.client()
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=64, temperature=0, response_format=CURRENT
    )
    text = out.choices[0].message.content
    m = re.fullmatch(r"<call>(.*)</call>", text, re.S)
    assert m and out.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(m.group(1)), SCHEMA)
    # the first form: free text, every tagged part JSON of its schema
    for seed in range(3):
        out = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=24, seed=seed, response_format=LEGACY
        )
        text = out.choices[0].message.content
        for part in re.findall(r"<function=weather>(.*?)</function>", text, re.S):
            jsonschema.validate(json.loads(part), SCHEMA)


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "structural_tag"},
        {
            "type": "structural_tag",
            "structures": [{"begin": "<f>", "end": "</f>"}],
            "triggers": ["<"],
        },
        {**LEGACY, "triggers": []},
        {**LEGACY, "triggers": ["<tool>"]},
        {"type": "structural_tag", "format": "tag"},
        {"type": "structural_tag", "format": {"type": "no_such_format"}},
    ],
)
def test_a_malformed_structural_tag_is_a_400_naming_response_format(server, fmt) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4, response_format=fmt
        )
    assert e.value.body["param"] == "response_format", e.value.body
    assert e.value.body["message"].startswith("response_format"), e.value.body


def test_vllm_structured_outputs_structural_tag_takes_both_forms(server) -> None:
    client = server.client()
    for tag in (LEGACY, CURRENT):
        out = client.completions.create(
            model="tiny",
            prompt="Weather?",
            max_tokens=64,
            temperature=0,
            extra_body={"structured_outputs": {"structural_tag": tag}},
        )
        text = out.choices[0].text
        if tag is CURRENT:
            assert re.fullmatch(r"<call>(.*)</call>", text, re.S), text
        for part in re.findall(r"<(?:function=weather|call)>(.*?)</(?:function|call)>", text, re.S):
            jsonschema.validate(json.loads(part), SCHEMA)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="tiny",
            prompt="hi",
            max_tokens=2,
            extra_body={"structured_outputs": {"structural_tag": {**LEGACY, "triggers": []}}},
        )
    assert e.value.body["param"] == "structured_outputs", e.value.body
    assert e.value.body["message"].startswith("structured_outputs.structural_tag.triggers")

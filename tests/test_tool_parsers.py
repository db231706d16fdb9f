"""The tool-call parsers on outputs as the models write them (Qwen2.5 and Qwen3 in hermes format,
Llama 3.x JSON, Mistral): the calls and content of the whole text, and the same calls and content
when the text arrives in pieces, as a stream's deltas in OpenAI's form."""

from __future__ import annotations

import json
import random

import pytest

from atomrt.runtime.entrypoints.openai.tool_parsers import (
    JsonCallsParser,
    ToolCallStream,
    make_parser,
    tool_calls,
)

QWEN25 = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, '
    'CA, USA", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", '
    '"arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": '
    '"celsius"}}\n</tool_call>'
)
QWEN3 = (
    "<think>\nThe user wants the weather; I will call the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin", "extra": {"nested": '
    '["a}", "b\\"c"]}}}\n</tool_call>'
)
LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"zone": "CET"}}'
)
LLAMA3_PLAIN = '{"name": "search", "parameters": {"query": "atomrt {json}"}}'
MISTRAL = (
    'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
    '{"name": "get_time", "arguments": {}}]'
)
CASES = [
    (
        "hermes",
        QWEN25,
        "",
        [
            ("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"}),
            (
                "get_temperature_date",
                {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"},
            ),
        ],
    ),
    (
        "hermes",
        QWEN3,
        "<think>\nThe user wants the weather; I will call the tool.\n</think>",
        [("get_weather", {"city": "Berlin", "extra": {"nested": ["a}", 'b"c']}})],
    ),
    (
        "llama3_json",
        LLAMA3,
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})],
    ),
    ("llama3_json", LLAMA3_PLAIN, "", [("search", {"query": "atomrt {json}"})]),
    ("mistral", MISTRAL, "Checking.", [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ("hermes", "Paris is sunny <tool_ today.", "Paris is sunny <tool_ today.", []),
    ("llama3_json", "It is sunny.", "It is sunny.", []),
    ("mistral", "No tools [TOOL needed.", "No tools [TOOL needed.", []),
    # JSON that is not a call stays content
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '<|python_tag|>{"answer": 42}', '<|python_tag|>{"answer": 42}', []),
    # broken calls stay content (a warning is logged)
    ("hermes", "<tool_call>not json</tool_call> text", "<tool_call>not json</tool_call> text", []),
    (
        "hermes",
        'Sure. <tool_call>{"arguments": {"x": 1}}</tool_call>',
        'Sure. <tool_call>{"arguments": {"x": 1}}</tool_call>',
        [],
    ),
    # arguments written as a JSON string are that string's JSON
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}]',
        "",
        [("get_time", {"zone": "UTC"})],
    ),
    # a closing tag inside a string value is text of the value
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A</tool_call>"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "<tool_call>"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "A</tool_call>"}), ("get_time", {"zone": "<tool_call>"})],
    ),
    # later Mistral tokenizers: each call after its own tag, `name{...}` or `name[ARGS]{...}`
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather{"city": "Rome}"}[TOOL_CALLS]get_time{}',
        "Sure.",
        [("get_weather", {"city": "Rome}"}), ("get_time", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": [1, 2]}',
        "",
        [("get_weather", {"city": "Oslo", "days": [1, 2]})],
    ),
    # a call without arguments has an empty object
    ("hermes", '<tool_call>{"name": "ping"}</tool_call>', "", [("ping", {})]),
]


def _stream(parser_name: str, text: str, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """The text fed in random pieces: the content and (name, arguments) the deltas add up to."""
    rng = random.Random(seed)
    stream = ToolCallStream(make_parser(parser_name))
    content, calls, at = "", {}, 0
    while at < len(text):
        at = min(len(text), at + rng.randint(1, 6))
        delta = stream.delta(text[:at], at == len(text))
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", ()):
            if "id" in tc:
                assert tc["index"] not in calls and tc["type"] == "function"
                assert tc["function"]["arguments"] == "" and tc["id"].startswith("call_")
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                calls[tc["index"]][1] += tc["function"]["arguments"]
    return content, [tuple(c) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("parser_name,text,content,want", CASES)
def test_calls_whole_and_streamed(parser_name, text, content, want) -> None:
    parsed = make_parser(parser_name).parse(text, final=True)
    assert parsed.content == content
    calls = tool_calls(parsed.calls)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want
    for seed in range(20):
        got_content, got_calls = _stream(parser_name, text, seed)
        assert got_content == content
        assert got_calls == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize(
    "parser_name,text",
    [
        ("hermes", 'Let me see. <tool_call>{"name": "f", "arguments": {"a": 1}'),
        ("hermes", '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>'),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": [1, 2]}]'),
        ("mistral", "Done.[TOOL_CALLS]"),
        ("llama3_json", '{"name": "f", "parameters": {"a": '),
    ],
)
def test_a_broken_call_is_content_with_a_warning(parser_name, text, caplog) -> None:
    with caplog.at_level("WARNING"):
        parsed = make_parser(parser_name).parse(text, final=True)
    assert parsed.content == text and parsed.calls == []
    assert "broken call" in caplog.text


def test_required_calls_array() -> None:
    text = '[{"name": "a", "parameters": {"x": [1, 2]}}, {"name": "b", "parameters": {}}]'
    parsed = JsonCallsParser().parse(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("a", {"x": [1, 2]}),
        ("b", {}),
    ]


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser"):
        make_parser("pythonic")


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %} CALL {{ c.function.name }} "
    "{{ c.function.arguments.city }}{% endfor %}"
    "{% if m.get('tool_call_id') %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
)


def test_the_chat_template_gets_tools_calls_and_tool_answers(tmp_path) -> None:
    from executor_harness import save_word_tokenizer
    from transformers import AutoTokenizer

    from atomrt.runtime.entrypoints.openai.protocol import ChatCompletionRequest, parse
    from atomrt.workers.loading.tokenizer import Tokenizer

    save_word_tokenizer(tmp_path, chat_template=TOOL_TEMPLATE)
    tok = Tokenizer(AutoTokenizer.from_pretrained(str(tmp_path)), (1,))
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "w", "arguments": '{"city": "Rome"}'},
    }
    req = parse(
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            ],
            "tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}],
            "tool_choice": "none",
        },
    )
    text = tok.apply_chat_template(
        req.conversation(), add_generation_prompt=False, tokenize=False, tools=req.tools
    )
    # (transformers renders with trim_blocks: a newline after a block tag goes)
    assert text == "TOOLS w\nuser: weather?assistant:  CALL w Rometool: sunny FOR c1"


def test_llm_chat_gives_the_template_its_tools(tmp_path) -> None:
    from executor_harness import COMMON, WORDS, build_tiny_llama, save_word_tokenizer

    from atomrt import SamplingParams
    from atomrt.runtime.entrypoints.llm import LLM

    folder = save_word_tokenizer(build_tiny_llama(tmp_path / "m"), chat_template=TOOL_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "cd", "parameters": {}}}]
    with LLM(str(folder), **COMMON) as llm:
        params = SamplingParams(max_tokens=1)
        with_tools = llm.chat([{"role": "user", "content": "aa"}], params, False, tools=tools)[0]
        without = llm.chat([{"role": "user", "content": "aa"}], params, False)[0]
    assert WORDS.index("cd") in with_tools.prompt_token_ids
    assert WORDS.index("cd") not in without.prompt_token_ids


_PIECES = [
    "</tool_call>",
    "<tool_call>",
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ";",
    "[TOOL_CALLS]",
    "é",
    " ",
]


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.choice(["str", "int", "list", "dict"] if depth < 2 else ["str", "int"])
    if kind == "str":
        return "".join(rng.choice(_PIECES + ["a", "b", "7"]) for _ in range(rng.randint(0, 8)))
    if kind == "int":
        return rng.randint(-50, 50)
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


@pytest.mark.parametrize("parser_name", ["hermes", "mistral", "llama3_json"])
def test_random_arguments_parse_whole_and_streamed_alike(parser_name) -> None:
    """Arguments holding the parsers' own tags, braces, quotes and escapes inside strings: the
    calls of the whole text are the ones written, and every random streaming of it joins to them."""
    rng = random.Random(parser_name)
    for _ in range(40):
        calls = [
            (f"f{i}", {f"a{j}": _random_value(rng) for j in range(rng.randint(0, 3))})
            for i in range(rng.randint(1, 3))
        ]
        indent = rng.choice([None, 1])
        dumped = [
            json.dumps(args, indent=indent, ensure_ascii=rng.random() < 0.5) for _, args in calls
        ]
        if parser_name == "hermes":
            text = "".join(
                f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>\n'
                for (n, _), a in zip(calls, dumped)
            )
        elif parser_name == "mistral":
            items = ", ".join(
                f'{{"name": "{n}", "arguments": {a}}}' for (n, _), a in zip(calls, dumped)
            )
            text = f"[TOOL_CALLS][{items}]"
        else:
            text = "; ".join(
                f'{{"name": "{n}", "parameters": {a}}}' for (n, _), a in zip(calls, dumped)
            )
        parsed = make_parser(parser_name).parse(text, final=True)
        whole = [(c.name, c.arguments) for c in parsed.calls]
        assert [(n, json.loads(a)) for n, a in whole] == calls, text
        for seed in range(3):
            content, streamed = _stream(parser_name, text, seed)
            assert streamed == whole and content == parsed.content, text

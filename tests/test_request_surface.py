"""The request surface of `atomrt serve`, through real HTTP and the official `openai` client, on a
tiny Llama with a word-level tokenizer (two-letter words, one token each) and a chat template.

- Every field of OpenAI's completions and chat-completions request bodies, as the official client's
  request types list them, is honoured or refused with a 400 naming it.
- `echo` (with and without logprobs, string and token-id prompts, lists of them, `max_tokens: 0`)
  against the same request without echo and the prompt logprobs the engine computes.
- `logit_bias`, `allowed_token_ids`, `bad_words` and `prompt_logprobs` reach the sampler.
- `usage.prompt_tokens_details.cached_tokens` is the prefix cache's hit count.
- /openapi.json describes the request bodies with the models the server validates them with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Optional

import httpx
import openai
import pytest
from executor_harness import WORDS, build_tiny_llama, save_word_tokenizer
from test_server import CPU_FLAGS, Server

from atomrt.runtime.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
BLOCK = 16  # cache_config.block_size


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = build_tiny_llama(tmp_path_factory.mktemp("surface") / "model")
    save_word_tokenizer(folder, chat_template=TEMPLATE)
    s = Server(["--model", str(folder), *CPU_FLAGS, "--served-model-name", "tiny"])
    yield s
    assert s.stop() == 0


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def words(*ids: int) -> str:
    return " ".join(WORDS[i] for i in ids)


PROMPT = words(3, 17, 42, 99, 5, 8, 61, 20, 21)
MESSAGES = [{"role": "user", "content": words(3, 17, 42)}]

# ---------------------------------------------------------------- every OpenAI request field

OK, REFUSED = "honoured", "refused"
Check = Optional[Callable[[dict[str, Any]], bool]]


def _text(body: dict[str, Any]) -> str:
    c = body["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


def _forced(body: dict[str, Any]) -> bool:
    return _text(body).split() == [WORDS[9]] * 3


# field -> cases of (value, honoured or refused, a check of the 200 body)
COMMON_FIELDS: dict[str, list[tuple[Any, str, Check]]] = {
    "model": [("tiny", OK, None)],
    "frequency_penalty": [(1.5, OK, None)],
    "presence_penalty": [(1.5, OK, None)],
    "logit_bias": [({"9": 100}, OK, _forced)],
    "n": [(2, OK, lambda b: len(b["choices"]) == 2)],
    "seed": [(7, OK, None)],
    "stop": [([WORDS[200 % 128]], OK, None)],
    "stream_options": [
        ({"include_usage": True}, OK, None),
        ({"include_obfuscation": True}, REFUSED, None),
    ],
    "temperature": [(0.0, OK, None)],
    "top_p": [(0.5, OK, None)],
    "user": [("someone", OK, None)],
    "max_tokens": [(2, OK, lambda b: b["usage"]["completion_tokens"] == 2)],
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS,
    "prompt": [([[3, 4], [5, 6]], OK, lambda b: len(b["choices"]) == 2)],
    "best_of": [(1, OK, None), (3, REFUSED, None)],
    "echo": [(True, OK, lambda b: b["choices"][0]["text"].startswith(PROMPT))],
    "logprobs": [(2, OK, lambda b: len(b["choices"][0]["logprobs"]["tokens"]) == 3)],
    "suffix": [("the end", REFUSED, None)],
}
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "messages": [([{"role": "system", "content": "aa"}, *MESSAGES], OK, None)],
    "max_completion_tokens": [(2, OK, lambda b: b["usage"]["completion_tokens"] == 2)],
    "logprobs": [(True, OK, lambda b: len(b["choices"][0]["logprobs"]["content"]) == 3)],
    "top_logprobs": [(2, OK, None)],  # sent with logprobs=true below
    "metadata": [({"team": "a"}, OK, None)],
    "safety_identifier": [("someone", OK, None)],
    "prompt_cache_key": [("key", OK, None)],
    "parallel_tool_calls": [(False, OK, None)],
    "store": [(False, OK, None), (True, REFUSED, None)],
    "service_tier": [("auto", OK, None), ("flex", REFUSED, None)],
    "modalities": [(["text"], OK, None), (["text", "audio"], REFUSED, None)],
    "audio": [({"voice": "alloy", "format": "wav"}, REFUSED, None)],
    "prediction": [({"type": "content", "content": "aa"}, REFUSED, None)],
    "web_search_options": [({}, REFUSED, None)],
    # constraints that the word vocabulary can meet are honoured (tests/test_structured_server.py)
    "response_format": [
        ({"type": "text"}, OK, None),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "x"}}},
            REFUSED,
            None,
        ),
    ],
    "tools": [([{"type": "function"}], REFUSED, None)],
    "tool_choice": [("none", OK, None), ("required", REFUSED, None)],  # required: without tools
    "functions": [([{"name": "f"}], REFUSED, None)],
    "function_call": [("none", OK, None), ("auto", REFUSED, None)],
    "reasoning_effort": [("low", REFUSED, None)],
    "verbosity": [("low", REFUSED, None)],
    "moderation": [({"model": "omni-moderation-latest"}, REFUSED, None)],
    "prompt_cache_retention": [("in_memory", OK, None), ("24h", REFUSED, None)],
    "prompt_cache_options": [
        ({"mode": "implicit"}, OK, None),
        ({"mode": "explicit"}, REFUSED, None),
    ],
}


def _openai_fields(module: Any) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_openai_request_field_is_honoured_or_refused_by_name(server, endpoint) -> None:
    if endpoint == "chat":
        from openai.types.chat import completion_create_params as types

        table, path, base = CHAT_FIELDS, "/v1/chat/completions", {"messages": MESSAGES}
    else:
        from openai.types import completion_create_params as types

        table, path, base = COMPLETION_FIELDS, "/v1/completions", {"prompt": PROMPT}
    assert _openai_fields(types) | {"stream"} == set(table) | {"stream"}, (
        "the official client's request fields changed: classify the new ones here"
    )
    base = {**base, "model": "tiny", "max_tokens": 3, "temperature": 0}
    for name, cases in table.items():
        for value, verdict, check in cases:
            body = {**base, name: value}
            if name == "top_logprobs":
                body["logprobs"] = True
            if name == "max_completion_tokens":
                del body["max_tokens"]
            if name == "stream_options":
                body["stream"] = True
            r = post(server, path, body)
            if verdict == REFUSED:
                assert r.status_code == 400, (name, value, r.text)
                error = r.json()["error"]
                assert error["param"] == name.split(".")[0] or error["param"].startswith(name)
                assert name in error["message"], error
                continue
            assert r.status_code == 200, (name, value, r.text)
            if check is not None:
                assert check(r.json()), (name, value, r.json())


def test_unknown_fields_are_ignored_and_logged_once(server) -> None:
    for _ in range(2):
        r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "zz_nobody": 1})
        assert r.status_code == 200
    logged = [line for line in server.lines if "zz_nobody" in line]
    assert len(logged) == 1, logged
    # extensions of other servers that would change the output are refused, not ignored
    for name, value in (("guided_json", {"type": "object"}), ("use_beam_search", True)):
        r = post(server, "/v1/completions", {"prompt": PROMPT, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = post(
        server, "/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


# ---------------------------------------------------------------- echo


@pytest.mark.parametrize(
    "prompts",
    [[PROMPT, words(9, 10, 11)], [[0, 3, 17, 42, 99, 5], [12, 13]]],  # 0: BOS, not in the text
    ids=["strings", "token-ids"],
)
def test_echo_with_and_without_logprobs(server, prompts) -> None:
    client = server.client()
    kwargs = dict(model="tiny", max_tokens=3, temperature=0)
    plain = client.completions.create(prompt=prompts, logprobs=2, **kwargs)
    echoed = client.completions.create(prompt=prompts, logprobs=2, echo=True, **kwargs)
    bare = client.completions.create(prompt=prompts, echo=True, **kwargs)
    scored = post(
        server, "/v1/completions", {"prompt": prompts, "prompt_logprobs": 2, **kwargs}
    ).json()
    for i, prompt in enumerate(prompts):
        prompt_words = prompt.split() if isinstance(prompt, str) else [WORDS[t] for t in prompt]
        prompt_text = " ".join(w for w in prompt_words if w not in (WORDS[0], WORDS[1]))
        p, e, b = plain.choices[i], echoed.choices[i], bare.choices[i]
        assert e.text == prompt_text + p.text and b.text == e.text and b.logprobs is None
        n = len(prompt_words)
        lp = e.logprobs
        assert [t.strip() for t in lp.tokens] == prompt_words + [
            t.strip() for t in p.logprobs.tokens
        ]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[n:] == pytest.approx(p.logprobs.token_logprobs, abs=1e-5)
        prompt_rows = scored["choices"][i]["prompt_logprobs"]
        for j in range(1, n):  # the engine's prompt logprobs, and each row holds the token
            word = lp.tokens[j].strip()
            assert lp.token_logprobs[j] == pytest.approx(
                prompt_rows[j][str(WORDS.index(word))]["logprob"], abs=1e-5
            )
            assert lp.token_logprobs[j] == lp.top_logprobs[j][word]
            assert len(lp.top_logprobs[j]) >= 2
        # text_offset: where each token's text starts in the choice's text
        ends = lp.text_offset[1:] + [len(e.text)]
        specials = {WORDS[0], WORDS[1]}  # BOS and EOS: in the tokens, not in the text
        assert [e.text[a:b] for a, b in zip(lp.text_offset, ends)] == [
            "" if t in specials else t for t in lp.tokens
        ]
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens


def test_echo_of_max_tokens_0_returns_the_prompt_alone(server) -> None:
    body = {"model": "tiny", "prompt": [[3, 17, 42, 99], [3, 4, 5]], "max_tokens": 0, "echo": True}
    r = post(server, "/v1/completions", {**body, "logprobs": 1}).json()
    assert [c["text"] for c in r["choices"]] == [words(3, 17, 42, 99), words(3, 4, 5)]
    assert r["usage"]["completion_tokens"] == 0
    assert len(r["choices"][1]["logprobs"]["tokens"]) == 3
    assert all(c["finish_reason"] == "length" for c in r["choices"])
    streamed = server.client().completions.create(stream=True, **{**body, "prompt": PROMPT})
    assert "".join(c.choices[0].text for c in streamed) == PROMPT
    without_echo = post(server, "/v1/completions", {**body, "echo": False})
    assert without_echo.status_code == 400 and without_echo.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_matches_the_whole_response(server) -> None:
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    client = server.client()
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)]
    assert "".join(c.text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    logprobs = [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs]
    offsets = [t for c in chunks if c.logprobs for t in c.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and logprobs == whole.logprobs.token_logprobs
    assert offsets == whole.logprobs.text_offset


# ---------------------------------------------------------------- sampler fields, usage, schema


def test_sampler_fields_reach_the_sampler(server) -> None:
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    plain = post(server, "/v1/completions", base).json()["choices"][0]["text"].split()
    allowed = post(server, "/v1/completions", {**base, "allowed_token_ids": [7, 8]}).json()
    assert set(allowed["choices"][0]["text"].split()) <= {WORDS[7], WORDS[8]}
    banned = post(server, "/v1/completions", {**base, "bad_words": [plain[0]]}).json()
    assert plain[0] not in banned["choices"][0]["text"].split()
    for bad in ({"x": 1}, {"5": 101}, {"999": 1}):
        r = post(server, "/v1/completions", {**base, "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    r = post(server, "/v1/completions", {**base, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    chat = post(
        server,
        "/v1/chat/completions",
        {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0},
    ).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3


def test_cached_tokens_count_the_prefix_cache_hits(server) -> None:
    prompt = [(5 * i + 7) % 128 for i in range(3 * BLOCK + 5)]  # three full blocks, then more
    client = server.client()
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 3 * BLOCK


def test_openapi_describes_the_request_bodies(server) -> None:
    schema = httpx.get(f"{server.url}/openapi.json").json()
    for path, model in (
        ("/v1/completions", CompletionRequest),
        ("/v1/chat/completions", ChatCompletionRequest),
    ):
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        described = schema["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]
        assert set(described["properties"]) == set(model.model_fields)
        assert {"logit_bias", "echo", "prompt_logprobs"} <= set(described["properties"]) | {"echo"}
    assert httpx.get(f"{server.url}/docs").status_code == 200


def test_the_openai_client_reads_cached_tokens_and_refusals(server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format={"type": "xml"}
        )
    assert err.value.body["param"] == "response_format"

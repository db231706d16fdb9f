"""Every 400 that names a request field carries it as the error's `param`, in the request's own
names (chat's `top_logprobs`, not the engine's `logprobs`): over-limit logprob counts refused by
the engine included; official `openai` client against `atomrt serve`."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from test_server import Server

from atomrt.runtime.entrypoints.openai.errors import RequestError, field_of


def test_a_message_about_a_field_names_it() -> None:
    assert field_of("logprobs: at most 20") == "logprobs"
    assert field_of("response_format.json_schema: must be") == "response_format"
    assert field_of("tools[0].function.name: must be") == "tools"
    assert field_of("structured_outputs + bad_words: no token") == "structured_outputs"
    assert field_of("the engine is starting") is None
    assert RequestError("seed: must be an integer").param == "seed"


@pytest.fixture(scope="module")
def server(tiny_bpe_server: Server) -> Server:
    """The session's server on the tiny BPE Llama (conftest.py)."""
    return tiny_bpe_server


def _error(call: Any) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


CHAT = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


@pytest.mark.parametrize(
    "kind,kwargs,param",
    [
        ("completions", dict(logprobs=1000), "logprobs"),
        ("completions", dict(extra_body={"prompt_logprobs": 1000}), "prompt_logprobs"),
        ("completions", dict(seed=-1), "seed"),
        ("completions", dict(extra_body={"top_k": -5}), "top_k"),
        ("chat", dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
        ("chat", dict(logprobs=True, top_logprobs=1000), "top_logprobs"),
        ("chat", dict(top_logprobs=3), "top_logprobs"),
        ("chat", dict(extra_body={"min_p": 2.0}), "min_p"),
    ],
)
def test_each_400_names_its_field_as_param(server, kind, kwargs, param) -> None:
    client = server.client()
    if kind == "chat":
        body = _error(lambda: client.chat.completions.create(**CHAT, **kwargs))
    else:
        body = _error(
            lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2, **kwargs)
        )
    assert body["param"] == param, body
    assert body["message"].startswith(param), body

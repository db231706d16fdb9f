"""The text of the EOS or stop token that ends a sequence is never in its output (vLLM's rule),
whatever `skip_special_tokens`, unless `include_stop_str_in_output`: offline, and through the
server with the mistral tool parser (which keeps special tokens in the text) and the official
`openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from grammar_harness import EOS, bpe_tokenizer, build_tiny_bpe
from test_server import CPU_FLAGS, Server

from atomrt import SamplingParams
from atomrt.runtime.entrypoints.llm import LLM

COMMON = dict(device="cpu", enforce_eager=True, num_kv_blocks=128, max_num_seqs=8)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bpe(tmp_path_factory.mktemp("stop-text") / "model")


def test_the_ending_token_text_is_not_output(tiny) -> None:
    x = bpe_tokenizer().encode("x", add_special_tokens=False)[0]
    forced = {x: 100.0}
    cases = [  # (params, text wanted)
        (SamplingParams(logit_bias={EOS: 100.0}, skip_special_tokens=False), ""),
        (SamplingParams(logit_bias={EOS: 100.0}, skip_special_tokens=True), ""),
        (SamplingParams(logit_bias=forced, stop_token_ids=[x], skip_special_tokens=False), ""),
        (
            SamplingParams(logit_bias=forced, stop_token_ids=[x], include_stop_str_in_output=True),
            "x",
        ),
        # before min_tokens an EOS does not end the sequence: its text is output (the second
        # one ends it)
        (
            SamplingParams(
                logit_bias={EOS: 100.0}, min_tokens=2, max_tokens=2, skip_special_tokens=False
            ),
            "<|im_end|>",
        ),
    ]
    with LLM(str(tiny), **COMMON) as llm:
        outs = llm.generate([[5, 6, 7]] * len(cases), [p for p, _ in cases], use_tqdm=False)
    for (params, want), out in zip(cases, outs):
        done = out.outputs[0]
        assert done.text == want, (params, done)
        assert done.finish_reason == "stop"
    assert outs[0].outputs[0].token_ids == [EOS]


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[Server]:
    args = ["--model", str(tiny), *CPU_FLAGS, "--served-model-name", "tiny"]
    s = Server(args + ["--enable-auto-tool-choice", "--tool-call-parser", "mistral"])
    yield s
    assert s.stop() == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_plain_answer_with_the_mistral_parser_has_no_eos_text(server, stream) -> None:
    client = server.client()
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
        max_tokens=8,
        logit_bias={str(EOS): 100},
    )
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.content == "" and not choice.message.tool_calls
        assert choice.finish_reason == "stop"
        return
    content, reasons = "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert content == "" and reasons[-1] == "stop"

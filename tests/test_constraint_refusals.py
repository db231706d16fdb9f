"""A request whose constraints allow no token at some position (a regex that matches nothing; a
grammar whose every allowed token `allowed_token_ids` or `bad_words` removes) ends with
finish_reason "abort" and an error naming the constraints, never emitting a token outside them,
while the other requests of its batch go on; through the server it is a 400 error object (official
`openai` client), not a 200 with empty text."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from grammar_harness import EOS, bpe_tokenizer, build_tiny_bpe
from test_server import Server

from atomrt import SamplingParams
from atomrt.runtime.entrypoints.llm import LLM

COMMON = dict(device="cpu", enforce_eager=True, num_kv_blocks=128, max_num_seqs=8)


def _greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **fields)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bpe(tmp_path_factory.mktemp("refusals") / "model")


def _one_token(word: str) -> int:
    ids = bpe_tokenizer().encode(word, add_special_tokens=False)
    assert len(ids) == 1, (word, ids)
    return ids[0]


def test_a_row_without_an_allowed_token_ends_the_request_with_an_error(tiny) -> None:
    x, y = _one_token("x"), _one_token("y")
    cases = {
        "regex": (_greedy(structured_outputs={"regex": r"[^\s\S]"}), "structured_outputs"),
        "allowed": (
            _greedy(structured_outputs={"choice": ["x", "y"]}, allowed_token_ids=[5, 6, 7]),
            "structured_outputs + allowed_token_ids",
        ),
        "bad_words": (
            _greedy(structured_outputs={"regex": "[xy]z"}, bad_words=["x", "y"]),
            "structured_outputs + bad_words",
        ),
        # a later position: "ab" then nothing the allowed list holds
        "later": (
            _greedy(structured_outputs={"regex": "xyy"}, allowed_token_ids=[x, y, 2]),
            None,
        ),
    }
    plain = _greedy()
    with LLM(str(tiny), **COMMON) as llm:
        alone = llm.generate([[5, 6, 7]], [plain], use_tqdm=False)[0].outputs[0].token_ids
        outs = llm.generate(
            [[5, 6, 7]] + [[9, 10]] * len(cases),
            [plain] + [p for p, _ in cases.values()],
            use_tqdm=False,
        )
    assert outs[0].outputs[0].token_ids == alone and outs[0].error is None
    for (name, (params, names)), out in zip(cases.items(), outs[1:]):
        done = out.outputs[0]
        if names is not None:
            assert done.finish_reason == "abort" and done.token_ids == [], name
            assert out.error and out.error.startswith(names + ": no token satisfies"), out.error
        else:  # "xyy" is allowed token by token, so it completes
            assert done.token_ids[:3] == [x, y, y] and out.error is None, (name, done)
        allowed = params.allowed_token_ids
        assert allowed is None or set(done.token_ids) <= set(allowed), name


@pytest.fixture(scope="module")
def server(tiny_bpe_server: Server) -> Server:
    """The session's server on the same tiny BPE Llama (conftest.py)."""
    return tiny_bpe_server


def test_the_server_answers_an_unsatisfiable_constraint_with_an_error_object(server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="tiny",
            prompt="hi",
            max_tokens=4,
            extra_body={"structured_outputs": {"regex": r"[^\s\S]"}},
        )
    assert "no token satisfies" in e.value.body["message"], "".join(server.lines[-40:])
    assert e.value.body["param"] == "structured_outputs"
    # streamed chat: a 400, or, once the opening chunk went out, an error event; the client
    # raises either
    with pytest.raises(openai.APIError) as e:
        for _ in client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            extra_body={"structured_outputs": {"choice": ["x", "y"]}, "allowed_token_ids": [5, 6]},
        ):
            pass
    assert "structured_outputs + allowed_token_ids: no token" in e.value.message, e.value
    ok = client.completions.create(model="tiny", prompt="hi", max_tokens=3)
    assert ok.choices[0].finish_reason == "length"


REGEXES = [r"[a-z]{3,10}", r"(yes|no|maybe)", r"[0-9]+\.[0-9]{2}", r"x+y?z", r"[^\s\S]"]


def test_random_constraints_never_emit_a_token_outside_them(tiny) -> None:
    """Random regexes with random allowed_token_ids and bad_words, in one batch: every emitted
    token is one the grammar (checked by a matcher of its own), the allowed list and the bad
    words allow; a request ends "abort" with an error exactly where no token was allowed."""
    import random

    import xgrammar as xgr

    tok = bpe_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=49152, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info)
    letters = [_one_token(c) for c in "abcdefghijklmnopqrstuvwxyz0123456789."]
    rng = random.Random(0)
    cases = []
    for _ in range(16):
        regex = rng.choice(REGEXES)
        allowed = None
        if rng.random() < 0.5:
            allowed = sorted(set(rng.sample(letters, rng.randint(1, 12))) | {EOS})
        bad = rng.sample(list("abcxyz0"), rng.randint(1, 3)) if rng.random() < 0.4 else None
        params = SamplingParams(
            temperature=rng.choice([0.0, 1.0]),
            seed=rng.randint(0, 99),
            max_tokens=10,
            structured_outputs={"regex": regex},
            allowed_token_ids=allowed,
            bad_words=bad,
        )
        cases.append((regex, params))
    with LLM(str(tiny), **COMMON) as llm:
        outs = llm.generate([[5, 6, 7]] * len(cases), [p for _, p in cases], use_tqdm=False)
    for (regex, params), out in zip(cases, outs):
        done = out.outputs[0]
        matcher = xgr.GrammarMatcher(compiler.compile_regex(regex))
        for t in done.token_ids:
            assert matcher.accept_token(t), (regex, done)
        assert params.allowed_token_ids is None or set(done.token_ids) <= set(
            params.allowed_token_ids
        )
        words = {_one_token(w) for w in params.bad_words or ()}
        assert not words & set(done.token_ids), (params.bad_words, done.token_ids)
        if done.finish_reason == "abort":
            assert out.error and "no token satisfies" in out.error, out.error
            # nothing the sampler may take was left: the matcher's next mask, less the allowed
            # list and the bad words, is empty
            mask = xgr.allocate_token_bitmask(1, 49152)
            matcher.fill_next_token_bitmask(mask)
            ok = {t for t in range(49152) if (int(mask[0, t // 32]) >> (t % 32)) & 1}
            if params.allowed_token_ids is not None:
                ok &= set(params.allowed_token_ids)
            assert not ok - words, (regex, params, sorted(ok - words)[:5])
        else:
            assert out.error is None and done.finish_reason in ("stop", "length"), done
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert "abort" in reasons and len(set(reasons)) > 1, reasons  # both kinds of end were drawn

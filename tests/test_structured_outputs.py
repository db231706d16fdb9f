"""Structured outputs in the engine: the grammar mask against its definition, requests checked at
add_request, a grammar's end finishing its request, the compile budget, and greedy tokens that do
not depend on the batch: unconstrained requests beside constrained ones keep their tokens, and a
constrained request gives the tokens it gives alone, with async scheduling, n-gram speculation,
preemption from a small KV pool and prefix caching, through mp (TP=2) and Ray (DP=2, a tiny MoE);
MTP drafts on a tiny DeepSeek-V3 are cut at the grammar and change no token."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from grammar_harness import EOS, VOCAB, bpe_tokenizer, build_tiny_bpe
from mtp_harness import build_mtp_folder
from xgrammar.testing import _is_grammar_accept_string

from atomrt import SamplingParams
from atomrt.runtime.driver.grammar_compiler import parse
from atomrt.runtime.driver.json_schema import prepare_schema
from atomrt.runtime.driver.structured_outputs import SeqGrammar, allowed_tokens
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import StructuredOutputsParams
from atomrt.workers.runner.logit_additions import apply_grammar_bitmask

COMMON = dict(device="cpu", enforce_eager=True, num_kv_blocks=128, max_num_seqs=8)


@pytest.mark.parametrize(
    "vocab,dtype,path",
    [
        (70, torch.bfloat16, "xgrammar"),
        (70, torch.float32, "torch"),
        (100, torch.float32, "xgrammar"),
    ],
)
def test_the_mask_keeps_exactly_the_allowed_tokens_of_its_rows(vocab, dtype, path) -> None:
    """Both ways of applying it (xgrammar's CPU kernel; the torch arithmetic CUDA runs), with the
    mask's last word reaching past the vocabulary (70) or the logits wider than the mask (100)."""
    from atomrt.workers.runner.logit_additions import apply_bits

    rng = np.random.default_rng(0)
    words = 3
    logits = torch.from_numpy(rng.standard_normal((5, vocab))).to(dtype)
    bitmask = rng.integers(-(2**31), 2**31, size=(2, words), dtype=np.int64).astype(np.int32)
    rows = [3, 1]
    if path == "torch":
        got = logits.clone()
        apply_bits(got, torch.tensor(rows), torch.from_numpy(bitmask))
        if vocab > 32 * words:
            got[rows, 32 * words :] = float("-inf")
    else:
        got = apply_grammar_bitmask(logits.clone(), torch.tensor(rows), torch.from_numpy(bitmask))
    assert got.dtype == torch.float32
    want = logits.double().clone()
    for i, r in enumerate(rows):  # the definition: bit t % 32 of word t // 32
        for t in range(vocab):
            if t >= 32 * words or not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    assert torch.equal(got[finite].double(), want[finite])
    assert allowed_tokens(bitmask[0])[:70].tolist() == (~torch.isinf(want[3]))[:70].tolist()


def test_sampling_params_check_the_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one of .*got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one .* none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"structured_outputs\.json: not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match=r"structured_outputs\.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match=r"structured_outputs\.max_whitespace"):
        StructuredOutputsParams(json_object=True, max_whitespace=0)
    with pytest.raises(ValueError, match="unknown field 'guided_json'"):
        SamplingParams(structured_outputs={"guided_json": {}})
    so = SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs
    assert isinstance(so, StructuredOutputsParams) and so.kind == "regex"


def test_keywords_the_grammar_cannot_enforce_are_refused() -> None:
    ok = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"enum": ["not"]}}}
    prepare_schema(ok)  # property names and enum values are not keywords
    for bad, word in (
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ({"allOf": [{"type": "string", "pattern": "a"}, {"pattern": "b"}]}, "'pattern' at #"),
        ({"$defs": {"x": {"if": {"type": "integer"}}}}, "if"),
        # xgrammar keeps a pattern or a format and drops a length beside it
        ({"type": "string", "pattern": "^[a-z]+(b|c)$", "maxLength": 3}, "'maxLength' at # beside"),
        (
            {"properties": {"e": {"format": "email", "minLength": 5}}},
            "'minLength' at #/properties/e beside 'format'",
        ),
    ):
        with pytest.raises(ValueError, match=word):
            prepare_schema(bad)


def test_a_length_bounded_string_is_json_at_any_length(capfd) -> None:
    """The backend's bounded repeat (cheap at any length) of a JSON string character: no raw
    control character, and no escape sequence (an escape alternative in the repeated rule makes
    the backend's token mask about 1000x slower to fill inside the string)."""
    import time

    so = SamplingParams(structured_outputs={"json": {"type": "string", "maxLength": 4}})
    grammar = parse(so.structured_outputs)
    assert "is not supported" not in capfd.readouterr().err  # no length left for it to drop
    for text, ok in (
        ('""', True),
        ('"ab c"', True),
        ('"a\\nb"', False),
        ('"\\u00e9\\"xy"', False),
        ('"é\'xy"', True),
        ('"abcde"', False),
        ('"a\x01"', False),
    ):
        assert _is_grammar_accept_string(grammar, text) is ok, text
    start = time.perf_counter()
    long = {"type": "object", "properties": {"u": {"type": "string", "maxLength": 8192}}}
    parse(SamplingParams(structured_outputs={"json": long}).structured_outputs)
    assert time.perf_counter() - start < 1.0


# ------------------------------------------------------------------------------- the engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}
PROMPTS = [
    [504, 1090, 4401, 28, 504, 1090, 4401, 28, 504, 1090, 4401, 28],
    [9, 90, 900, 9000, 90, 900],
    [1521, 1521, 1521, 33, 1521, 1521],
    [7000, 7001, 7002, 7003],
    [41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
]


def _greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, **fields)


REQUESTS = [
    _greedy(structured_outputs={"json": SCHEMA}),
    _greedy(),
    _greedy(structured_outputs={"regex": r"(ab|cd){1,4}[0-9]{2,4}"}),
    _greedy(structured_outputs={"choice": ["alpha", "beta gamma", "delta"]}),
    _greedy(),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bpe(tmp_path_factory.mktemp("structured") / "model")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bpe(tmp_path_factory.mktemp("structured-moe") / "model", moe=True)


def _alone(model: Path) -> list[list[int]]:
    """Each request run by itself."""
    with LLM(str(model), **COMMON) as llm:
        return [
            llm.generate([p], [r], use_tqdm=False)[0].outputs[0].token_ids
            for p, r in zip(PROMPTS, REQUESTS)
        ]


@pytest.fixture(scope="module")
def alone(tiny: Path) -> list[list[int]]:
    return _alone(tiny)


def _check_valid(texts: list[str]) -> None:
    import jsonschema

    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(r"(ab|cd){1,4}[0-9]{2,4}", texts[2])
    assert texts[3] in ("alpha", "beta gamma", "delta")


def test_constrained_outputs_end_with_their_grammar_and_validate(tiny, alone) -> None:
    with LLM(str(tiny), **COMMON) as llm:
        outs = llm.generate(PROMPTS, REQUESTS, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    _check_valid(texts)
    assert max(len(ws) for ws in re.findall(r"\s+", texts[0])) <= 4  # the default bound
    for i in (0, 2, 3):  # ignore_eos: the grammar's end finishes them
        c = outs[i].outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] == EOS, (i, c)
    assert [o.outputs[0].token_ids for o in outs] == alone


SETTINGS = {
    "inproc-async-ngram-preempt-prefix": dict(
        async_scheduling=True,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 2,
            "adaptive": False,  # every decode step verifies drafts
        },
        num_kv_blocks=24,
        block_size=4,
        enable_prefix_caching=True,
    ),
    "mp-tp2-async": dict(executor="mp", tensor_parallel_size=2, async_scheduling=True),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_batch_gives_each_request_its_tokens_alone(tiny, alone, name) -> None:
    with LLM(str(tiny), **{**COMMON, **SETTINGS[name]}) as llm:
        outs = llm.generate(PROMPTS * 2, REQUESTS * 2, use_tqdm=False)  # a second copy: cached
        engine = llm.engine
        spec = engine.stats.spec_decode
        preemptions = sum(s.num_preemptions for s in engine.schedulers)
    assert [o.outputs[0].token_ids for o in outs] == alone * 2
    if spec is not None:
        assert spec.num_drafts > 0 and preemptions > 0


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MTP tests' tiny DeepSeek-V3 with a layer that predicts it, over the BPE vocabulary."""
    folder = tmp_path_factory.mktemp("structured-mtp")
    build_mtp_folder(folder, predicting=True, overrides=VOCAB)
    bpe_tokenizer().hf.save_pretrained(folder)
    return folder


def test_mtp_drafts_are_cut_at_the_grammar_and_tokens_do_not_change(tiny_mtp, monkeypatch) -> None:
    cuts = []
    valid_drafts = SeqGrammar.valid_drafts

    def recording(self, proposal, pad_to=0):
        kept = valid_drafts(self, proposal, pad_to)
        cuts.append(len(kept) < len(proposal))
        return kept

    monkeypatch.setattr(SeqGrammar, "valid_drafts", recording)
    with LLM(str(tiny_mtp), **COMMON) as llm:
        plain = llm.generate(PROMPTS, REQUESTS, use_tqdm=False)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(str(tiny_mtp), **COMMON, async_scheduling=True, speculative_config=mtp) as llm:
        outs = llm.generate(PROMPTS, REQUESTS, use_tqdm=False)
        spec = llm.engine.stats.spec_decode
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    _check_valid([o.outputs[0].text for o in outs])
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    assert any(cuts)  # the layer predicts the unconstrained target: the grammar refuses drafts


# DP=2 through mp by default; through Ray `slow` (Ray's DP=2 with n-gram drafts and async
# scheduling runs by default in test_logit_additions, and both executors carry the plans, grammar
# bitmasks included, over the same StepChannel)
@pytest.mark.parametrize("executor", ["mp", pytest.param("ray", marks=pytest.mark.slow)])
def test_dp2_on_a_tiny_moe_gives_each_request_its_tokens_alone(tiny_moe, executor) -> None:
    want = _alone(tiny_moe)
    settings = dict(
        executor=executor,
        data_parallel_size=2,
        async_scheduling=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
    )
    with LLM(str(tiny_moe), **{**COMMON, **settings}) as llm:
        outs = llm.generate(PROMPTS * 2, REQUESTS * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want * 2


def test_a_bad_constraint_ends_its_request_with_an_error_naming_the_field(tiny) -> None:
    """Parsed on the compile threads (never at add_request): the request ends once, with
    finish_reason "abort" and the error, and the others run."""
    cases = [
        ({"json": {"type": "objekt"}}, "structured_outputs.json"),
        ({"regex": "a(b"}, "structured_outputs.regex"),
        ({"grammar": "root ::= missing"}, "structured_outputs.grammar"),
        ({"json": {"type": "array", "uniqueItems": True}}, "'uniqueItems' at #"),
    ]
    params = [SamplingParams(max_tokens=4, structured_outputs=so) for so, _ in cases]
    with LLM(str(tiny), **COMMON) as llm:
        outs = llm.generate([[5, 6]] * (len(cases) + 1), [*params, _greedy()], use_tqdm=False)
        assert not llm.engine.has_unfinished()
    for (_, field), out in zip(cases, outs):
        assert field in out.error and out.outputs[0].finish_reason == "abort", out
        assert not out.outputs[0].token_ids
    assert outs[-1].error is None and len(outs[-1].outputs[0].token_ids) == 48


def _slow_schema(n: int) -> dict:
    """A schema whose compile takes a while: many properties, each a different pattern."""
    props = {
        f"p{i}": {
            "type": "string",
            "pattern": f"^[a-{chr(98 + i % 24)}]{{{i % 7 + 1},{i % 7 + 9}}}$",
        }
        for i in range(n)
    }
    return {"type": "object", "properties": props, "required": list(props)}


def test_a_grammar_over_the_compile_budget_fails_its_request_while_others_stream(tiny) -> None:
    budget = 0.05
    with LLM(str(tiny), **COMMON, grammar_compile_timeout_s=budget) as llm:
        engine = llm.engine
        plain = engine.add_request(PROMPTS[1], _greedy(), stream=True)
        streamed = sum(len(o.outputs[0].token_ids) for _ in range(3) for o in engine.step())
        slow = engine.add_request(  # compiles for about half a second
            PROMPTS[0], _greedy(structured_outputs={"json": _slow_schema(120)}), stream=True
        )
        failed, while_compiling = None, 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == slow:
                    failed = out
                elif out.request_id == plain:
                    streamed += len(out.outputs[0].token_ids)
                    while_compiling += failed is None and len(out.outputs[0].token_ids)
        stats = engine.grammars.compiler.stats
    assert failed is not None and failed.finished and failed.outputs[0].token_ids == []
    assert (
        "grammar_compile_timeout_s" in failed.error and failed.outputs[0].finish_reason == "abort"
    )
    assert streamed == 48 and while_compiling > 0 and stats.timeouts == 1


def test_drafts_are_cut_at_the_grammar_and_each_verify_row_gets_its_position_mask() -> None:
    import xgrammar as xgr
    from grammar_harness import bpe_tokenizer

    from atomrt.runtime.config import StructuredOutputsConfig
    from atomrt.runtime.driver.grammar_compiler import GrammarCompiler
    from atomrt.runtime.driver.structured_outputs import SeqGrammar

    tok = bpe_tokenizer()
    compiler = GrammarCompiler(tok.hf, 49152, [EOS], StructuredOutputsConfig())
    so = StructuredOutputsParams(regex="(hello|help) world [0-9]{2}")
    compiled = compiler.compile(so).result()
    good = tok.encode("hello world 42", add_special_tokens=False)
    bad = tok.encode("hello there", add_special_tokens=False)
    g = SeqGrammar(compiled, [EOS], 49152)
    assert g.valid_drafts(good) == good  # every token allowed: kept, and the matcher is back
    cut = g.valid_drafts(bad)
    assert cut == bad[: len(cut)] and len(cut) < len(bad)
    padded = g.valid_drafts(bad, pad_to=len(bad) + 2)
    assert len(padded) == len(bad) + 2 and padded[: len(cut)] == cut
    bitmask = np.zeros((len(good) + 1, 1536), dtype=np.int32)
    g.fill_verify(torch.from_numpy(bitmask), 0, good)
    for i in range(len(good) + 1):  # a fresh matcher advanced through the drafts before row i
        m = xgr.GrammarMatcher(compiled, override_stop_tokens=[EOS])
        for t in good[:i]:
            assert m.accept_token(t)
        want = xgr.allocate_token_bitmask(1, 49152)
        m.fill_next_token_bitmask(want, 0)
        assert np.array_equal(bitmask[i], want.numpy()[0]), i
    # a refused draft (never sent: drafts are checked) opens its later rows, and only those
    rows = np.full((len(bad) + 2, 1536), 7, dtype=np.int32)
    g.fill_verify(torch.from_numpy(rows), 0, bad)
    assert (rows[len(cut) + 1 : len(bad) + 1] == -1).all() and (rows[len(bad) + 1] == 7).all()
    for t in padded:  # the matcher did not move: the whole padded proposal is still allowed
        assert g.accept(t)
    compiler.shutdown()


def test_greedy_under_a_grammar_is_the_argmax_of_the_masked_logits() -> None:
    from atomrt.workers.runner.logit_additions import greedy_under_grammar

    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.standard_normal((6, 100)).astype(np.float32))
    bitmask = rng.integers(-(2**31), 2**31, size=(4, 3), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1  # every token allowed: the row keeps its argmax
    rows = torch.tensor([0, 2, 3, 5])
    want = logits.argmax(dim=-1)
    masked = apply_grammar_bitmask(logits.clone(), rows, torch.from_numpy(bitmask))
    want[rows] = masked[rows].argmax(dim=-1)
    got = greedy_under_grammar(logits.clone(), rows, torch.from_numpy(bitmask))
    assert torch.equal(got, want)
    assert any(got[r] != logits[r].argmax() for r in rows.tolist())  # some rows were corrected


def test_a_tokenizer_the_backend_cannot_read_makes_constrained_requests_a_value_error() -> None:
    from types import SimpleNamespace

    from atomrt.runtime.config import StructuredOutputsConfig
    from atomrt.runtime.driver.structured_outputs import StructuredOutputs

    so = StructuredOutputs(SimpleNamespace(hf=object()), 100, [1], StructuredOutputsConfig())
    with pytest.raises(ValueError, match="grammar backend cannot read this tokenizer"):
        so.prepare(SamplingParams(structured_outputs={"regex": "a"}))
    so.shutdown()


def test_every_kind_of_constraint_runs(tiny) -> None:
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "tagged!"}}
    kinds = [
        ({"structural_tag": tag}, lambda t: t == "tagged!"),
        ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
        ({"json": {"type": "integer"}, "disable_any_whitespace": True}, lambda t: t.isdigit()),
    ]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured_outputs=so)
        for i, (so, _) in enumerate(kinds)
    ]
    with LLM(str(tiny), **COMMON) as llm:
        outs = llm.generate([PROMPTS[0]] * len(kinds), params, use_tqdm=False)
    for (so, ok), out in zip(kinds, outs):
        assert out.outputs[0].finish_reason == "stop" and ok(out.outputs[0].text), (so, out)


def test_a_compile_over_the_budget_gives_each_request_one_final_output(tiny) -> None:
    """Streamed or not, one sample or several: the request ends once, with finish_reason "abort"
    and the error, and the engine goes on with the others (offline, `generate` returns)."""
    with LLM(str(tiny), **COMMON, grammar_compile_timeout_s=0.05) as llm:
        engine = llm.engine
        slow = {
            (stream, n): engine.add_request(
                PROMPTS[0],
                SamplingParams(
                    n=n, max_tokens=8, structured_outputs={"json": _slow_schema(100 + 4 * n + s)}
                ),
                stream=stream,
            )
            for s, stream in enumerate((False, True))
            for n in (1, 2)
        }
        plain = engine.add_request(PROMPTS[1], _greedy())
        finals: dict[str, list] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals.setdefault(out.request_id, []).append(out)
        outs = llm.generate(
            [PROMPTS[0], PROMPTS[1]],
            [SamplingParams(structured_outputs={"json": _slow_schema(131)}), _greedy()],
            use_tqdm=False,
        )
    assert all(len(v) == 1 for v in finals.values()) and set(finals) == {plain, *slow.values()}
    for (_, n), rid in slow.items():
        out = finals[rid][0]
        assert "grammar_compile_timeout_s" in out.error, out
        assert sorted(c.index for c in out.outputs) == list(range(n))
        assert all(c.finish_reason == "abort" and not c.token_ids for c in out.outputs)
    assert finals[plain][0].error is None and len(finals[plain][0].outputs[0].token_ids) == 48
    assert (
        "grammar_compile_timeout_s" in outs[0].error and outs[0].outputs[0].finish_reason == "abort"
    )
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 48

"""JSON whitespace bounds (`max_whitespace`): the xgrammar backend writes xgrammar's counted repeat of
a whitespace character out as one alternative per count (runtime/driver/xgrammar_backend.py), which
must allow exactly what xgrammar's own bounded grammar allows. Random walks through each schema,
leaning on whitespace tokens to run into the bound, compare the two grammars' token masks at every
step over the embedded SmolLM2 tokenizer's 49k vocabulary."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from grammar_harness import EOS, bpe_tokenizer

from atomrt.runtime.driver.grammar_compiler import parse
from atomrt.runtime.driver.json_schema import prepare_schema
from atomrt.runtime.driver.xgrammar_backend import INLINE_WHITESPACE_MAX
from atomrt.runtime.sampling_params import StructuredOutputsParams

xgr = pytest.importorskip("xgrammar")

SCHEMAS = {
    "object": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            "inner": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "note": {"type": "string"}},
                "required": ["ok", "note"],
            },
        },
        "required": ["id", "tags", "inner"],
    },
    "array of numbers": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
}


def _repeat(bound: int) -> re.Pattern:
    """xgrammar's counted repeat of its one-character whitespace rule."""
    return re.compile(rf"whitespace(_\d+)?\{{0, {bound}\}}")


@pytest.fixture(scope="module")
def vocab():
    tok = bpe_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=49152, stop_token_ids=[EOS])
    texts = tok.hf.batch_decode([[i] for i in range(49152)])
    blank = [i for i, t in enumerate(texts) if t and not t.strip(" \n\r\t")]
    return xgr.GrammarCompiler(info, cache_enabled=False), blank


def _walks(compiler, ours, reference, blank: list[int], seed: int, steps: int = 60) -> int:
    """Walk both grammars on the same tokens, comparing their masks; the steps compared."""
    a, b = compiler.compile_grammar(ours), compiler.compile_grammar(reference)
    masks = xgr.allocate_token_bitmask(2, 49152)
    rng = random.Random(seed)
    compared = 0
    for _ in range(10):
        ma, mb = xgr.GrammarMatcher(a), xgr.GrammarMatcher(b)
        for _ in range(steps):
            ma.fill_next_token_bitmask(masks, 0)
            mb.fill_next_token_bitmask(masks, 1)
            assert torch.equal(masks[0], masks[1]), f"masks differ after {compared} steps"
            compared += 1
            bits = masks[0].view(torch.uint8).numpy()
            allowed = [i for i in range(49152) if bits[i >> 3] >> (i & 7) & 1]
            ws = [i for i in blank if bits[i >> 3] >> (i & 7) & 1]
            token = rng.choice(ws if ws and rng.random() < 0.7 else allowed)
            assert ma.accept_token(token) and mb.accept_token(token)
            if ma.is_terminated():
                break
    return compared


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("bound", [1, 2, 4, INLINE_WHITESPACE_MAX])
def test_the_written_out_bound_allows_what_xgrammars_bound_does(vocab, name, bound) -> None:
    compiler, blank = vocab
    schema = SCHEMAS[name]
    ours = parse(StructuredOutputsParams(json=schema, max_whitespace=bound))
    assert not _repeat(bound).search(str(ours))  # written out
    reference = xgr.Grammar.from_json_schema(
        json.dumps(prepare_schema(schema)), max_whitespace_cnt=bound, strict_mode=True
    )
    assert bound == 1 or _repeat(bound).search(str(reference))  # xgrammar writes 1 as an option
    assert _walks(compiler, ours, reference, blank, seed=bound) >= 40


def test_bounds_past_the_written_out_ones_stay_xgrammars_repeat() -> None:
    bound = INLINE_WHITESPACE_MAX + 1
    grammar = parse(StructuredOutputsParams(json=SCHEMAS["object"], max_whitespace=bound))
    assert _repeat(bound).search(str(grammar))


def test_a_run_of_whitespace_past_the_bound_is_refused() -> None:
    from xgrammar.testing import _is_grammar_accept_string

    grammar = parse(StructuredOutputsParams(json_object=True, max_whitespace=3))
    assert _is_grammar_accept_string(grammar, '{ \n\t"a":\n\n\n1}')
    assert not _is_grammar_accept_string(grammar, '{ \n\t "a": 1}')
    assert not _is_grammar_accept_string(grammar, '{"a":\n\n\n\n1}')
    assert not _is_grammar_accept_string(grammar, '{"a": "x"    }')

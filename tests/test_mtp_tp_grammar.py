"""MTP with TP=2 (mp executor, gloo on the CPU) and grammar-constrained greedy requests: the
grammar masks apply on TP rank 0 only, so its sampled tokens are broadcast before every rank drafts
from them; the drafts, and so the acceptance, are those of TP=1, and the tokens are the same."""

from __future__ import annotations

from pathlib import Path

import pytest
from grammar_harness import VOCAB, bpe_tokenizer
from mtp_harness import build_mtp_folder

from atomrt import SamplingParams
from atomrt.runtime.entrypoints.llm import LLM

COMMON = dict(device="cpu", enforce_eager=True, num_kv_blocks=128, max_num_seqs=8)
MTP = {"method": "mtp", "num_speculative_tokens": 2}
PROMPTS = [[5, 6, 7, 8], [11, 12, 13], [21, 22, 23, 24, 25], [31, 32]]


def _greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, **fields)


# every request greedy and constrained (the all-greedy batch whose tokens only rank 0 masks), to a
# grammar that often refuses the target's argmax and allows most of what the layer drafts
REQUESTS = [_greedy(structured_outputs={"regex": "[^aeiou]+"})] * len(PROMPTS)


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("mtp-tp-grammar")
    build_mtp_folder(folder, predicting=True, overrides=VOCAB)
    bpe_tokenizer().hf.save_pretrained(folder)
    return folder


def _run(folder: Path, **extra) -> tuple[list[list[int]], list[float]]:
    with LLM(str(folder), **COMMON, speculative_config=MTP, **extra) as llm:
        outs = llm.generate(PROMPTS, REQUESTS, use_tqdm=False)
        spec = llm.engine.stats.spec_decode
    rates = [a / spec.num_drafts for a in spec.accepted_per_position]
    return [o.outputs[0].token_ids for o in outs], rates


def test_tp_ranks_draft_from_the_same_masked_tokens(tiny_mtp) -> None:
    tokens, rates = _run(tiny_mtp)
    tp_tokens, tp_rates = _run(tiny_mtp, executor="mp", tensor_parallel_size=2)
    assert tp_tokens == tokens
    assert rates[0] > 0.5  # the layer predicts the target: drafts are accepted
    for a, b in zip(rates, tp_rates):  # the same drafts (up to rare float ties)
        assert abs(a - b) <= 0.05, (rates, tp_rates)

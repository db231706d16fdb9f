"""The engine end to end on the embedded SmolLM2-135M-Instruct (CPU, float32, in-process executor).

- The chat answer to "What is the capital of France?" names Paris.
- The first 32 greedy tokens for three fixed prompts equal transformers' on the same GGUF weights.
- Batch invariance: a request's greedy tokens are the same alone, in a batch of 16 mixed-length
  requests, with chunked prefill, and after preemption and recompute.
- Bad input is a ValueError naming the problem, and the engine stays usable.
"""

import pytest
import torch

from atomrt import SamplingParams
from atomrt.runtime.config import DEFAULT_MODEL
from atomrt.runtime.entrypoints.llm import LLM

PROMPTS = [
    "The capital of Germany is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
GREEDY32 = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(DEFAULT_MODEL)
    yield engine
    engine.shutdown()


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_chat_answer_names_paris(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].finished and out[0].outputs[0].finish_reason in ("stop", "length")


def test_first_32_greedy_tokens_match_transformers(llm, embedded_hf):
    hf = embedded_hf
    ours = _tokens(llm.generate(PROMPTS, GREEDY32))
    for prompt, our_tokens in zip(PROMPTS, ours):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=0
            )
        theirs = gen[0, len(ids) :].tolist()
        eos = set(llm.tokenizer.eos_token_ids)
        if theirs and theirs[-1] in eos:
            pass  # both stop at EOS, including it
        assert our_tokens == theirs, prompt


def _mixed_prompts(llm) -> list[str]:
    words = (
        "the a of GPU graph token kernel cache scheduler block prefill decode bucket pool".split()
    )
    return [
        " ".join(words[(i * 3) % len(words) :] + words[: (i * 5) % 7 + 1]) + f" story {i}:"
        for i in range(16)
    ]


def test_batch_invariance_alone_vs_batch_of_16(llm):
    prompts = _mixed_prompts(llm)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batch = _tokens(llm.generate(prompts, params))
    assert len({len(llm.tokenizer.encode(p)) for p in prompts}) > 4  # mixed lengths
    for i in (0, 7, 15):
        alone = _tokens(llm.generate([prompts[i]], params))[0]
        assert alone == batch[i], i


def test_batch_invariance_chunked_prefill_and_preemption(llm):
    prompts = _mixed_prompts(llm)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = _tokens(llm.generate(prompts, params))
    chunked = LLM(DEFAULT_MODEL, max_num_batched_tokens=16, enable_chunked_prefill=True)
    try:
        assert _tokens(chunked.generate(prompts, params)) == reference
    finally:
        chunked.shutdown()
    # 24 blocks of 16 tokens cannot hold 16 requests of ~20-40 tokens at once: preemption recomputes.
    tight = LLM(DEFAULT_MODEL, num_kv_blocks=24, enable_prefix_caching=False)
    try:
        outs = tight.generate(prompts, params)
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        assert _tokens(outs) == reference
    finally:
        tight.shutdown()


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", None, "empty"),
        ("x " * 9000, None, "max_model_len"),
        ("hello", dict(max_tokens=0), "max_tokens"),
        ("hello", dict(temperature=-0.5), "temperature"),
        ("hello", dict(top_p=0.0), "top_p"),
        ("hello", dict(top_p=1.5), "top_p"),
        ([10**9], None, "out of range"),
        ([True, 5], None, "token ids"),
        ([1.5, 5], None, "token ids"),
    ],
)
def test_bad_input_is_a_clear_error_and_engine_stays_usable(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(**params) if params else None)
    ok = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2))
    assert len(ok[0].outputs[0].token_ids) == 2


def test_token_ids_of_any_integer_type_are_the_same_prompt(llm):
    import numpy as np

    params = SamplingParams(temperature=0, max_tokens=3)
    ids = [1, 9690, 198, 2683]
    plain = llm.generate([ids], params)[0].outputs[0].token_ids
    as_numpy = llm.generate([[np.int64(t) for t in ids]], params)[0].outputs[0].token_ids
    assert list(as_numpy) == list(plain)


def test_bad_prompt_in_a_batch_runs_nothing(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine prompt", ""], SamplingParams(max_tokens=2))
    assert not any(s.has_unfinished() for s in llm.engine.schedulers)  # nothing runs
    outs = llm.engine.step()  # the rolled-back request's final output
    assert [o.outputs[0].finish_reason for o in outs] == [
        "abort"
    ] and not llm.engine.has_unfinished()


def test_unknown_model_and_corrupt_files(tmp_path):
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))
    bad_gguf = tmp_path / "broken.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad_gguf))
    folder = tmp_path / "broken-st"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}'
    )
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="broken-st"):
        LLM(str(folder))


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    a = _tokens(llm.generate(["Tell me a story"], p))[0]
    b = _tokens(
        llm.generate(
            ["Tell me a story", "Another prompt here"],
            [p, SamplingParams(temperature=1.0, max_tokens=10)],
        )
    )[0]
    assert a == b


def test_stop_strings_and_logprobs(llm):
    out = llm.generate(
        ["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=20, stop=[" 6"], logprobs=2)
    )[0]
    c = out.outputs[0]
    assert " 6" not in c.text and c.finish_reason == "stop" and c.stop_reason == " 6"
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    assert all(tok in row for tok, row in zip(c.token_ids, c.logprobs))


def test_prefix_cache_hits_reuse_blocks_and_give_identical_output(llm):
    """A prompt sharing 3+ full blocks with an earlier one computes only its tail, same tokens;
    `RequestOutput.num_cached_tokens` counts the hits."""
    shared = "You are a helpful assistant. Answer briefly and precisely, in one sentence. " * 5
    prompts = [shared + "What is a GPU?", shared + "What is a CPU?"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    bm = llm.engine.schedulers[0].block_manager
    without = LLM(DEFAULT_MODEL, enable_prefix_caching=False)
    try:
        reference = _tokens(without.generate(prompts, params))
    finally:
        without.shutdown()
    llm.generate([shared + "Hello"], params)  # fills the prefix cache
    hits_before = bm.num_prefix_hit_tokens
    outs = llm.generate(prompts, params)
    assert _tokens(outs) == reference
    hits = bm.num_prefix_hit_tokens - hits_before
    assert hits >= 2 * 3 * bm.block_size
    assert sum(o.num_cached_tokens for o in outs) == hits  # each request's hits, as vLLM's


def test_each_request_gets_its_own_number_of_logprobs(llm):
    params = [
        SamplingParams(temperature=0, max_tokens=3, logprobs=1),
        SamplingParams(temperature=0, max_tokens=3, logprobs=4),
        SamplingParams(temperature=0, max_tokens=3),
    ]
    outs = llm.generate(["One", "Two", "Three"], params)
    one, four, none = (o.outputs[0] for o in outs)
    assert none.logprobs is None
    for c, k in ((one, 1), (four, 4)):
        for tok, row in zip(c.token_ids, c.logprobs):
            assert (
                tok in row and k <= len(row) <= k + 1
            )  # the top k, plus the sampled token if not among them


def stream_beside_a_quiet_request(llm, params: SamplingParams):
    """Generate "Tell me about Paris." alone, then again streamed beside a request that is not:
    (final output alone, the streamed text pieces, their tokens, `finished` of each quiet output)."""
    final = llm.generate(["Tell me about Paris."], params)[0].outputs[0]
    engine = llm.engine
    rid = engine.add_request("Tell me about Paris.", params, stream=True)
    quiet = engine.add_request("Another request that is not streamed", params)
    pieces, tokens, seen_quiet = [], [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                pieces.append(out.outputs[0].text)
                tokens += out.outputs[0].token_ids
            elif out.request_id == quiet:
                seen_quiet.append(out.finished)
    return final, pieces, tokens, seen_quiet


def test_streamed_request_gets_deltas_that_join_to_the_final_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    final, pieces, tokens, seen_quiet = stream_beside_a_quiet_request(llm, params)
    assert "".join(pieces) == final.text and tokens == final.token_ids
    assert len(pieces) == 12  # one delta per generated token
    assert seen_quiet == [True]  # a request that is not streamed appears once, finished

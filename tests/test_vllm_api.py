"""vLLM's offline API as vLLM's docs call it: prompt forms, LLM(seed=...), the engine loop.

A tiny Llama (word-level tokenizer: "af bb" is tokens [5, 9]) keeps these fast; each call below is
written as vLLM's documentation or examples write it.
"""

from __future__ import annotations

import time

import pytest
from executor_harness import COMMON, WORDS, build_tiny_llama, save_word_tokenizer

from atomrt import LLM, SamplingParams
from atomrt.runtime.driver.engine import LLMEngine
from atomrt.runtime.entrypoints.config_args import EngineArgs
from atomrt.runtime.inputs import TextPrompt, TokensPrompt
from atomrt.runtime.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_word_tokenizer(build_tiny_llama(tmp_path_factory.mktemp("tiny"))))


def _text(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


@pytest.fixture(scope="module")
def llm(model: str):
    llm = LLM(model, **COMMON)
    yield llm
    llm.shutdown()


def test_every_prompt_form_gives_the_same_tokens(llm: LLM) -> None:
    ids = [5, 9, 17, 3]
    text = _text(ids)
    forms = [
        ids,
        text,
        TextPrompt(prompt=text),
        TokensPrompt(prompt_token_ids=ids),
        {"prompt_token_ids": ids, "prompt": "the text"},
    ]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids] * len(forms)
    first = outs[0].outputs[0].token_ids
    assert all(o.outputs[0].token_ids == first for o in outs)
    assert [o.prompt for o in outs] == [None, text, text, None, "the text"]
    m = outs[0].metrics  # wall-clock times, as vLLM's
    assert abs(m.arrival_time - time.time()) < 600
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    # one prompt of each form alone is one request, not a list of them
    for one in (ids, text, {"prompt": text}, {"prompt_token_ids": ids}):
        (out,) = llm.generate(one, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == first


@pytest.mark.parametrize(
    "prompt, field",
    [
        ({"prompt_ids": [1, 2]}, "prompt.prompt_ids"),
        ({"prompt_token_ids": "af bb"}, "prompt.prompt_token_ids"),
        ({"prompt_token_ids": [1, 2.5]}, "prompt.prompt_token_ids"),
        ({"prompt": 5}, "prompt.prompt"),
        ({"prompt": "af", "multi_modal_data": {"image": None}}, "prompt.multi_modal_data"),
        ({}, "prompt"),
        (3.5, "prompt"),
    ],
)
def test_a_malformed_prompt_is_refused_by_name(llm: LLM, prompt: object, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_llm_seed_makes_unseeded_sampling_repeat(model: str) -> None:
    """vLLM's reproducibility example: LLM(seed=...) and unseeded sampled requests."""
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 17], [7, 1, 20, 21]]

    def run(seed: int) -> list[list[int]]:
        with LLM(model, seed=seed, **COMMON) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    first, again, other = run(42), run(42), run(7)
    assert first == again
    assert first != other


def test_engine_loop_in_vllms_order(model: str) -> None:
    """vLLM's llm_engine_example: from_engine_args, add_request(id, prompt, params), step()."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **COMMON))
    try:
        engine.add_request("0", _text([5, 9, 17]), SamplingParams(**_greedy(max_tokens=4)))
        engine.add_request(
            "1",
            {"prompt_token_ids": [5, 9, 17]},
            SamplingParams(**_greedy(max_tokens=4, output_kind=RequestOutputKind.DELTA)),
        )
        engine.add_request(
            "2",
            [5, 9, 17],
            SamplingParams(**_greedy(max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY)),
        )
        seen: dict[str, list] = {"0": [], "1": [], "2": []}
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id].append(out)
        final = seen["2"]
        assert len(final) == 1 and final[0].finished
        tokens = final[0].outputs[0].token_ids
        assert len(tokens) == 4
        # CUMULATIVE (vLLM's default): every output holds all tokens so far; DELTA: the new ones
        cumulative = [o.outputs[0].token_ids for o in seen["0"]]
        assert cumulative[-1] == tokens and len(cumulative) == len(tokens)
        assert all(a == cumulative[-1][: len(a)] for a in cumulative)
        assert [t for o in seen["1"] for t in o.outputs[0].token_ids] == tokens
        assert seen["0"][-1].finished and not seen["0"][0].finished
        assert seen["0"][-1].prompt == _text([5, 9, 17])
        assert engine.reset_prefix_cache() is True
        # the older form still works: add_request(prompt, params, request_id=...)
        engine.add_request([5, 9, 17], SamplingParams(**_greedy(max_tokens=4)), "old")
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert [o.outputs[0].token_ids for o in outs] == [tokens]
        with pytest.raises(ValueError, match="priority"):
            engine.add_request("3", [5, 9], SamplingParams(), priority=1)
        with pytest.raises(ValueError, match="lora_request"):
            engine.add_request("3", [5, 9], SamplingParams(), lora_request=object())
    finally:
        engine.shutdown()


def test_vllms_sampling_params_fields(llm: LLM) -> None:
    max_len = llm.engine.max_model_len
    prompt = list(range(3, 23))
    # max_tokens=None: as many as the context leaves
    (out,) = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False
    )
    assert len(out.outputs[0].token_ids) == max_len - len(prompt)
    assert out.outputs[0].finish_reason == "length"
    # truncate_prompt_tokens: the prompt's last k tokens
    (cut,) = llm.generate(prompt, SamplingParams(**_greedy(truncate_prompt_tokens=5)))
    (tail,) = llm.generate(prompt[-5:], GREEDY, use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-5:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    # detokenize=False: token ids, no text
    (ids_only,) = llm.generate(prompt, SamplingParams(**_greedy(detokenize=False)))
    assert ids_only.outputs[0].text == "" and ids_only.outputs[0].token_ids
    sp = SamplingParams(extra_args={"mine": 1}, spaces_between_special_tokens=True)
    assert sp.extra_args == {"mine": 1}
    for bad, field in (
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"detokenize": False, "stop": ["x"]}, "stop"),
        ({"output_kind": 7}, "output_kind"),
        ({"extra_args": [1]}, "extra_args"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)


def _greedy(**kwargs: object) -> dict:
    return {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, **kwargs}


def test_engine_args_from_a_command_line(model: str) -> None:
    """vLLM's examples build the engine from a command line: add_cli_args, then from_cli_args."""
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--model", model, "--device", "cpu", "--enforce-eager", "--max-num-seqs", "4"]
    )
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()
    assert config.model == model and config.scheduler_config.max_num_seqs == 4
    with pytest.raises(Exception, match="no_such_knob"):
        EngineArgs(model=model, no_such_knob=1).create_engine_config()

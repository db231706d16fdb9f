"""vLLM's `LLM` methods as vLLM's docs call them: sample logprobs as {id: Logprob},
get_tokenizer, get_default_sampling_params (generation_config), start/stop_profile, get_metrics,
and chat's template arguments. A tiny Llama with a word-level tokenizer keeps them fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from executor_harness import COMMON, WORDS, build_tiny_llama, save_word_tokenizer

from atomrt import LLM, SamplingParams
from atomrt.runtime.config import ConfigError
from atomrt.runtime.driver.prompt_logprobs import Logprob
from atomrt.runtime.entrypoints.metrics_reader import Counter, Gauge, Histogram

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
    "{% if greeting is defined %}{{ greeting }} {% endif %}"
)
ROLES = {"user": WORDS[20], "assistant": WORDS[21], "system": WORDS[22]}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny"))
    save_word_tokenizer(folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "top_k": 5, "max_new_tokens": 3, "bos_token_id": 0})
    )
    return folder


@pytest.fixture(scope="module")
def llm(model: Path, tmp_path_factory: pytest.TempPathFactory):
    trace_dir = tmp_path_factory.mktemp("profile")
    llm = LLM(
        str(model),
        disable_log_stats=False,
        profiler_config={"profiler": "torch", "torch_profiler_dir": str(trace_dir)},
        **COMMON,
    )
    llm.trace_dir = trace_dir
    yield llm
    llm.shutdown()


def test_sample_logprobs_are_logprob_objects_matching_transformers(llm: LLM, model: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = [5, 9, 17, 3]
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    c = out.outputs[0]
    tok = c.token_ids[0]
    row = c.logprobs[0]
    assert all(isinstance(v, Logprob) for v in row.values())
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
    top = torch.topk(ref, 3)
    assert list(row)[:3] == top.indices.tolist()
    assert [row[t].rank for t in top.indices.tolist()] == [1, 2, 3]
    assert row[tok].logprob == pytest.approx(ref[tok].item(), abs=1e-4)
    assert row[tok].decoded_token == WORDS[tok]


def test_get_tokenizer_is_the_models_transformers_tokenizer(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    assert tok.encode(f"{WORDS[5]} {WORDS[9]}", add_special_tokens=False) == [5, 9]
    assert tok.decode([5, 9]) == f"{WORDS[5]} {WORDS[9]}"


def test_default_sampling_params_come_from_generation_config(llm: LLM, model: Path) -> None:
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_k, sp.max_tokens) == (0.0, 5, 3)
    (out,) = llm.generate([[5, 9, 17]], use_tqdm=False)  # no params: the model's defaults
    assert len(out.outputs[0].token_ids) <= 3
    from atomrt.runtime.entrypoints.llm import _generation_defaults

    assert _generation_defaults(str(model), "vllm", {}) == {}
    assert _generation_defaults(str(model), str(model), {"temperature": 0.5}) == {
        "temperature": 0.5,
        "top_k": 5,
        "max_tokens": 3,
    }
    with pytest.raises(ConfigError, match="generation_config"):
        _generation_defaults(str(model), str(model / "nowhere"), {})


def test_profile_writes_a_torch_trace(llm: LLM) -> None:
    llm.start_profile()
    llm.generate([[5, 9]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.stop_profile()
    traces = list(Path(llm.trace_dir).glob("*.pt.trace.json.gz"))
    assert traces, "no trace written"
    with pytest.raises(RuntimeError, match="stop_profile"):
        llm.stop_profile()


def test_get_metrics_counts_what_ran(llm: LLM, model: Path) -> None:
    before = {m.name: m for m in llm.get_metrics() if isinstance(m, Counter)}
    outs = llm.generate(
        [[5, 9, 17], [7, 8]],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    metrics = llm.get_metrics()
    by_name = {m.name: m for m in metrics if not isinstance(m, Counter) or not m.name.endswith("s")}
    counters = {m.name: m for m in metrics if isinstance(m, Counter)}
    assert (
        counters["atomrt:generation_tokens"].value - before["atomrt:generation_tokens"].value == 8
    )
    assert counters["atomrt:prompt_tokens"].value - before["atomrt:prompt_tokens"].value == 5
    assert isinstance(by_name["atomrt:num_requests_running"], Gauge)
    e2e = by_name["atomrt:e2e_request_latency_seconds"]
    assert isinstance(e2e, Histogram) and e2e.count >= len(outs)
    assert e2e.buckets["+Inf"] == e2e.count
    with LLM(str(model), **COMMON) as quiet:
        with pytest.raises(RuntimeError, match="disable_log_stats"):
            quiet.get_metrics()
        with pytest.raises(ValueError, match="profiler_config"):
            quiet.start_profile()


def _hf_text(llm: LLM, messages: list, **kwargs) -> str:
    return llm.get_tokenizer().apply_chat_template(
        messages, chat_template=TEMPLATE, tokenize=False, **kwargs
    )


def test_chat_takes_vllms_template_arguments(llm: LLM) -> None:
    user = [{"role": ROLES["user"], "content": f"{WORDS[5]} {WORDS[9]}"}]
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    (out,) = llm.chat(user, sp, use_tqdm=False, chat_template=TEMPLATE)
    assert out.prompt == _hf_text(llm, user, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    # chat_template_kwargs reach the template
    (kw,) = llm.chat(
        user,
        sp,
        use_tqdm=False,
        chat_template=TEMPLATE,
        chat_template_kwargs={"greeting": WORDS[30]},
    )
    assert kw.prompt.endswith(f"{WORDS[30]} ")
    # continue_final_message: the assistant's message is continued, no new turn is opened
    partial = [*user, {"role": "assistant", "content": WORDS[40]}]
    (cont,) = llm.chat(
        partial,
        sp,
        use_tqdm=False,
        chat_template=TEMPLATE,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert cont.prompt == _hf_text(
        llm, partial, add_generation_prompt=False, continue_final_message=True
    )
    assert cont.prompt.rstrip().endswith(WORDS[40])
    # two conversations, each its own output in order; OpenAI's text parts are taken
    parts = [{"role": ROLES["user"], "content": [{"type": "text", "text": WORDS[5]}]}]
    outs = llm.chat([user, parts], sp, use_tqdm=False, chat_template=TEMPLATE)
    assert [o.prompt for o in outs] == [
        out.prompt,
        _hf_text(llm, [{**parts[0], "content": WORDS[5]}], add_generation_prompt=True),
    ]
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(partial, sp, chat_template=TEMPLATE, continue_final_message=True)
    with pytest.raises(ValueError, match="image_url"):
        llm.chat(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            sp,
            chat_template=TEMPLATE,
        )

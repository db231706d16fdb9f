"""vLLM's example scripts build the LLM from a command line: `FlexibleArgumentParser()`,
`EngineArgs.add_cli_args(parser)`, `LLM(**vars(parser.parse_args()))`. Each test below runs that
flow as vLLM's examples/offline_inference/basic/generate.py and chat.py write it, on a tiny Llama
(word-level tokenizer), and checks the tokens against transformers' greedy decoding."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from executor_harness import build_tiny_llama, save_word_tokenizer

from atomrt import LLM, EngineArgs, SamplingParams
from atomrt.runtime.config import ConfigError
from atomrt.runtime.entrypoints.config_args import FlexibleArgumentParser
from atomrt.runtime.entrypoints.llm import config_from_kwargs

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
# small-machine settings, given as flags the way a user would add them to the example's command
CPU = ["--device", "cpu", "--enforce-eager", "--num-kv-blocks", "64", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = build_tiny_llama(tmp_path_factory.mktemp("cli_args"))
    return str(save_word_tokenizer(folder, chat_template=TEMPLATE))


def _hf_greedy(model: str, prompt_ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return ids[0, len(prompt_ids) :].tolist()


def _generate_py_parser(model: str) -> argparse.ArgumentParser:
    """generate.py's parser: engine flags in a group with the example's default model, and the
    script's own sampling flags beside them."""
    parser = FlexibleArgumentParser()
    engine_group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(engine_group)
    engine_group.set_defaults(model=model)
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    sampling_group.add_argument("--top-p", type=float)
    sampling_group.add_argument("--top-k", type=int)
    return parser


def test_generate_py_flow(model: str) -> None:
    argv = [*CPU, "--max-model-len", "64", "--max-tokens", "5", "--temperature", "0"]
    args: dict = vars(_generate_py_parser(model).parse_args(argv))
    max_tokens = args.pop("max_tokens")
    temperature = args.pop("temperature")
    args.pop("top_p")
    args.pop("top_k")
    llm = LLM(**args)
    try:
        assert llm.config.model_config.max_model_len == 64
        assert llm.config.scheduler_config.max_num_seqs == 8 and llm.config.enforce_eager
        sampling_params = llm.get_default_sampling_params()
        sampling_params.max_tokens = max_tokens
        sampling_params.temperature = temperature
        outputs = llm.generate(["ab ac ad", "ba bb"], sampling_params)
        tokenizer = llm.get_tokenizer()
        for output in outputs:
            got = list(output.outputs[0].token_ids)
            prompt_ids = tokenizer(output.prompt, add_special_tokens=False)["input_ids"]
            want = _hf_greedy(model, prompt_ids, max_tokens)
            assert got and got == want[: len(got)], (output.prompt, got, want)
            assert output.outputs[0].text.split() == tokenizer.decode(got).split()
    finally:
        llm.shutdown()


def test_chat_py_flow(model: str) -> None:
    """chat.py: sampling flags with SamplingParams' defaults, deleted from the namespace, then
    `LLM(**vars(args))` and `llm.chat` of one conversation and of a batch of them."""
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    defaults = SamplingParams()
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--temperature", type=float, default=defaults.temperature)
    parser.add_argument("--top-p", type=float, default=defaults.top_p)
    parser.add_argument("--top-k", type=int, default=defaults.top_k)
    parser.set_defaults(model=model)
    parser.add_argument("--chat-template-path", type=str, default=None)
    args = parser.parse_args(
        [*CPU, "--max_model_len", "64", "--max-tokens", "4", "--temperature=0"]
    )
    del args.chat_template_path
    sampling_params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        delattr(args, name)
    llm = LLM(**vars(args))
    try:
        conversation = [
            {"role": "system", "content": "ab"},
            {"role": "user", "content": "ac ad"},
        ]
        (one,) = llm.chat(conversation, sampling_params, use_tqdm=False)
        batch = llm.chat([conversation for _ in range(3)], sampling_params, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert list(one.prompt_token_ids) == prompt_ids
        want = _hf_greedy(model, list(prompt_ids), 4)
        got = list(one.outputs[0].token_ids)
        assert got and got == want[: len(got)], (got, want)
        assert [list(o.outputs[0].token_ids) for o in batch] == [got] * 3
    finally:
        llm.shutdown()


def test_defaults_are_llm_defaults() -> None:
    """Every flag's default is what LLM() does without the keyword: the config of all the
    defaults is LLM()'s own."""
    args = vars(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args([]))
    for own in ("generation_config", "override_generation_config", "disable_log_stats"):
        args.pop(own)  # LLM's own keywords, no engine setting
    model = args.pop("model")
    assert config_from_kwargs(model, args) == config_from_kwargs(model, {})


def test_flag_forms() -> None:
    """Dests are LLM's keywords; underscores, `-O 3`, `-tp`, `--no-...` and JSON are taken as
    vLLM's parser takes them."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--max_num_batched_tokens=1024",
            "-O",
            "3",
            "-tp",
            "2",
            "--no-enable-prefix-caching",
            "--hf-overrides",
            '{"num_hidden_layers": 1}',
            "--gpu-memory-utilization",
            "0.5",
            "--distributed-executor-backend",
            "mp",
        ]
    )
    assert args.max_num_batched_tokens == 1024 and args.compilation_config == 3
    assert args.tensor_parallel_size == 2 and args.enable_prefix_caching is False
    assert args.hf_overrides == {"num_hidden_layers": 1} and args.gpu_memory_utilization == 0.5
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.compilation_config.level == 3
    assert config.parallel_config.tensor_parallel_size == 2
    assert config.parallel_config.executor == "mp"
    assert config.cache_config.enable_prefix_caching is False
    assert config.scheduler_config.max_num_batched_tokens == 1024
    json_config = parser.parse_args(["--compilation-config", '{"level": 2}']).compilation_config
    assert (
        config_from_kwargs("m", {"compilation_config": json_config}).compilation_config.level == 2
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "engine.yaml"],  # atomrt's own flags are not LLM keywords
        ["--set", "cache_config.block_size=32"],
        ["--no-such-flag", "1"],
        ["--hf-overrides", "[1, 2]"],
        ["--compilation-config", "{level"],
        ["--distributed-executor-backend", "external"],
    ],
)
def test_unknown_or_bad_flags_are_argparse_errors(
    argv: list[str], capsys: pytest.CaptureFixture
) -> None:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="generate.py"))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2
    assert "generate.py: error:" in capsys.readouterr().err


def test_from_cli_args_takes_the_engine_flags_only() -> None:
    """A script's own flags in the namespace are left out; LLM's own keywords at their defaults
    are too, and one set otherwise is a ConfigError naming it (the engine does not take it)."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.add_argument("--max-tokens", type=int, default=16)
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", "--seed", "7"]))
    assert engine_args.model == "m" and "max_tokens" not in engine_args.kwargs
    assert engine_args.create_engine_config().model_config.seed == 7
    assert not {"generation_config", "disable_log_stats"} & set(engine_args.kwargs)
    args = parser.parse_args(["--generation-config", "vllm"])
    with pytest.raises(ConfigError, match="generation_config"):
        EngineArgs.from_cli_args(args).create_engine_config()


def test_atomrt_cli_flags_unchanged(tmp_path: Path) -> None:
    """`atomrt generate` keeps its own flags (--config, --set, --tp): they are not EngineArgs'."""
    from atomrt.runtime.entrypoints.config_args import add_config_args, config_from_args

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    yaml = tmp_path / "engine.yaml"
    yaml.write_text("scheduler_config:\n  max_num_seqs: 3\n")
    args = parser.parse_args(["--config", str(yaml), "--set", "cache_config.block_size=32"])
    config = config_from_args(args)
    assert config.scheduler_config.max_num_seqs == 3 and config.cache_config.block_size == 32

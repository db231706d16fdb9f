"""`LLM(...)` takes the keywords vLLM users type: each works or is a one-line error naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
from executor_harness import COMMON, GREEDY, PROMPTS, build_tiny_llama

from atomrt.runtime.config import CompilationConfig, ConfigError, CUDAGraphMode
from atomrt.runtime.entrypoints.llm import LLM, config_from_kwargs


def test_compilation_config_as_a_level_or_a_mapping() -> None:
    cc = config_from_kwargs("m", {"compilation_config": 3}).compilation_config
    assert cc.level == 3 and cc.cudagraph_mode is CUDAGraphMode.TR_HYBRID  # the level's default
    cc = config_from_kwargs(
        "m", {"compilation_config": {"level": 3, "cudagraph_mode": "FULL"}}
    ).compilation_config
    assert cc.level == 3 and cc.cudagraph_mode is CUDAGraphMode.FULL
    cc = config_from_kwargs("m", {"compilation_config": CompilationConfig(level=2)})
    assert cc.compilation_config.level == 2
    with pytest.raises(ConfigError, match="compilation_config.level"):
        config_from_kwargs("m", {"compilation_config": 7})
    with pytest.raises(ConfigError, match=r"compilation_config.levl: unknown key"):
        config_from_kwargs("m", {"compilation_config": {"levl": 3}})
    with pytest.raises(ConfigError, match="compilation_config"):
        config_from_kwargs("m", {"compilation_config": "3"})


def test_vllm_keywords_work_or_name_themselves() -> None:
    config = config_from_kwargs(
        "m",
        dict(
            tensor_parallel_size=2,
            dtype="float32",
            gpu_memory_utilization=0.5,
            max_model_len=128,
            enforce_eager=True,
            seed=3,
            max_num_seqs=4,
            enable_prefix_caching=False,
            distributed_executor_backend="mp",
            trust_remote_code=False,
            swap_space=4,
            model_config={"max_logprobs": 5},
        ),
    )
    assert config.parallel_config.executor == "mp"
    assert config.model_config.max_logprobs == 5 and config.model_config.seed == 3
    for key, value in (
        ("quantization", "awq"),
        ("trust_remote_code", True),
        ("pipeline_parallel_size", 2),
        ("distributed_executor_backend", "external_launcher"),
        ("no_such_knob", 1),
    ):
        with pytest.raises(ConfigError, match=key) as err:
            config_from_kwargs("m", {key: value})
        assert "\n" not in str(err.value)


@pytest.mark.slow
def test_llm_at_level_3_under_full_gives_the_eager_tokens(tmp_path: Path) -> None:
    """Level 3 compiles with Inductor (on CPU too); its greedy tokens are eager's."""
    model = str(build_tiny_llama(tmp_path / "model"))
    tokens = {}
    for name, cc in (("eager", 0), ("level3", {"level": 3, "cudagraph_mode": "FULL"})):
        settings = {**COMMON, "enforce_eager": False}
        with LLM(model, compilation_config=cc, **settings) as llm:
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert tokens["level3"] == tokens["eager"]

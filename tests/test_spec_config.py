"""`speculative_config` as vLLM users write it: a mapping to LLM(...), a YAML section, and
`--speculative-config JSON` on the command line; bad values raise errors naming the knob; the capture
ladder keeps only the batch sizes a verify step can reach."""

import argparse

import pytest

from atomrt.runtime.config import (
    SPEC_METHODS,
    CompilationConfig,
    Config,
    ConfigError,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from atomrt.runtime.config_io import build_config, dump_yaml
from atomrt.runtime.driver.proposers import PROPOSERS, make_proposer
from atomrt.runtime.entrypoints.config_args import add_config_args, config_from_args
from atomrt.runtime.entrypoints.llm import config_from_kwargs

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
}


def test_vllm_forms():
    ngram = Config(speculative_config=NGRAM).speculative_config
    assert isinstance(ngram, SpeculativeConfig) and ngram.method == "ngram"
    assert (ngram.num_speculative_tokens, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (
        3,
        1,
        4,
    )
    assert ngram.max_q_len == 4
    draft = SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2})
    assert draft.method == "draft_model" and draft.model == "/m"  # method inferred, as in vLLM
    # one bound of the n-gram window gives the other; neither gives vLLM's 5..5
    assert SpeculativeConfig(2, "ngram", prompt_lookup_max=3).prompt_lookup_min == 3
    assert SpeculativeConfig(2, "ngram", prompt_lookup_min=2).prompt_lookup_max == 2
    assert SpeculativeConfig(2, "ngram").prompt_lookup_min == 5
    assert Config().speculative_config is None and Config().max_q_len == 1


@pytest.mark.parametrize(
    "bad, knob",
    [
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        (
            {"method": "ngram", "model": "/m", "num_speculative_tokens": 2},
            "speculative_config.model",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        (
            {"model": "/m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1},
            "speculative_config.lookahead",
        ),
        ("ngram", "speculative_config"),
        ({"method": "mtp", "model": "/m", "num_speculative_tokens": 1}, "speculative_config.model"),
        (
            {"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 3},
            "speculative_config.prompt_lookup_max",
        ),
        (
            {"method": "mtp", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 2},
            "speculative_config.draft_tensor_parallel_size",
        ),
    ],
)
def test_bad_values_name_the_knob(bad, knob):
    with pytest.raises(ConfigError, match=knob):
        Config(speculative_config=bad)


def test_mtp_forms():
    """vLLM's `mtp` (and its older `deepseek_mtp`): the target's own layers draft; their later
    passes write KV k - 1 positions past a step's rows; they run split as the target."""
    for method in ("mtp", "deepseek_mtp"):
        spec = SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 3})
        assert spec.method == "mtp" and spec.max_q_len == 4 and spec.num_lookahead_tokens == 2
    assert SpeculativeConfig(1, "mtp").num_lookahead_tokens == 0
    assert SpeculativeConfig(3, "ngram").num_lookahead_tokens == 0
    tp2 = Config(
        speculative_config={
            "method": "mtp",
            "num_speculative_tokens": 1,
            "draft_tensor_parallel_size": 2,
        },
        parallel_config=ParallelConfig(tensor_parallel_size=2),
    )
    assert tp2.speculative_config.draft_tensor_parallel_size == 2


def test_every_method_has_one_proposer():
    """Each method SpeculativeConfig accepts has its driver half, built by one factory; the block
    manager recomputes a prefix hit's last block, and the plan ships next tokens, for MTP only."""
    assert set(PROPOSERS) == set(SPEC_METHODS)
    specs = {
        "ngram": SpeculativeConfig(3, "ngram"),
        "draft_model": SpeculativeConfig(3, "draft_model", model="draft"),
        "mtp": SpeculativeConfig(3, "mtp"),
    }
    for method, spec in specs.items():
        proposer = make_proposer(spec)
        assert type(proposer) is PROPOSERS[method] and proposer.method == method
        assert proposer.recompute_last_hit == proposer.needs_next_tokens == (method == "mtp")


def test_every_method_has_one_worker_proposer():
    """Each method also has its worker half, registered under the same name and built by one
    factory: only a draft model's drafts are written into the token pool on the workers, and the
    n-gram worker half has nothing to do (its drafts come in the plan)."""
    import torch

    from atomrt.distributed.communication_op import DPInfo, TPInfo
    from atomrt.workers.runner.step_buffers import RunnerShape
    from atomrt.workers.spec_decode.ngram import NgramWorkerProposer
    from atomrt.workers.spec_decode.proposer import ProposerSetup
    from atomrt.workers.spec_decode.speculator import WORKER_PROPOSERS, make_worker_proposer

    assert set(WORKER_PROPOSERS) == set(SPEC_METHODS)
    for method, cls in WORKER_PROPOSERS.items():
        assert cls.method == PROPOSERS[method].method == method
        assert cls.drafts_in_pool == (method == "draft_model")
    shape = RunnerShape(max_model_len=256, block_size=16, max_num_seqs=4, max_num_tokens=64)
    config = Config(speculative_config=NGRAM, device="cpu")
    cpu = torch.device("cpu")
    setup = ProposerSetup(config, cpu, torch.float32, TPInfo(), DPInfo(), shape, False)
    ngram = make_worker_proposer(setup)
    assert type(ngram) is NgramWorkerProposer and ngram.k == 3
    assert ngram.next_drafts == ngram.kv_bytes_per_block() == ngram.take_eager_passes() == 0


def test_two_batch_overlap_does_not_split_verify_steps():
    with pytest.raises(ConfigError, match="enable_tbo"):
        Config(speculative_config=NGRAM, parallel_config=ParallelConfig(enable_tbo="all"))


def test_verify_rows_must_fit_the_token_budget():
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        Config(
            speculative_config={"method": "ngram", "num_speculative_tokens": 8},
            scheduler_config=SchedulerConfig(max_num_batched_tokens=8),
        )


def test_capture_sizes_filtered_to_what_a_verify_step_reaches():
    # min(max_num_seqs, max_num_batched_tokens // (k + 1)) = min(64, 100 // 4) = 25
    cfg = Config(
        speculative_config=NGRAM,
        scheduler_config=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=100),
    )
    assert cfg.capture_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    plain = Config(scheduler_config=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=100))
    assert plain.capture_sizes[-1] == 64
    with pytest.raises(ConfigError, match="cudagraph_capture_sizes"):
        Config(
            speculative_config=NGRAM,
            scheduler_config=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=100),
            compilation_config=CompilationConfig(cudagraph_capture_sizes=[8, 32]),
        )


def test_yaml_cli_and_llm_kwargs(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(
        "speculative_config: {method: draft_model, model: /drafts/tiny, num_speculative_tokens: 2}\n"
    )
    from_yaml = build_config(str(path)).speculative_config
    assert (from_yaml.method, from_yaml.model, from_yaml.num_speculative_tokens) == (
        "draft_model",
        "/drafts/tiny",
        2,
    )
    cfg = Config(speculative_config=NGRAM)
    assert Config.from_dict(cfg.to_dict()).speculative_config == cfg.speculative_config
    assert "speculative_config" in dump_yaml(cfg)
    assert Config.from_dict(Config().to_dict()).speculative_config is None

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    assert config_from_args(args).speculative_config == SpeculativeConfig(2, "ngram")
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{not json"])

    assert config_from_kwargs("m", {"speculative_config": NGRAM}).speculative_config.max_q_len == 4
    with pytest.raises(ConfigError, match="unknown argument 'num_speculative_tokens'"):
        config_from_kwargs("m", {"num_speculative_tokens": 2})


def test_each_method_is_one_class_config_and_driver_ask():
    """Configuration and the driver ask the same class: each driver proposer subclasses its
    method's `SpecMethod`, whose flags decide the lookahead, the plain-decode capture buckets and
    whether a windowed model's blocks stay."""
    from types import SimpleNamespace

    from atomrt.runtime.config import SPEC_METHOD_ALIASES, SPEC_METHOD_TYPES
    from atomrt.runtime.driver.block_manager import BlockManager

    assert SPEC_METHODS == tuple(SPEC_METHOD_TYPES) == ("ngram", "draft_model", "mtp")
    assert SPEC_METHOD_ALIASES == {"deepseek_mtp": "mtp"}
    for method, cls in PROPOSERS.items():
        assert issubclass(cls, SPEC_METHOD_TYPES[method]) and cls.method == method
    specs = {
        "ngram": SpeculativeConfig(3, "ngram"),
        "draft_model": SpeculativeConfig(3, model="draft"),
        "mtp": SpeculativeConfig(3, "deepseek_mtp"),
    }
    v4 = SimpleNamespace(v4=SimpleNamespace(anchor_stride=4, token_reach=128))
    async_on = SchedulerConfig(async_scheduling=True)
    for method, spec in specs.items():
        assert spec.method_type is SPEC_METHOD_TYPES[method]
        assert spec.num_lookahead_tokens == (2 if method == "mtp" else 0)
        cfg = Config(speculative_config=spec, scheduler_config=async_on)
        assert cfg.capture_q_lens == ((4, 1) if method == "ngram" else (4,))
        window = BlockManager.window_for(v4, cfg)
        assert window.free_behind == (method == "ngram") and window.margin == 3
    assert BlockManager.window_for(v4, Config()).free_behind
    assert BlockManager.window_for(SimpleNamespace(), Config(speculative_config=NGRAM)) is None


def test_a_new_method_is_a_class_and_a_registry_line(monkeypatch):
    """A method registered in `SPEC_METHOD_TYPES` is accepted by name; its own field check, its
    lookahead and its check against the parallel layout run where configuration asks."""
    from atomrt.runtime.config import SPEC_METHOD_TYPES, SpecMethod

    class EagleMethod(SpecMethod):
        method = "eagle"
        recompute_last_hit = True

        @classmethod
        def check_fields(cls, spec):
            if spec.model is None:
                raise ConfigError("speculative_config.model: method 'eagle' needs its head")
            return {"draft_tensor_parallel_size": 1}

        @classmethod
        def num_lookahead_tokens(cls, k):
            return k

        @classmethod
        def check_config(cls, spec, config):
            if config.parallel_config.tensor_parallel_size != 1:
                raise ConfigError("speculative_config.method 'eagle': tensor_parallel_size 1 only")

    with pytest.raises(ConfigError, match="must be one of"):
        SpeculativeConfig(2, "eagle", model="/head")
    monkeypatch.setitem(SPEC_METHOD_TYPES, "eagle", EagleMethod)
    spec = SpeculativeConfig(2, "eagle", model="/head")
    assert spec.method_type is EagleMethod and spec.draft_tensor_parallel_size == 1
    assert spec.num_lookahead_tokens == 2 and not spec.may_pause(True)
    with pytest.raises(ConfigError, match="needs its head"):
        SpeculativeConfig(2, "eagle")
    with pytest.raises(ConfigError, match="tensor_parallel_size 1 only"):
        Config(speculative_config=spec, parallel_config=ParallelConfig(tensor_parallel_size=2))

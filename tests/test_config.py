"""Config: the guide's level-3 rules and ladder, CUDAGraphMode helpers, YAML, errors that name the key."""

import pytest

from atomrt.runtime import config as config_module
from atomrt.runtime import config_sections
from atomrt.runtime.config import (
    AUTO_SPIN_US,
    CompilationConfig,
    CompilationLevel,
    Config,
    ConfigError,
    CUDAGraphMode,
    ParallelConfig,
    SchedulerConfig,
    capture_size_ladder,
)
from atomrt.runtime.config_io import build_config, dump_yaml, load_yaml

M = CUDAGraphMode

# mode: (decode_mode, mixed_mode, separate_routine, has_full, uses_tr_hybrid, max_mode)
HELPERS = {
    M.NONE: (M.NONE, M.NONE, False, False, False, M.NONE),
    M.TR_HYBRID: (M.TR_HYBRID, M.TR_HYBRID, False, False, True, M.TR_HYBRID),
    M.FULL: (M.FULL, M.FULL, False, True, False, M.FULL),
    M.FULL_DECODE_ONLY: (M.FULL, M.NONE, True, True, False, M.FULL),
    M.FULL_AND_TR_HYBRID: (M.FULL, M.TR_HYBRID, True, True, True, M.FULL),
}


@pytest.mark.parametrize("mode", list(M))
def test_cudagraph_mode_helpers(mode):
    decode, mixed, separate, full, tr, mx = HELPERS[mode]
    assert mode.decode_mode() is decode
    assert mode.mixed_mode() is mixed
    assert mode.separate_routine() is separate
    assert mode.has_full_cudagraphs() is full
    assert mode.uses_tr_hybrid() is tr
    assert mode.max_cudagraph_mode() is mx
    # FULL and FULL_DECODE_ONLY capture request graphs; FULL_AND_TR_HYBRID is recorded as TR_HYBRID
    assert mode.records_request_graphs() is (mode in (M.FULL, M.FULL_DECODE_ONLY))


def test_mode_values_match_guide():
    assert M.NONE.value == 0 and M.TR_HYBRID.value == 1 and M.FULL.value == 2
    assert M.FULL_DECODE_ONLY.value == (M.FULL.value, M.NONE.value)
    assert M.FULL_AND_TR_HYBRID.value == (M.FULL.value, M.TR_HYBRID.value)
    assert M.parse("full_decode_only") is M.FULL_DECODE_ONLY
    assert M.parse([2, 1]) is M.FULL_AND_TR_HYBRID
    with pytest.raises(ConfigError, match="cudagraph_mode"):
        M.parse("PIECEWISE")


def test_levels():
    assert [int(x) for x in CompilationLevel] == [0, 1, 2, 3]
    assert CompilationLevel.PIECEWISE.name == "PIECEWISE"
    assert CompilationLevel.NO_COMPILATION.name == "NO_COMPILATION"


def test_compilation_config_defaults_match_guide_table():
    c = CompilationConfig()
    assert c.level == 0 and c.use_cudagraph is True and c.cudagraph_capture_sizes is None
    assert c.cuda_graph_sizes == [512] and c.cudagraph_mode is None and c.splitting_ops is None
    assert c.cudagraph_copy_inputs is False and c.use_inductor is True and c.compile_sizes is None
    assert c.inductor_compile_config == {} and c.debug_dump_path == "" and c.cache_dir == ""
    cfg = Config()
    assert cfg.enforce_eager is False and isinstance(cfg.compilation_config, CompilationConfig)


def test_default_ladder():
    ladder = capture_size_ladder(512)
    assert ladder[:9] == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    assert ladder[-2:] == [496, 512]
    assert ladder == list(range(1, 9)) + [i for i in range(16, 513, 16)]


def test_level3_rules():
    cfg = Config(
        compilation_config=CompilationConfig(
            level=3, compile_sizes=["cudagraph_capture_sizes", 3000]
        ),
        scheduler_config=SchedulerConfig(max_num_seqs=512),
    )
    cc = cfg.compilation_config
    assert cc.splitting_ops == [
        "atomrt.unified_attention_with_output",
        "atomrt.mla_attention",
        "atomrt.v4_attn_compress_launch",
        "atomrt.v4_attention",
        "atomrt.dsa_mla_attention",
    ]
    assert cc.cudagraph_mode is M.TR_HYBRID
    assert cfg.capture_sizes == capture_size_ladder(512)
    assert cc.cudagraph_capture_sizes == cfg.capture_sizes
    assert cc.compile_sizes == sorted(set(capture_size_ladder(512)) | {3000})


def test_level3_respects_user_choices():
    cc = CompilationConfig(
        level=3,
        cudagraph_mode="FULL",
        splitting_ops=["atomrt.other"],
        cudagraph_capture_sizes=[4, 1, 2],
    )
    cfg = Config(compilation_config=cc)
    assert cc.cudagraph_mode is M.FULL and cc.splitting_ops == ["atomrt.other"]
    assert cfg.capture_sizes == [1, 2, 4]


def test_ladder_filtered_by_max_num_seqs_and_explicit_list_checked():
    cfg = Config(
        compilation_config=CompilationConfig(level=3),
        scheduler_config=SchedulerConfig(max_num_seqs=40),
    )
    assert cfg.capture_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]
    with pytest.raises(ConfigError, match="max_num_seqs"):
        Config(
            compilation_config=CompilationConfig(cudagraph_capture_sizes=[64]),
            scheduler_config=SchedulerConfig(max_num_seqs=32),
        )
    multi = Config(compilation_config=CompilationConfig(cuda_graph_sizes=[8, 1, 4]))
    assert multi.capture_sizes == [1, 4, 8]


def test_enforce_eager_skips_compilation_and_graphs():
    cfg = Config(enforce_eager=True, compilation_config=CompilationConfig(level=3))
    assert cfg.compilation_config.level == 0
    assert cfg.cudagraph_mode is M.NONE
    assert (
        Config(compilation_config=CompilationConfig(use_cudagraph=False)).cudagraph_mode is M.NONE
    )


def test_yaml_round_trip(tmp_path):
    cfg = Config(
        compilation_config=CompilationConfig(
            level=3, cudagraph_mode="FULL_DECODE_ONLY", compile_sizes=[1, 8]
        ),
    )
    p = tmp_path / "c.yaml"
    p.write_text(dump_yaml(cfg))
    back = build_config(str(p))
    assert back == cfg
    assert load_yaml(p)["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"


def test_overrides_and_base(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("compilation_config: {level: 3}\nscheduler_config: {max_num_seqs: 64}\n")
    cfg = build_config(
        str(p),
        ["compilation_config.cudagraph_mode=FULL", "cache_config.block_size=32"],
        base={"enforce_eager": False},
    )
    assert cfg.compilation_config.level == 3 and cfg.cudagraph_mode is M.FULL
    assert cfg.cache_config.block_size == 32 and cfg.scheduler_config.max_num_seqs == 64


@pytest.mark.parametrize(
    "text, key",
    [
        ("modle: x\n", "modle"),
        ("compilation_config: {levle: 3}\n", "compilation_config.levle"),
        ("compilation_config: {level: 7}\n", "compilation_config.level"),
        ("compilation_config: {level: three}\n", "compilation_config.level"),
        ("compilation_config: {cudagraph_mode: SOMETIMES}\n", "cudagraph_mode"),
        ("compilation_config: {cuda_graph_sizes: [0]}\n", "compilation_config.cuda_graph_sizes"),
        ("compilation_config: {compile_sizes: [banana]}\n", "compilation_config.compile_sizes"),
        ("scheduler_config: {max_num_seqs: -1}\n", "scheduler_config.max_num_seqs"),
        ("cache_config: {gpu_memory_utilization: 1.5}\n", "cache_config.gpu_memory_utilization"),
        ("cache_config: {block_size: 16.5}\n", "cache_config.block_size"),
        ("parallel_config: {executor: slurm}\n", "parallel_config.executor"),
        ("parallel_config: {transport_spin_us: -5}\n", "parallel_config.transport_spin_us"),
        ("scheduler_config: {async_scheduling: sometimes}\n", "scheduler_config.async_scheduling"),
        ("enforce_eager: maybe\n", "enforce_eager"),
        ("device: tpu\n", "device"),
        ("model_config: {dtype: float8}\n", "model_config.dtype"),
        ("- a\n- b\n", "top level"),
    ],
)
def test_bad_yaml_names_the_key(tmp_path, text, key):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config(str(p))


def test_bad_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        build_config(None, ["compilation_config.level"])
    with pytest.raises(ConfigError, match="no such file"):
        build_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="compilation_config.level"):
        build_config(None, ["compilation_config.level=9"])


def test_compute_hash_ignores_placement():
    a = Config(compilation_config=CompilationConfig(level=3))
    b = Config(
        compilation_config=CompilationConfig(level=3),
        parallel_config=ParallelConfig(executor="ray", worker_timeout_s=5),
    )
    c = Config(compilation_config=CompilationConfig(level=3, compile_sizes=[4]))
    assert a.compute_hash() == b.compute_hash()
    assert a.compute_hash() != c.compute_hash()


def test_example_configs_load():
    from pathlib import Path

    examples = sorted((Path(__file__).parent.parent / "deploy" / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        build_config(str(path))


def test_ray_placement_and_transport_reach_the_executor():
    from atomrt.runtime.executors.factory import make_executor

    cfg = build_config(
        None,
        [
            "parallel_config.executor=ray",
            "parallel_config.placement_strategy=SPREAD",
            "parallel_config.transport=tcp",
        ],
    )
    ex = make_executor(cfg)
    assert ex.placement_strategy == "SPREAD" and ex.transport == "tcp"
    with pytest.raises(ConfigError, match="parallel_config.placement_strategy"):
        build_config(None, ["parallel_config.placement_strategy=RANDOM"])
    with pytest.raises(ConfigError, match="parallel_config.transport"):
        build_config(None, ["parallel_config.transport=udp"])


def test_transport_spin_us_auto_is_the_default_and_follows_the_device(monkeypatch):
    pc = ParallelConfig()
    assert pc.transport_spin_us == "auto" and Config().parallel_config.transport_spin_us == "auto"
    assert config_module.usable_cpu_count() >= 1
    monkeypatch.setattr(config_sections, "usable_cpu_count", lambda: 32)
    assert pc.resolved_spin_s("cuda") == AUTO_SPIN_US / 1e6 == 0.002
    assert pc.resolved_spin_s("cpu") == 0.0  # a CPU engine's cores run the model
    monkeypatch.setattr(config_sections, "usable_cpu_count", lambda: 2)  # the CPU CI machines
    assert pc.resolved_spin_s("cuda") == 0.0
    monkeypatch.setattr(
        config_sections, "usable_cpu_count", lambda: config_module.AUTO_SPIN_MIN_CPUS
    )
    assert pc.resolved_spin_s("cuda") == 0.002


@pytest.mark.parametrize(
    "spin_us, spin_s", [(0, 0.0), (0.0, 0.0), (500, 0.0005), (2000.0, 0.002), (1e6, 1.0)]
)
def test_explicit_transport_spin_us_passes_through_on_any_device(monkeypatch, spin_us, spin_s):
    monkeypatch.setattr(config_sections, "usable_cpu_count", lambda: 1)
    pc = ParallelConfig(transport_spin_us=spin_us)
    assert pc.resolved_spin_s("cpu") == pc.resolved_spin_s("cuda") == pytest.approx(spin_s)


@pytest.mark.parametrize("bad", ["fast", "AUTO", "", -1, True, 2e6, None, [2000]])
def test_bad_transport_spin_us_names_the_field_and_the_choices(bad):
    with pytest.raises(
        ConfigError, match=r"parallel_config\.transport_spin_us: must be 'auto' or a number"
    ):
        ParallelConfig(transport_spin_us=bad)


@pytest.mark.parametrize("text", ["fast", "-1", "true", "2e6", "2000000", "[2000]"])
def test_bad_transport_spin_us_from_yaml_names_the_field(text):
    with pytest.raises(ConfigError, match=r"parallel_config\.transport_spin_us"):
        build_config(None, [f"parallel_config.transport_spin_us={text}"])


@pytest.mark.parametrize("value", ["auto", 2000, 0, 12.5])
def test_transport_spin_us_yaml_round_trip(tmp_path, value):
    p = tmp_path / "c.yaml"
    p.write_text(f"parallel_config: {{executor: mp, transport_spin_us: {value}}}\n")
    cfg = build_config(str(p))
    assert cfg.parallel_config.transport_spin_us == value
    p.write_text(dump_yaml(cfg))
    assert load_yaml(p)["parallel_config"]["transport_spin_us"] == value
    assert build_config(str(p)) == cfg
    assert (
        build_config(
            None, [f"parallel_config.transport_spin_us={value}"]
        ).parallel_config.transport_spin_us
        == value
    )

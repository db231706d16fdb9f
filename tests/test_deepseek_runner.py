"""An MLA model in the runner, on CPU: the latent KV cache's sizing per layer kind (the presets'
arithmetic against a hand count, the tiny preset's through the runner), and its token graphs with
a logging segment backend: they break only at the MLA op's attention region, the rotary embedding
and the latent write stay inside the segments, and a decode bucket's recording joins its request
graphs into one launch (the region is request-fixed)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from test_region_graph_cpu import FakeBackend
from test_region_request_cpu import ComposingBackend

from atomrt.distributed.communication_op import TPInfo
from atomrt.graphs import region_graph as rg
from atomrt.graphs.markers import captured_token_sizes, token_graph_of
from atomrt.runtime.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.runtime.forward_context import set_forward_context
from atomrt.workers.layers.attention import collect_attention_layers
from atomrt.workers.loading.loader import build_model
from atomrt.workers.loading.presets import preset_config
from atomrt.workers.models.registry import arch_from_hf_config
from atomrt.workers.runner.input_batch import StepInputs
from atomrt.workers.runner.kv_cache import (
    KVCacheTensor,
    KVKindSize,
    KVLayerSpec,
    MLAKVCacheTensor,
    MLALayerSpec,
    allocate_kv_cache,
    kv_bytes_per_block,
    kv_layer_specs,
    kv_sizes_by_kind,
)
from atomrt.workers.runner.kv_sizing import describe_kv_sizes, determine_num_blocks
from atomrt.workers.runner.model_runner import ModelRunner, resolve_device

# (preset, decoder layers, routed experts): a bf16 latent row is (512 + 64) x 2 bytes per layer
HAND_COUNT = [("DeepSeek-V2-Lite", 27, 64), ("GLM-4.7-Flash", 47, 64), ("DeepSeek-V3", 61, 256)]


@pytest.mark.parametrize("preset,num_layers,num_experts", HAND_COUNT)
@pytest.mark.parametrize("tp_size", [1, 4])
def test_preset_latent_cache_sizing_matches_a_hand_count(
    preset: str, num_layers: int, num_experts: int, tp_size: int
) -> None:
    """Built on the meta device (shapes only): one latent row per token and layer, 576 bf16
    values, whatever the TP size (the latent head is replicated, not split)."""
    arch = arch_from_hf_config(preset_config(preset), preset)
    model = build_model(arch, "meta", torch.bfloat16, TPInfo(0, tp_size), max_position=16)
    specs = kv_layer_specs(collect_attention_layers(model))
    per_token = num_layers * (512 + 64) * 2  # V2-Lite 31104 B, GLM 54144 B, V3 70272 B
    assert kv_sizes_by_kind(specs, torch.bfloat16) == (KVKindSize("mla", num_layers, per_token),)
    assert kv_bytes_per_block(specs, 16, torch.bfloat16) == 16 * per_token
    # what a per-head cache of the decompressed keys (192 wide) and values would cost instead
    heads = arch.num_heads // tp_size
    decompressed = num_layers * heads * (arch.head_dim + arch.v_head_dim) * 2
    assert per_token < decompressed
    assert model.model.layers[-1].mlp.experts.w13_weight.shape[0] == num_experts
    text = describe_kv_sizes(kv_sizes_by_kind(specs, torch.bfloat16), tp_size)
    assert text.startswith(f"mla: {num_layers} layers, {per_token} B")
    assert ("replicated on each of 4 TP ranks" in text) == (tp_size == 4)


def test_layer_kinds_mix_in_one_block_pool() -> None:
    """A cache spec per layer: attention and latent layers side by side, each its own layout,
    a block's bytes the sum of both kinds'."""
    specs = [KVLayerSpec(0, 2, 32), MLALayerSpec(1, 64, 16), KVLayerSpec(2, 2, 32)]
    assert kv_sizes_by_kind(specs, torch.float16) == (
        KVKindSize("attention", 2, 2 * 2 * 2 * 32 * 2),
        KVKindSize("mla", 1, 80 * 2),
    )
    assert kv_bytes_per_block(specs, 4, torch.float16) == 4 * (2 * 128 + 80) * 2
    caches = allocate_kv_cache(specs, 3, 4, torch.float16, torch.device("cpu"))
    assert isinstance(caches["layers.0"], KVCacheTensor)
    assert caches["layers.0"].k_cache.shape == (3, 4, 2, 32)
    assert isinstance(caches["layers.1"], MLAKVCacheTensor)
    assert caches["layers.1"].kv_cache.shape == (3, 4, 80)


def test_deepseek_v2_lite_has_the_parameters_transformers_builds() -> None:
    """The dummy preset at its real shapes holds as many parameters as transformers' own
    DeepseekV2ForCausalLM of the same config (both on the meta device): 15.7B."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = preset_config("DeepSeek-V2-Lite")
    hf_cfg = AutoConfig.for_model(
        "deepseek_v2", **{k: v for k, v in cfg.items() if k != "architectures"}
    )
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    arch = arch_from_hf_config(cfg, "preset")
    ours = build_model(arch, "meta", torch.bfloat16, max_position=16)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters())
    assert round(count / 1e9, 1) == 15.7


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    config = Config(
        model="tiny-deepseek-v3",
        device="cpu",
        model_config=ModelConfig(load_format="dummy"),
        cache_config=CacheConfig(block_size=4, cpu_kv_cache_gib=0.001),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
    )
    r = ModelRunner(config, resolve_device(config))
    sizing = determine_num_blocks(r)
    r.allocate_kv_cache(sizing.num_blocks)
    r.sizing = sizing
    return r


def test_runner_sizes_the_latent_cache_per_layer_kind(runner: ModelRunner) -> None:
    """4 MLA layers of (64 + 16) float32 values per token; the CPU budget in blocks of 4 tokens."""
    per_token = 4 * (64 + 16) * 4
    assert runner.sizing.by_kind == (KVKindSize("mla", 4, per_token),)
    assert runner.sizing.bytes_per_block == 4 * per_token
    assert runner.sizing.num_blocks == int(0.001 * 2**30) // (4 * per_token)
    assert runner.kv_cache["layers.0"].kv_cache.shape == (runner.sizing.num_blocks, 4, 80)


def _decode_inputs(bs: int, block_size: int) -> StepInputs:
    computed = np.arange(2, 2 + bs)
    tables = np.full((bs, 4), -1, dtype=np.int32)
    for i in range(bs):
        tables[i, : 1 + computed[i] // block_size] = np.arange(
            1 + 4 * i, 2 + 4 * i + computed[i] // block_size
        )
    slots = tables[np.arange(bs), computed // block_size].astype(np.int64) * block_size
    return StepInputs(
        seq_ids=np.arange(bs, dtype=np.int64),
        input_ids=np.arange(1, bs + 1, dtype=np.int64),
        positions=computed.astype(np.int64),
        slot_mapping=slots + computed % block_size,
        cu_seqlens_q=np.arange(bs + 1, dtype=np.int32),
        context_lens=(computed + 1).astype(np.int32),
        block_tables=tables,
        sample_seq_idx=np.arange(bs, dtype=np.int64),
        sample_rows=np.arange(bs, dtype=np.int64),
    )


def _record(runner: ModelRunner, bs: int, request: bool = False):
    """Record bucket `bs` of the unit's token graph (with a request for its decode bucket's
    region graphs, under graph-safe metadata as capture gives it)."""
    inputs = _decode_inputs(bs, runner.shape.block_size)
    decision = ForwardDecision(
        ForwardKind.TOKEN_GRAPH,
        running_bs=bs,
        running_tokens=bs,
        is_prefill=False,
        token_bucket=bs,
    )
    md, ctx = runner.buffers.prepare(inputs, decision)
    if request:
        request = rg.RegionRequest((bs, 0), replace(md, graph_safe=True))
    with (
        torch.inference_mode(),
        set_forward_context(
            md,
            runner.config,
            ctx,
            no_compile_layers=runner.attn_layers,
            kv_cache_data=runner.kv_cache,
            tr_graph="record",
            tr_request=request or None,
        ),
    ):
        fv = runner.buffers.forward_vars
        runner.model(fv["input_ids"][:bs], fv["positions"][:bs])
    return inputs


def test_token_graph_breaks_only_at_the_mla_attention_region(runner: ModelRunner) -> None:
    unit = runner.model.model
    unit.__dict__.pop("_atomrt_token_graph", None)
    graph = token_graph_of(unit, backend=FakeBackend([]))
    for bs in (4, 2, 1):  # largest first, as capture goes (nothing here replays: see
        inputs = _record(runner, bs)  # test_region_graph_cpu.py on CPU aliases)
    assert graph.num_segments(4, "decode") == 4 + 1
    rec = graph._recordings[(4, None)]
    assert [c.fn.__name__ for c in rec.eager_calls] == ["_mla_attend"] * 4
    assert captured_token_sizes(unit, "decode") == [1, 2, 4]
    assert captured_token_sizes(unit, "prefill") == []
    # the step's latent row went into the cache during the recording (written inline)
    latent = runner.kv_cache["layers.0"].kv_cache.view(-1, 80)
    assert latent[int(inputs.slot_mapping[0])].abs().sum().item() > 0


def test_a_decode_bucket_joins_the_mla_regions_into_one_launch(runner: ModelRunner) -> None:
    """Under a request bucket's graph-safe metadata the MLA region depends on no host data
    (`request_fixed`): the decode recording keeps a region graph per layer and joins them with its
    segments, so a decode step of the bucket is one launch."""
    unit = runner.model.model
    unit.__dict__.pop("_atomrt_token_graph", None)
    log: list = []
    graph = token_graph_of(unit, backend=ComposingBackend(log))
    _record(runner, 2, request=True)
    assert graph.req_keys() == [(2, 0)]
    composed = [e for e in log if e[0] == "compose"]
    assert len(composed) == 1 and len(composed[0][1]) == 4 + 1 + 4  # segments and region graphs

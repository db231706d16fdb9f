"""Tiny DeepSeek-V4 checkpoints made by transformers (DeepseekV4ForCausalLM), for the V4 tests.

Three configurations, each with prompts longer than its window and several compression blocks:
- `csa_hca`: hc_mult 2; sliding, CSA, HCA, CSA layers; hash then top-k routing; YaRN on the
  compressed layers' rotary; an indexer top-k below the entry count (selection matters);
- `hca_first`: hc_mult 4; HCA, sliding, CSA; routing all top-k but the first layer;
- `sliding`: hc_mult 2; CSA, sliding, sliding; every layer hash-routed.
Weights are random, larger than the init's, so every piece matters: the mHC projections, the
compressors' position biases (`ape`, which transformers initialises to zero), the sinks, the
correction bias and a random `tid2eid` table. The indexer has 16 heads so that no two compressed
entries tie on its score (a tie makes the top-k choice an accident of the sort; with few heads
every ReLU can be zero and transformers' own prefill and decode then pick differently).
"""

from __future__ import annotations

from pathlib import Path

import torch

_COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=48,
    num_experts_per_tok=2,
    n_routed_experts=8,
    n_shared_experts=1,
    max_position_embeddings=512,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=16,
    index_head_dim=16,
    partial_rotary_factor=0.25,
    num_nextn_predict_layers=0,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    swiglu_limit=0.5,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
}
NAMES = ("csa_hca", "hca_first", "sliding")


def tiny_v4_configs() -> dict[str, object]:
    from transformers import DeepseekV4Config

    return {
        "csa_hca": DeepseekV4Config(
            **_COMMON,
            num_hidden_layers=4,
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            hc_mult=2,
            hc_sinkhorn_iters=5,
            sliding_window=8,
            index_topk=3,
            routed_scaling_factor=1.5,
            rope_parameters=YARN,
        ),
        "hca_first": DeepseekV4Config(
            **_COMMON,
            num_hidden_layers=3,
            layer_types=[
                "heavily_compressed_attention",
                "sliding_attention",
                "compressed_sparse_attention",
            ],
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            mlp_layer_types=["hash_moe", "moe", "moe"],
            hc_mult=4,
            hc_sinkhorn_iters=20,
            sliding_window=6,
            index_topk=4,
            routed_scaling_factor=2.5,
        ),
        "sliding": DeepseekV4Config(
            **_COMMON,
            num_hidden_layers=3,
            layer_types=[
                "compressed_sparse_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            mlp_layer_types=["hash_moe", "hash_moe", "hash_moe"],
            hc_mult=2,
            hc_sinkhorn_iters=3,
            sliding_window=5,
            index_topk=2,
            routed_scaling_factor=1.0,
        ),
    }


def make_hf_v4(cfg: object, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
            if name.endswith(("position_bias", "sinks", "base", "hc_base")):
                p.add_(torch.randn_like(p) * 0.5)
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts)[:2] for _ in b]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model


def build_v4_folder(folder: Path, name: str = "csa_hca", seed: int = 0) -> Path:
    """Save tiny config `name` with random weights as safetensors in `folder`."""
    make_hf_v4(tiny_v4_configs()[name], seed).save_pretrained(folder, safe_serialization=True)
    return folder


def decode_step_context(harness: object, tokens: list[int], computed: list[int]) -> tuple:
    """(input_ids, positions, attention metadata, Context) of one decode row per sequence after
    `computed[s]` cached tokens, laid out as tests/model_harness.py's PagedHarness lays a step."""
    from atomrt.runtime.forward_context import AttentionMetaData, Context

    bs = harness.block_size
    slots, lens = [], []
    for s, n in enumerate(computed):
        slots.append(harness.block_tables[s][n // bs] * bs + n % bs)
        lens.append(n + 1)
    tables = [
        bt[: -(-n // bs)] + [-1] * (harness.max_blocks_per_seq - -(-n // bs))
        for bt, n in zip(harness.block_tables, lens)
    ]
    cu = list(range(len(tokens) + 1))
    md = AttentionMetaData(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_seqlen_q=1,
        max_seqlen_k=max(lens),
        num_seqs=len(tokens),
        num_tokens=len(tokens),
        cu_seqlens_q_cpu=cu,
        context_lens_cpu=lens,
    )
    positions = torch.tensor(computed, dtype=torch.int64)
    ctx = Context(
        positions=positions,
        is_prefill=False,
        batch_size=len(tokens),
        running_bs=len(tokens),
        running_tokens=len(tokens),
    )
    return torch.tensor(tokens, dtype=torch.int64), positions, md, ctx


def record_decode_step(
    model: object, unit: object, prompts: list[list[int]], log: list, *extra: object
) -> object:
    """Records one decode step of `unit` (a token graph whose segment backend writes to `log`, as
    the capture loop's record pass runs it) after a prefill of `prompts` through a paged harness,
    with the `extra` context managers entered too; returns the graph."""
    import contextlib

    from model_harness import PagedHarness
    from test_region_graph_cpu import FakeBackend

    from atomrt.graphs.markers import token_graph_of
    from atomrt.runtime.forward_context import set_forward_context

    harness = PagedHarness(model, 40, len(prompts), block_size=4)
    harness.step(prompts, [0] * len(prompts))
    ids, pos, md, ctx = decode_step_context(
        harness, [5 + s for s in range(len(prompts))], [len(p) for p in prompts]
    )
    graph = token_graph_of(unit, backend=FakeBackend(log))
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        stack.enter_context(
            set_forward_context(
                md,
                harness.config,
                ctx,
                tr_graph="record",
                no_compile_layers=harness.layers,
                kv_cache_data=harness.kv_cache_data,
            )
        )
        for cm in extra:
            stack.enter_context(cm)
        model(ids, pos)
    return graph

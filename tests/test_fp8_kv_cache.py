"""The FP8 KV cache (`kv_cache_dtype="fp8"`): e4m3 keys, values and MLA latent rows with per-tensor
scales of 1.0, written saturated and read back widened. Its bytes are half of bfloat16's (twice the
blocks fit); the logits stay within a stated tolerance of the float32 cache; chunked prefill, prefix
caching and preemption give the FP8 cache's own tokens back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from executor_harness import build_tiny_llama
from kernel_device import DEVICE
from model_harness import PagedHarness

from atomrt import SamplingParams
from atomrt.runtime.config import Config, ConfigError
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.workers.loading.loader import load_model
from atomrt.workers.runner.kv_cache import allocate_kv_cache, kv_layer_specs

FP8 = torch.float8_e4m3fn
PROMPTS = [[3, 17, 42, 9, 77, 5, 23, 60, 12], [11, 64, 2, 90], [8, 8, 31, 120, 4, 56, 7, 19, 3]]
# e4m3 keeps 3 mantissa bits: each cached key / value element moves by up to 1/16 of itself. On
# the tiny models (logits O(1-5)) the logits moved by 0.044 (Llama) and 0.18 (DeepSeek-V3, whose
# test weights are large): 0.3 is the stated bound.
LOGIT_TOLERANCE = 0.3


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("llama") / "model")


def _run(
    model: torch.nn.Module,
    cache_dtype: torch.dtype,
    steps: int = 4,
    forced: list[list[int]] | None = None,
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill the prompts in one ragged batch, then `steps` decode steps, with the cache in
    `cache_dtype`: every step's logits and the tokens fed (greedy, or `forced`'s)."""
    harness = PagedHarness(model, max(len(p) for p in PROMPTS) + steps + 1, len(PROMPTS))
    num_blocks = len(PROMPTS) * harness.max_blocks_per_seq + 1
    device = next(model.parameters()).device
    harness.kv_cache_data = allocate_kv_cache(
        kv_layer_specs(harness.layers), num_blocks, harness.block_size, cache_dtype, device
    )
    assert all(
        t.dtype == cache_dtype
        for entry in harness.kv_cache_data.values()
        for t in vars(entry).values()
        if isinstance(t, torch.Tensor)
    )
    new, done, logits, fed = [list(p) for p in PROMPTS], [0] * len(PROMPTS), [], []
    for i in range(steps + 1):
        out = harness.step(new, done)
        logits.append(out)
        done = [d + len(t) for d, t in zip(done, new)]
        fed.append(out.argmax(dim=-1).tolist() if forced is None else forced[i])
        new = [[t] for t in fed[-1]]
    return logits, fed


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_fp8_cache_logits_near_the_float32_cache(llama: Path, tmp_path: Path) -> None:
    """Llama's k/v cache and DeepSeek-V3's latent cache."""
    from deepseek_harness import build_deepseek_folder

    for folder in (llama, build_deepseek_folder(tmp_path / "v3", "v3")):
        model = load_model(Config(model=str(folder)), "cpu", torch.float32).model
        full, tokens = _run(model, torch.float32)
        fp8, _ = _run(model, FP8, forced=tokens)  # the same sequences
        worst = _worst(full, fp8)
        assert 0 < worst < LOGIT_TOLERANCE, (folder, worst)


def test_fp8_cache_saturates_instead_of_overflowing() -> None:
    from atomrt.workers.layers.attention_ref import write_kv_cache_ref

    k = torch.tensor([[[1000.0, -1000.0, 3.3, 0.01]]])
    k_cache, v_cache = (torch.zeros(2, 2, 1, 4, dtype=FP8) for _ in range(2))
    write_kv_cache_ref(k, k, k_cache, v_cache, torch.tensor([3]))
    assert k_cache.view(-1, 4)[3].float().tolist() == [448.0, -448.0, 3.25, 0.009765625]


def test_fp8_cache_halves_the_bytes_and_doubles_the_blocks(llama: Path) -> None:
    from atomrt.workers.runner.kv_sizing import determine_num_blocks
    from atomrt.workers.runner.model_runner import ModelRunner

    blocks, per_block = {}, {}
    for kv in ("auto", "fp8"):
        config = Config(
            model=str(llama),
            model_config={"dtype": "bfloat16"},
            cache_config={"kv_cache_dtype": kv, "cpu_kv_cache_gib": 0.001},
            enforce_eager=True,
        )
        runner = ModelRunner(config, torch.device("cpu"))
        sizing = determine_num_blocks(runner)
        blocks[kv], per_block[kv] = sizing.num_blocks, sizing.bytes_per_block
    assert per_block["auto"] == 2 * per_block["fp8"]
    assert blocks["fp8"] == 2 * blocks["auto"]


def test_kv_cache_dtype_knob(llama: Path) -> None:
    with pytest.raises(ConfigError, match="cache_config.kv_cache_dtype.*'fp8_e5m2'"):
        Config(model=str(llama), cache_config={"kv_cache_dtype": "fp8_e5m2"})
    from atomrt.runtime.entrypoints.llm import config_from_kwargs

    config = config_from_kwargs(str(llama), {"kv_cache_dtype": "fp8_e4m3"})  # LLM()'s keyword
    assert config.cache_config.kv_cache_dtype == "fp8_e4m3"


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
TEXT_PROMPTS = [
    " ".join(f"w{(i * 7 + j * 3) % 120 + 3}" for j in range(12 + 5 * i)) for i in range(6)
]


def _generate(llama: Path, **settings: object) -> list:
    with LLM(str(llama), enforce_eager=True, **settings) as llm:
        return llm.generate(TEXT_PROMPTS, GREEDY, use_tqdm=False)


def test_fp8_cache_through_the_engine(llama: Path) -> None:
    """Chunked prefill, a second pass over cached prefixes and preemption (recompute) give the FP8
    cache's own tokens; the chosen tokens' logprobs stay near the float32 cache's."""
    outs = _generate(llama, kv_cache_dtype="fp8", enable_prefix_caching=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    chunked = _generate(
        llama, kv_cache_dtype="fp8", max_num_batched_tokens=16, enable_prefix_caching=False
    )
    assert [o.outputs[0].token_ids for o in chunked] == tokens
    with LLM(str(llama), enforce_eager=True, kv_cache_dtype="fp8") as llm:
        llm.generate(TEXT_PROMPTS, GREEDY, use_tqdm=False)
        again = llm.generate(TEXT_PROMPTS, GREEDY, use_tqdm=False)
    assert sum(o.num_cached_tokens or 0 for o in again) > 0
    assert [o.outputs[0].token_ids for o in again] == tokens
    tight = _generate(llama, kv_cache_dtype="fp8", num_kv_blocks=8, enable_prefix_caching=False)
    assert sum(o.metrics.num_preemptions for o in tight) > 0
    assert [o.outputs[0].token_ids for o in tight] == tokens
    full = _generate(llama, enable_prefix_caching=False)
    for a, b in zip(outs, full):
        n = 0
        for ta, tb, la, lb in zip(
            a.outputs[0].token_ids,
            b.outputs[0].token_ids,
            a.outputs[0].logprobs,
            b.outputs[0].logprobs,
        ):
            if ta != tb:
                break  # the sequences part: later rows read different contexts
            assert abs(la[ta].logprob - lb[tb].logprob) < LOGIT_TOLERANCE
            n += 1
        assert n > 0


@pytest.mark.slow
def test_fp8_cache_at_level_3(llama: Path) -> None:
    """Compiled (level 3, Inductor on CPU): the eager FP8 cache's tokens."""
    eager = _generate(llama, kv_cache_dtype="fp8")
    with LLM(str(llama), kv_cache_dtype="fp8", enforce_eager=False, compilation_config=3) as llm:
        compiled = llm.generate(TEXT_PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]


def _representable(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 values (NaN kept), in x's dtype: the kernels' reads and writes of them
    are exact, so the check is of the plumbing (Triton's interpreter rounds some values to the
    wrong binade when it casts to e4m3; the GPU tier checks rounding)."""
    return x.to(FP8).to(x.dtype)


@pytest.mark.parametrize("case", ["prefill", "decode", "mtp3"])
def test_paged_attention_kernel_reads_an_fp8_cache(case: str) -> None:
    """The Triton prefill / paged kernel over an e4m3 cache equals the float64 attention over the
    same values."""
    import dataclasses

    from test_kernels import CASES, check_output, make_batch, run_attention

    lens_q, lens_k = CASES[case]
    b = make_batch(
        lens_q, lens_k, num_kv_heads=2, group=3, head_dim=32, block_size=16, max_blocks=4,
        pad_rows=2, seed=11,
    )  # fmt: skip
    b = dataclasses.replace(b, k_cache=b.k_cache.to(FP8), v_cache=b.v_cache.to(FP8))
    check_output(b, run_attention(b, graph_safe=False, max_seqlen_q=max(lens_q)))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_writes_and_reads_an_fp8_cache(num_splits: int) -> None:
    """The one-launch decode kernel: the new key and value written to the e4m3 cache and attended
    from registers, the old ones read from it."""
    import dataclasses

    from test_decode_attention import check, forced_plan, make_decode_case, run_decode

    case = make_decode_case(
        [1, 2, 17, 40], num_kv_heads=2, group=4, head_dim=32, pad_seqs=1, pad_rows=2,
        rope=False, seed=5,
    )  # fmt: skip
    b = case.batch
    b = dataclasses.replace(b, k_cache=b.k_cache.to(FP8), v_cache=b.v_cache.to(FP8))
    case = dataclasses.replace(case, batch=b, k=_representable(case.k), v=_representable(case.v))
    check(case, run_decode(case, forced_plan(4, 32, num_splits)))


def test_write_kernel_saturates_into_an_fp8_cache() -> None:
    from atomrt.workers.kernels.attention.paged_attention import write_kv_cache

    k = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(0))
    k = _representable(k.to(DEVICE))
    k[0, 0, :2] = torch.tensor([1000.0, -1000.0])
    k_cache, v_cache = (torch.zeros(4, 4, 2, 16, dtype=FP8, device=DEVICE) for _ in range(2))
    write_kv_cache(k, k, k_cache, v_cache, torch.tensor([5, -1, 14], device=DEVICE))
    want = k.clamp(-448, 448)
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, 2, 16).float()
        assert torch.equal(flat[5], want[0]) and torch.equal(flat[14], want[2])
        assert flat[[i for i in range(16) if i not in (5, 14)]].abs().sum() == 0


@pytest.mark.gpu
def test_fp8_cache_on_the_gpu(llama: Path) -> None:
    """The CUDA kernels (rotary + write, the one-launch decode, the paged prefill) with an e4m3
    cache: logits near the float32 cache's, and CUDA graphs give the eager engine's tokens."""
    model = load_model(Config(model=str(llama)), "cuda", torch.float32).model
    full, tokens = _run(model, torch.float32)
    fp8, _ = _run(model, FP8, forced=tokens)
    assert 0 < _worst(full, fp8) < LOGIT_TOLERANCE
    settings = dict(device="cuda", dtype="float32", kv_cache_dtype="fp8")
    with LLM(str(llama), enforce_eager=True, **settings) as llm:
        eager = llm.generate(TEXT_PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(llama), enforce_eager=False, **settings) as llm:
        graphs = llm.generate(TEXT_PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]


@pytest.mark.gpu
def test_fp8_latent_cache_on_the_gpu(tmp_path: Path) -> None:
    """MLA's latent write and paged decode kernels with an e4m3 cache (DeepSeek-V3, float32)."""
    from deepseek_harness import build_deepseek_folder

    folder = build_deepseek_folder(tmp_path / "v3", "v3")
    model = load_model(Config(model=str(folder)), "cuda", torch.float32).model
    full, tokens = _run(model, torch.float32)
    fp8, _ = _run(model, FP8, forced=tokens)
    assert 0 < _worst(full, fp8) < LOGIT_TOLERANCE


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_kernels_write_and_read_an_fp8_latent_cache(num_splits: int) -> None:
    """MLA's latent write saturates into an e4m3 cache and the paged MLA decode reads it widened
    to q's dtype (float32 here: full-precision products), against float64 over the same values."""
    from test_mla_kernels import check_mla, make_mla_batch, run_mla

    from atomrt.workers.kernels.attention.mla_write import mla_write_kv_cache

    batch = make_mla_batch(
        [1, 3, 1], [9, 40, 66], num_heads=4, kv_lora_rank=64, rope_dim=32, seed=num_splits
    )
    batch.kv_cache = batch.kv_cache.to(FP8)
    check_mla(batch, run_mla(batch, num_kv_splits=num_splits))
    kv_c = _representable(torch.randn(2, 64, device=DEVICE))
    kv_c[0, 0] = 1000.0
    k_pe = _representable(torch.randn(2, 32, device=DEVICE))
    mla_write_kv_cache(kv_c, k_pe, batch.kv_cache, torch.tensor([3, -1], device=DEVICE))
    row = batch.kv_cache.view(-1, 96)[3].float()
    assert torch.equal(row, torch.cat((kv_c[0].clamp(-448, 448), k_pe[0])))

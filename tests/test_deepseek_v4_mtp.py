"""DeepSeek-V4's multi-token-prediction layer (workers/models/deepseek_v4_mtp.py) on a tiny model
made by transformers, with an MTP layer saved beside it under DeepSeek's names (`mtp.0.*`).

The judge of the layer's logits is a float64 implementation of DeepSeek's formulas written here
(enorm / hnorm / e_proj / h_proj over the target's last streams, the layer's hyper head and norm,
the target's embedding and head) around transformers' own V4 decoder layer as the MTP block; the
engine's greedy tokens under `speculative_config.method: mtp` are transformers' `generate`'s
(speculation never changes greedy tokens).
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
import torch
from model_harness import PagedHarness, hf_greedy
from torch import nn
from v4_harness import make_hf_v4, tiny_v4_configs

from atomrt.runtime.config import CompilationConfig, Config
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import SamplingParams
from atomrt.workers.loading.loader import load_model, load_mtp_layers

transformers = pytest.importorskip("transformers")

NAME = "hca_first"  # hc_mult 4; its layer 1 is what an MTP block is: sliding window, top-k MoE
BLOCK_LAYER = 1
TOLERANCE = 1e-4
PROMPT = [3, 17, 42, 99, 5, 8, 61, 11, 12, 13, 14, 15, 16, 17]


def _config() -> object:
    cfg = tiny_v4_configs()[NAME]
    cfg.num_nextn_predict_layers = 1
    return cfg


def _mtp_tensors(donor: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The MTP layer under DeepSeek's names: the donor's layer `BLOCK_LAYER` as its block (the
    names transformers writes back, `model.layers.1.` -> `mtp.0.`) and random own tensors."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        donor.save_pretrained(tmp, safe_serialization=True)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    prefix = f"model.layers.{BLOCK_LAYER}."
    out = {"mtp.0." + k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
    cfg = donor.config
    h, hc = cfg.hidden_size, cfg.hc_mult
    g = torch.Generator().manual_seed(seed)
    out.update(
        {
            "mtp.0.e_proj.weight": torch.randn(h, h, generator=g) * h**-0.5,
            "mtp.0.h_proj.weight": torch.randn(h, h, generator=g) * h**-0.5,
            "mtp.0.enorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
            "mtp.0.hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
            "mtp.0.norm.weight": 1 + 0.2 * torch.randn(h, generator=g),
            "mtp.0.hc_head_fn": 0.1 * torch.randn(hc, hc * h, generator=g),
            "mtp.0.hc_head_base": 0.5 * torch.randn(hc, generator=g),
            "mtp.0.hc_head_scale": 1 + 0.1 * torch.randn(1, generator=g),
        }
    )
    return {k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The folder (target and MTP layer), transformers' target and the MTP tensors."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("v4_mtp")
    target = make_hf_v4(_config(), seed=0)
    target.save_pretrained(folder, safe_serialization=True)
    donor = make_hf_v4(_config(), seed=3)
    mtp = _mtp_tensors(donor, seed=5)
    save_file(mtp, str(folder / "mtp.safetensors"))
    return {"folder": folder, "target": target, "donor": donor, "mtp": mtp}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_logits(tiny: dict, tokens: list[int], next_ids: list[int]) -> torch.Tensor:
    """float64: row t's MTP logits (predicting the token after next_ids[t]) over `tokens`."""
    target = copy.deepcopy(tiny["target"]).double()
    donor = copy.deepcopy(tiny["donor"]).double()
    for m in (target, donor):  # the grouped-matmul experts take no float64
        m.set_experts_implementation("eager")
    w = {k: v.double() for k, v in tiny["mtp"].items()}
    cfg = target.config
    eps, hc_eps = cfg.rms_norm_eps, cfg.hc_eps
    ids = torch.tensor([tokens])
    seen: list[torch.Tensor] = []
    hook = target.model.layers[-1].register_forward_hook(lambda m, a, o: seen.append(o))
    with torch.no_grad():
        target(input_ids=ids)
    hook.remove()
    streams = seen[0][0]  # [L, hc, hidden]: the target's last layer, before its hyper head
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    e = (
        _rms(embed[torch.tensor(next_ids)], w["mtp.0.enorm.weight"], eps)
        @ w["mtp.0.e_proj.weight"].T
    )
    x = _rms(streams, w["mtp.0.hnorm.weight"], eps) @ w["mtp.0.h_proj.weight"].T
    z = x + e.unsqueeze(1)
    # the block: transformers' decoder layer (the donor's, whose tensors the MTP layer carries)
    block = donor.model.layers[BLOCK_LAYER]
    donor.model.layers = nn.ModuleList([block])
    out: list[torch.Tensor] = []
    pre = block.register_forward_pre_hook(
        lambda m, a, k: ((z.unsqueeze(0), *a[1:]), k), with_kwargs=True
    )
    post = block.register_forward_hook(lambda m, a, o: out.append(o))
    with torch.no_grad():
        donor(input_ids=ids)
    pre.remove()
    post.remove()
    y = out[0][0]  # [L, hc, hidden]
    flat = y.flatten(1)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    mix = flat @ w["mtp.0.hc_head_fn"].T * w["mtp.0.hc_head_scale"] + w["mtp.0.hc_head_base"]
    collapsed = ((torch.sigmoid(mix) + hc_eps).unsqueeze(-1) * y).sum(1)
    return _rms(collapsed, w["mtp.0.norm.weight"], eps) @ head.T


class _TargetAndMTP(nn.Module):
    """The target's step, then the MTP layer's pass over the same rows in the same context (as
    the drafter's first pass runs); keeps the MTP logits of every row."""

    def __init__(self, model: nn.Module, mtp: nn.Module, max_rows: int) -> None:
        super().__init__()
        self.model, self.mtp = model, mtp  # the MTP layers' attention is found here too
        self.streams = torch.zeros(max_rows, *mtp.hidden_shape)
        mtp.bind(self.streams)
        self.next_ids = torch.zeros(0, dtype=torch.int64)
        self.mtp_logits: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids, positions)
        n = input_ids.shape[0]
        out = self.mtp(self.next_ids, positions, self.streams[:n])
        self.mtp_logits.append(self.mtp.compute_logits(out))
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def test_mtp_logits_match_float64_formulas(tiny: dict) -> None:
    """A prefill then a decode step through the paged cache (the MTP layer's own sliding-window
    KV carried between them): every row's MTP logits within 1e-4 of the float64 formulas."""
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    config = Config(model=str(tiny["folder"]), speculative_config=spec)
    loaded = load_model(config, "cpu", torch.float32)
    mtp = load_mtp_layers(loaded.model, config, "cpu", torch.float32).mtp  # the drafter's own
    assert not any(n.startswith("mtp.") for n, _ in loaded.model.named_parameters())
    model = _TargetAndMTP(loaded.model, mtp, 64)
    harness = PagedHarness(model, 40, 1, block_size=4)
    assert sorted(harness.layers) == [0, 1, 2, 3]  # the MTP layer's cache is layer 3's
    nxt, after = 7, 9
    model.next_ids = torch.tensor(PROMPT[1:] + [nxt])
    harness.step([PROMPT], [0])
    model.next_ids = torch.tensor([after])
    harness.step([[nxt]], [len(PROMPT)])
    got = torch.cat(model.mtp_logits).double()
    want = _reference_logits(tiny, PROMPT + [nxt], PROMPT[1:] + [nxt, after])
    worst = (got - want).abs().max().item()
    assert worst <= TOLERANCE, f"max |MTP logits - float64 formulas| = {worst:.3g}"
    assert want.abs().max().item() > 0.1  # the logits are not trivially small


def test_checkpoint_without_mtp_layers_is_refused(tmp_path: Path) -> None:
    """method 'mtp' on a V4 checkpoint whose MTP tensors are absent names what is missing."""
    make_hf_v4(_config(), seed=0).save_pretrained(tmp_path, safe_serialization=True)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    config = Config(model=str(tmp_path), speculative_config=spec)
    target = load_model(config, "cpu", torch.float32).model  # the target loads without them
    with pytest.raises(ValueError, match="num_nextn_predict_layers=1"):
        load_mtp_layers(target, config, "cpu", torch.float32)


# (drafts per step, compilation: None for level 0 / False for level 3 pieces run as traced)
ENGINE_CASES = [
    pytest.param(1, None, id="k1-level0"),
    pytest.param(2, None, id="k2-level0"),
    pytest.param(2, False, id="k2-level3", marks=pytest.mark.slow),
    pytest.param(2, True, id="k2-level3-inductor", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("k,inductor", ENGINE_CASES)
def test_greedy_with_mtp_is_greedy_without(
    tiny: dict, k: int, inductor: object, tmp_path: Path
) -> None:
    """The engine's greedy tokens under method 'mtp' are transformers' `generate`'s; drafts are
    proposed and some accepted (the random MTP layer guesses a few of the target's tokens)."""
    prompts = [PROMPT, [5, 6, 7, 8] * 4, [9, 10, 11]]
    expected = hf_greedy(tiny["folder"], prompts, 12)
    compiled: dict = dict(enforce_eager=True)
    if inductor is not None:
        cc = CompilationConfig(level=3, cache_dir=str(tmp_path), use_inductor=inductor)
        compiled = dict(enforce_eager=False, compilation_config=cc)
    llm = LLM(
        str(tiny["folder"]),
        device="cpu",
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
        **compiled,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats.spec_decode
    finally:
        llm.shutdown()
    assert got == expected
    print(f"k={k}: {stats.num_accepted_tokens} of {stats.num_draft_tokens} drafts accepted")
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


def test_tiny_preset_drafts_with_dummy_weights() -> None:
    """Dummy weights fill the MTP layer too (after the target's, which stay as without it): the
    tiny preset with one MTP layer gives the same greedy tokens with and without method 'mtp'."""
    prompts = [list(range(3, 40)), [5, 6, 7]]
    common = dict(
        load_format="dummy",
        hf_overrides={"num_nextn_predict_layers": 1},
        device="cpu",
        enforce_eager=True,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=8,
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 2}):
        llm = LLM("tiny-deepseek-v4", speculative_config=spec, **common)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens.append([o.outputs[0].token_ids for o in outs])
            if spec is not None:
                assert llm.engine.stats.spec_decode.num_drafts > 0
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1]


# two prompts share a 16-token prefix (four blocks of 4: prefix caching), lengths 2-26
SHARED = [5, 9, 14, 2, 77, 31, 8, 150, 66, 4, 12, 90, 33, 44, 55, 66]
ENGINE_PROMPTS = [
    SHARED + [7, 3, 9, 10, 11],
    list(range(21, 47)),
    [8, 6],
    SHARED + [101, 102, 103, 104],
    [60, 61, 62, 63, 64, 65, 66],
]
# (tensor_parallel_size, data_parallel_size, KV blocks: 10 are fewer than the requests need)
LAYOUTS = [
    pytest.param(1, 1, 10, id="chunked-prefix-preemption"),
    pytest.param(2, 1, 14, id="mp-tp2", marks=pytest.mark.slow),
    pytest.param(1, 2, 14, id="mp-dp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("tp,dp,blocks", LAYOUTS)
def test_mtp_layouts_keep_greedy_tokens(tiny: dict, tp: int, dp: int, blocks: int) -> None:
    """Async scheduling, prefill chunks of 5 rows (a chunk that samples nothing hands the MTP
    layer the prompt's next token), prefix caching and preemption (the MTP layer's KV recomputed
    with the target's); TP splits the MTP block's heads and experts as the target's, DP runs its
    experts over every rank's rows. Greedy tokens are transformers' `generate`'s."""
    from model_harness import engine_greedy

    expected = hf_greedy(tiny["folder"], ENGINE_PROMPTS, 10)
    settings = dict(
        device="cpu",
        enforce_eager=True,
        block_size=4,
        num_kv_blocks=blocks,
        max_num_seqs=8,
        max_num_batched_tokens=5,
        async_scheduling=True,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    if tp * dp > 1:
        settings.update(executor="mp", worker_timeout_s=90.0)
    got, seen = engine_greedy(tiny["folder"], ENGINE_PROMPTS, 10, **settings)
    assert got == expected
    assert seen["prefix_hits"] >= len(SHARED), seen
    if blocks == 10:
        assert seen["preemptions"] > 0, seen


def test_fp8_mxfp4_checkpoint_drafts(tiny: dict, tmp_path: Path) -> None:
    """The MTP layer as DeepSeek-V4 ships it: routed experts MXFP4, the block's attention and
    shared-expert projections FP8 (kept so), e_proj / h_proj FP8 (widened to the model dtype,
    exactly the dequantized values). Greedy tokens under method 'mtp' are those without."""
    import json
    import re

    from safetensors.torch import load_file, save_file
    from test_mxfp4_v4 import (
        FP8_PROJECTIONS,
        QUANTIZATION_CONFIG,
        ROUTED,
        quantize_fp8_block,
        quantize_mxfp4,
    )
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    widened = re.compile(r"^mtp\.0\.(e_proj|h_proj)\.weight$")
    saved: dict[str, torch.Tensor] = {}
    for file in ("model.safetensors", "mtp.safetensors"):
        out = {}
        for name, w in load_file(str(tiny["folder"] / file)).items():
            base = name[: -len(".weight")]
            if ROUTED.search(name):
                out[name], out[base + ".scale"] = quantize_mxfp4(w)
            elif FP8_PROJECTIONS.search(name) or widened.search(name):
                out[name], out[base + ".scale"] = quantize_fp8_block(w)
            else:
                out[name] = w
        save_file(out, str(tmp_path / file))
        saved.update(out)
    config = json.loads((tiny["folder"] / "config.json").read_text())
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(config))

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    config = Config(model=str(tmp_path), speculative_config=spec)
    target = load_model(config, "cpu", torch.float32).model
    layer = load_mtp_layers(target, config, "cpu", torch.float32).mtp.layers[0]
    assert type(layer.block.attn.wq_a).__name__ == "BlockFp8Linear"
    dequantize = Fp8Dequantize(None)._dequantize_one
    for proj in ("e_proj", "h_proj"):
        w, s = saved[f"mtp.0.{proj}.weight"], saved[f"mtp.0.{proj}.scale"]
        want = dequantize(w, s.view(torch.uint8), torch.float32)
        assert torch.equal(getattr(layer, proj).weight, want)

    prompts = [PROMPT, [5, 6, 7, 8] * 4, [9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for speculative_config in (None, spec):
        llm = LLM(
            str(tmp_path),
            device="cpu",
            enforce_eager=True,
            block_size=4,
            num_kv_blocks=64,
            max_num_batched_tokens=16,
            speculative_config=speculative_config,
        )
        try:
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
            if speculative_config is not None:
                assert llm.engine.stats.spec_decode.num_drafts > 0
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1]

"""DeepSeek-V4 checkpoints as they ship: routed experts in MXFP4 (packed e2m1 pairs and an e8m0
scale per 32 values, `quantization_config.expert_dtype: "fp4"`), the attention projections, the
indexer's query projection and the shared expert in FP8 with a ue8m0 scale per 128x128 block, both
held so in memory (the FP8 projections run w8a8, their inputs quantized per token and 128
features).

A tiny V4 saved by transformers is quantized so by the script here; the reference is transformers'
model (float64) of the same checkpoint dequantized by transformers' own FP8/FP4 dequantizer
(`Fp8Dequantize`), each FP8 projection's input quantized to e4m3 and back as atomrt's GEMM does:
atomrt's logits over a ragged prefill and decode steps equal it within 1e-4, and its greedy tokens
are the reference's. What does not match the format is refused by name.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from fp8_harness import qdq
from model_harness import run_prefill_and_decode
from safetensors.torch import load_file, save_file
from v4_harness import build_v4_folder

from atomrt.runtime.config import Config
from atomrt.workers.layers.quantization.fp8 import Fp8Config
from atomrt.workers.layers.quantization.fp8_layers import convert_experts
from atomrt.workers.layers.quantization.mxfp4 import dequantize_mxfp4
from atomrt.workers.layers.v4_moe import V4MoE
from atomrt.workers.loading.loader import load_model

transformers = pytest.importorskip("transformers")

E8M0 = torch.float8_e8m0fnu
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
ROUTED = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
# what DeepSeek-V4 ships in FP8 (the compressors' projections and weights_proj stay 16-bit)
FP8_PROJECTIONS = re.compile(
    r"(\.attn\.w(q_a|q_b|kv|o_a|o_b)|\.attn\.indexer\.wq_b|\.ffn\.shared_experts\.w[123])"
    r"\.weight$"
)
# transformers' names of those projections: each quantizes its input per token and 128 features
REFERENCE_FP8 = re.compile(
    r"self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|compressor\.indexer\.q_b_proj)$"
    r"|shared_experts\.(gate|up|down)_proj$"
)
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}
PROMPTS = [[3, 17, 42, 99, 5, 8, 61, 11, 12, 13, 14, 15, 16, 17, 18], [7, 1, 120], [40, 50, 60, 70]]
TOLERANCE = 1e-4


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K / 2] e2m1 pairs, low nibble first; e8m0 [N, K / 32]): each group of
    32 scaled by the power of two that brings its largest |value| to at most 6, then rounded to the
    nearest e2m1 value."""
    n, k = w.shape
    groups = w.double().reshape(n, k // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - E2M1.double()).abs().argmin(-1)  # nearest magnitude
    codes = (codes | torch.where(scaled < 0, 8, 0)).reshape(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), (exponent + 127).to(torch.uint8).view(E8M0)


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3, e8m0 [ceil(N/128), ceil(K/128)]): each 128x128 block over the power of
    two that brings its largest |value| to at most 448."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    exponents = torch.empty(math.ceil(n / 128), math.ceil(k / 128), dtype=torch.uint8)
    for i in range(exponents.shape[0]):
        for j in range(exponents.shape[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].double()
            exponent = math.ceil(math.log2(float(block.abs().max()) / 448.0))
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = block / 2.0**exponent
            exponents[i, j] = exponent + 127
    return q, exponents.view(E8M0)


def quantize_v4_folder(src: Path, dst: Path) -> Path:
    """`src` (a float V4 checkpoint) with its routed experts MXFP4 and its attention projections
    and shared expert FP8, as DeepSeek-V4 ships them, in `dst`."""
    dst.mkdir(parents=True)
    tensors = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        base = name[: -len(".weight")]
        if ROUTED.search(name):
            tensors[name], tensors[base + ".scale"] = quantize_mxfp4(w)
        elif FP8_PROJECTIONS.search(name):
            tensors[name], tensors[base + ".scale"] = quantize_fp8_block(w)
        else:
            tensors[name] = w
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (dst / "config.json").write_text(json.dumps(config))
    for extra in src.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            (dst / extra.name).write_bytes(extra.read_bytes())
    return dst


def dequantized_folder(src: Path, dst: Path) -> Path:
    """The quantized checkpoint `src` with every weight dequantized by transformers' own FP8 / FP4
    dequantizer, float32 (the values are exact in it), and no quantization_config."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    dequantize = Fp8Dequantize(None)._dequantize_one
    dst.mkdir(parents=True)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in tensors:
            continue
        scale = (
            tensors.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        )
        if scale is not None:
            w = dequantize(w, scale.view(torch.uint8), torch.float32)
        out[name] = w
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("v4_mxfp4")
    quantized = quantize_v4_folder(build_v4_folder(root / "float", "csa_hca"), root / "quantized")
    return quantized, dequantized_folder(quantized, root / "dequantized")


def test_mxfp4_dequantization_matches_transformers() -> None:
    """Every e2m1 code in both nibbles, scales from 2^-127 to 2^127: atomrt's dequantization equals
    transformers' (its own unpacking and e8m0 decoding)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (6, 64), generator=gen, dtype=torch.uint8)
    packed[0, :16] = torch.arange(16, dtype=torch.uint8) * 17  # each code, low and high
    exponents = torch.randint(100, 150, (6, 4), generator=gen, dtype=torch.uint8)
    exponents[1, :2] = torch.tensor([0, 254], dtype=torch.uint8)
    ours = dequantize_mxfp4(packed.view(torch.int8), exponents.view(E8M0), "w")
    theirs = Fp8Dequantize(None)._dequantize_one(packed.view(torch.int8), exponents, torch.float32)
    assert torch.equal(ours, theirs)
    assert torch.equal(dequantize_mxfp4(packed, exponents, "w"), theirs)  # uint8 bytes too
    with pytest.raises(ValueError, match=r"w: an MXFP4 weight of 6 x 128 values takes a scale"):
        dequantize_mxfp4(packed, exponents[:, :3], "w")
    exponents[2, 0] = 255
    with pytest.raises(ValueError, match="w: an e8m0 scale holds NaN"):
        dequantize_mxfp4(packed, exponents, "w")
    with pytest.raises(ValueError, match="w: an MXFP4 weight is packed e2m1 pairs"):
        dequantize_mxfp4(packed.float(), exponents, "w")


def _reference(folder: Path, fp8_inputs: bool = False) -> torch.nn.Module:
    """transformers' model of `folder` in float64 (eager attention and experts); `fp8_inputs`:
    each FP8 projection's input quantized to e4m3 and back per token and 128 features, as
    atomrt's w8a8 GEMM quantizes it (the float64 model of the quantized checkpoint)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    hooked = 0
    for name, module in model.named_modules():
        if fp8_inputs and REFERENCE_FP8.search(name):
            module.register_forward_pre_hook(lambda _m, args: (qdq(args[0], 128),))
            hooked += 1
    # per layer the attention's five and the shared expert's three; a CSA layer's indexer one
    csa = model.config.layer_types.count("compressed_sparse_attention")
    assert hooked == (8 * len(model.model.layers) + csa if fp8_inputs else 0)
    return model


def _worst_against(reference: torch.nn.Module, result: object) -> float:
    """Largest |atomrt - reference| over every step's logits; asserts atomrt's greedy tokens are
    the reference's argmax at each step."""
    worst = 0.0
    for s, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            logits = reference(torch.tensor([result.sequences[s][:-1]])).logits[0]
        got = torch.stack([step[s] for step in result.logits]).double().cpu()
        expected = logits[len(prompt) - 1 :]
        worst = max(worst, (got - expected).abs().max().item())
        assert result.sequences[s][len(prompt) :] == expected.argmax(-1).tolist()
    return worst


def test_v4_mxfp4_checkpoint_matches_the_float64_reference(folders: tuple[Path, Path]) -> None:
    quantized, dequantized = folders
    loaded = load_model(Config(model=str(quantized)), "cpu", torch.float32)
    moe = loaded.model.model.layers[2].ffn
    reference = _reference(dequantized, fp8_inputs=True)
    _assert_fp8_projections_as_shipped(loaded.model, quantized)
    # the routed experts are held as MXFP4 (4.25 bits a weight) and hold the checkpoint's values
    # (gate and up rows stacked, as transformers stacks them)
    assert moe.mxfp4 and moe.w13_packed.dtype == torch.uint8
    assert moe.w13_packed.shape == (8, 64, 32) and moe.w13_scale.shape == (8, 64, 2)
    shipped = load_file(str(quantized / "model.safetensors"))  # held as shipped: the same bytes
    for e in range(8):
        w3 = shipped[f"model.layers.2.ffn.experts.{e}.w3.weight"].view(torch.uint8)
        w3_scale = shipped[f"model.layers.2.ffn.experts.{e}.w3.scale"].view(torch.uint8)
        assert torch.equal(moe.w13_packed[e, 32:], w3) and torch.equal(
            moe.w13_scale[e, 32:], w3_scale
        )
    want = reference.model.layers[2].mlp.experts.gate_up_proj.detach()
    held = [dequantize_mxfp4(p, s, "w13") for p, s in zip(moe.w13_packed, moe.w13_scale)]
    assert torch.equal(torch.stack(held).double(), want)
    result = run_prefill_and_decode(loaded.model, PROMPTS, 8, block_size=4, num_pad_rows=2)
    worst = _worst_against(reference, result)  # and the greedy tokens are the reference's
    assert worst <= TOLERANCE, worst
    # the quantization moved the model: the float checkpoint's logits are elsewhere
    float_model = _reference(quantized.parent / "float")
    with torch.no_grad():
        float_logits = float_model(torch.tensor([result.sequences[0][:-1]])).logits[0]
        ref_logits = reference(torch.tensor([result.sequences[0][:-1]])).logits[0]
    assert (float_logits - ref_logits).abs().max() > 100 * TOLERANCE


def _assert_fp8_projections_as_shipped(model: torch.nn.Module, quantized: Path) -> None:
    """Every projection the checkpoint ships in FP8 is held in e4m3, the checkpoint's bytes, with
    its ue8m0 block scale as float32 per weight row; the compressors' stay float32."""
    shipped = load_file(str(quantized / "model.safetensors"))
    held = 0
    for name, tensor in shipped.items():
        if not FP8_PROJECTIONS.search(name):
            continue
        layer = model.get_submodule(name.removesuffix(".weight"))
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(layer.weight.view(torch.uint8), tensor.view(torch.uint8))
        scale = shipped[name.removesuffix(".weight") + ".scale"].view(torch.uint8)
        rows = torch.exp2(scale.float() - 127).repeat_interleave(128, 0)[: tensor.shape[0]]
        assert layer.weight_scale.dtype == torch.float32
        assert torch.equal(layer.weight_scale, rows)
        held += 1
    assert held == 34  # 4 layers x (5 attention + 3 shared expert) + 2 CSA indexers' wq_b
    attn = model.model.layers[1].attn
    assert attn.compressor.wkv.weight.dtype == torch.float32
    assert attn.indexer.weights_proj.weight.dtype == torch.float32
    assert attn.indexer.wq_b.weight_scale.shape == (256, 1)  # two row blocks, one feature group


def _rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of checkpoint `src` whose tensors (a dict) and config `change(tensors, config)`
    edits in place."""
    dst.mkdir(parents=True)
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_what_does_not_match_is_refused_by_name(folders: tuple[Path, Path], tmp_path: Path) -> None:
    quantized, dequantized = folders
    expert = "model.layers.1.ffn.experts.3.w2"

    def float_expert(tensors: dict, config: dict) -> None:
        tensors[expert + ".weight"] = torch.zeros(64, 32)
        del tensors[expert + ".scale"]

    folder = _rewrite(quantized, tmp_path / "float_expert", float_expert)
    with pytest.raises(ValueError, match=rf"{expert}.weight is torch.float32, but .*'fp4'"):
        load_model(Config(model=str(folder)), "cpu", torch.float32)

    folder = _rewrite(quantized, tmp_path / "no_scale", lambda t, c: t.pop(expert + ".scale"))
    with pytest.raises(ValueError, match=rf"quantized weights without a .scale: \['{expert}"):
        load_model(Config(model=str(folder)), "cpu", torch.float32)

    gate = "model.layers.1.ffn.experts.3.w1"

    def bad_grid(tensors: dict, config: dict) -> None:
        tensors[gate + ".scale"] = tensors[gate + ".scale"][:, :1].contiguous()

    folder = _rewrite(quantized, tmp_path / "bad_grid", bad_grid)
    with pytest.raises(ValueError, match=rf"{gate}.weight: an MXFP4 weight of 32 x 64 values"):
        load_model(Config(model=str(folder)), "cpu", torch.float32)

    def nvfp4(tensors: dict, config: dict) -> None:
        config["quantization_config"]["expert_dtype"] = "nvfp4"

    folder = _rewrite(quantized, tmp_path / "nvfp4", nvfp4)
    with pytest.raises(ValueError, match="quantization_config.expert_dtype 'nvfp4' is not"):
        load_model(Config(model=str(folder)), "cpu", torch.float32)

    def missing_expert(tensors: dict, config: dict) -> None:
        for suffix in (".weight", ".scale"):
            del tensors[gate + suffix]

    folder = _rewrite(quantized, tmp_path / "missing", missing_expert)
    with pytest.raises(ValueError, match=r"1 routed expert tensors missing, e.g. \['experts.3.w1'"):
        load_model(Config(model=str(folder)), "cpu", torch.float32)

    wq_a = "model.layers.0.attn.wq_a"

    def float_projection(tensors: dict, config: dict) -> None:
        tensors[wq_a + ".weight"] = torch.zeros(48, 64)
        del tensors[wq_a + ".scale"]

    folder = _rewrite(quantized, tmp_path / "float_projection", float_projection)
    with pytest.raises(ValueError, match=rf"{wq_a}.weight is torch.float32 without a .scale, but"):
        load_model(Config(model=str(folder)), "cpu", torch.float32)
    # listed in modules_to_not_convert, the float projection loads as it is
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["layers.0.attn.wq_a"]
    (folder / "config.json").write_text(json.dumps(config))
    model = load_model(Config(model=str(folder)), "cpu", torch.float32).model
    assert model.model.layers[0].attn.wq_a.weight.dtype == torch.float32
    assert model.model.layers[1].attn.wq_a.weight.dtype == torch.float8_e4m3fn

    def projection_grid(tensors: dict, config: dict) -> None:
        tensors[wq_a + ".scale"] = torch.full((2, 1), 127, dtype=torch.uint8).view(E8M0)

    folder = _rewrite(quantized, tmp_path / "projection_grid", projection_grid)
    with pytest.raises(ValueError, match=rf"{wq_a}.weight: an FP8 weight of 48 x 64 takes a scale"):
        load_model(Config(model=str(folder)), "cpu", torch.float32)

    def per_tensor(tensors: dict, config: dict) -> None:
        del config["quantization_config"]["weight_block_size"]

    folder = _rewrite(quantized, tmp_path / "per_tensor", per_tensor)
    with pytest.raises(ValueError, match="quantization_config without weight_block_size: DeepSe"):
        load_model(Config(model=str(folder)), "cpu", torch.float32)

    # online quantization does not reach V4's own layers: refused rather than ignored
    config = Config(model=str(dequantized), model_config={"quantization": "fp8"})
    with pytest.raises(ValueError, match="model_config.quantization='fp8' does not quantize"):
        load_model(config, "cpu", torch.float32)
    # MXFP4 experts are DeepSeek-V4's: another model's fused-MoE experts refuse them
    with pytest.raises(ValueError, match="expert_dtype 'fp4' \\(MXFP4 experts\\) loads for"):
        convert_experts(torch.nn.Module(), Fp8Config(expert_dtype="fp4"), "model.layers.0.mlp")


def test_mxfp4_experts_need_whole_scale_groups() -> None:
    """An expert shard whose input features do not fill whole 32-feature groups (here 48 rows of
    intermediate size) cannot be held as MXFP4: refused naming the size."""
    moe = V4MoE(64, 48, 4, 2, 1, "sqrtsoftplus", 1.0, 0.5, False, 16)
    with pytest.raises(ValueError, match=r"moe_intermediate_size / \(data_parallel_size x "):
        moe.keep_mxfp4()


def test_the_experts_op_is_opaque_to_tracing() -> None:
    """Traced (levels 2-3), the MXFP4 experts are one custom op whose fake gives x's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 64)
        packed13, scale13 = torch.empty(4, 64, 32, dtype=torch.uint8), torch.empty(4, 64, 2)
        packed2, scale2 = torch.empty(4, 64, 16, dtype=torch.uint8), torch.empty(4, 64, 1)
        ids = torch.empty(5, 2, dtype=torch.int64)
        out = torch.ops.atomrt.v4_mxfp4_experts(
            x, torch.empty(5, 2), ids, packed13, scale13, packed2, scale2, 0.5
        )
    assert out.shape == (5, 64)


@pytest.mark.gpu
def test_v4_mxfp4_checkpoint_on_the_gpu(folders: tuple[Path, Path]) -> None:
    """The w4a16 fused-MoE kernel and the w8a8 FP8 GEMM in the model (float32) within 1e-3 of
    the float64 reference with its greedy tokens; the engine's greedy tokens with CUDA graphs
    (the kernel captured) equal its eager ones."""
    from atomrt import SamplingParams
    from atomrt.runtime.entrypoints.llm import LLM

    quantized, dequantized = folders
    loaded = load_model(Config(model=str(quantized)), "cuda", torch.float32)
    assert loaded.model.model.layers[2].ffn.w13_packed.is_cuda
    assert loaded.model.model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    result = run_prefill_and_decode(loaded.model, PROMPTS, 8, block_size=4, num_pad_rows=2)
    assert _worst_against(_reference(dequantized, fp8_inputs=True), result) <= 1e-3
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        settings = dict(device="cuda", dtype="float32", block_size=4, enforce_eager=eager)
        with LLM(str(quantized), **settings) as llm:
            outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        tokens[eager] = [o.outputs[0].token_ids for o in outs]
    assert tokens[False] == tokens[True]


@pytest.mark.slow
def test_mxfp4_experts_at_level_3_give_the_eager_tokens(folders: tuple[Path, Path]) -> None:
    """Traced (level 3, Inductor on CPU), the MXFP4 experts are one opaque op: the engine's greedy
    tokens equal its eager ones."""
    from atomrt import SamplingParams
    from atomrt.runtime.entrypoints.llm import LLM

    quantized, _ = folders
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for name, settings in (
        ("eager", {"enforce_eager": True}),
        ("level3", {"compilation_config": 3}),
    ):
        with LLM(str(quantized), device="cpu", block_size=4, **settings) as llm:
            outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        tokens[name] = [o.outputs[0].token_ids for o in outs]
    assert tokens["level3"] == tokens["eager"]


def test_fp8_row_parallel_shards_split_at_whole_blocks(folders: tuple[Path, Path]) -> None:
    """Under tensor parallelism a row-parallel FP8 projection's input features per rank must fill
    whole 128-feature blocks (its activations are quantized per 128 features): the tiny V4's
    `wo_b` (32 features, 16 a rank) is refused by name; at TP=1 every FP8 projection converts."""
    from atomrt.distributed.communication_op import TPInfo
    from atomrt.workers.layers.quantization.v4_fp8 import BlockFp8Linear, keep_fp8_linears
    from atomrt.workers.loading.loader import build_model, read_hf_config
    from atomrt.workers.models.registry import arch_from_hf_config

    quantized, _ = folders
    arch = arch_from_hf_config(read_hf_config(quantized), "here")
    fp8 = Fp8Config(weight_block_size=(128, 128))
    model = build_model(arch, "meta", torch.float32, TPInfo(0, 2))
    with pytest.raises(ValueError, match=r"here: model.layers.0.attn.wo_b's input features per"):
        keep_fp8_linears(model, fp8, "here")
    model = build_model(arch, "meta", torch.float32)
    kept = keep_fp8_linears(model, fp8, "here")
    assert len(kept) == 34
    assert all(isinstance(model.get_submodule(name), BlockFp8Linear) for name in kept)
    assert isinstance(model.model.layers[1].attn.indexer.weights_proj, torch.nn.Linear)


def test_an_fp8_weight_for_a_16_bit_projection_is_widened(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    """A projection V4 ships in 16 bits (a compressor's `wkv`) that a checkpoint quantizes anyway
    is dequantized at load: the layer holds the float32 value of e4m3 times its ue8m0 scale."""
    quantized, _ = folders
    wkv = "model.layers.1.attn.compressor.wkv"
    expected = {}

    def fp8_compressor(tensors: dict, config: dict) -> None:
        q, scale = quantize_fp8_block(tensors[wkv + ".weight"])
        tensors[wkv + ".weight"], tensors[wkv + ".scale"] = q, scale
        expected["w"] = q.float() * torch.exp2(scale.view(torch.uint8).float() - 127)

    folder = _rewrite(quantized, tmp_path / "fp8_compressor", fp8_compressor)
    model = load_model(Config(model=str(folder)), "cpu", torch.float32).model
    held = model.model.layers[1].attn.compressor.wkv.weight
    assert held.dtype == torch.float32 and torch.equal(held, expected["w"])


def _expected_step_bytes(model: torch.nn.Module) -> tuple[tuple, int]:
    """Per V4 MoE layer (experts count, bytes of one) summed from its expert tensors as held, and
    the bytes of every other weight a step reads (the untied embedding table left out)."""
    from atomrt.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding

    routed, expert_bytes = [], 0
    for m in model.modules():
        if not isinstance(m, V4MoE):
            continue
        names = ("w13_packed", "w13_scale", "w2_packed", "w2_scale") if m.mxfp4 else ("w13", "w2")
        tensors = [getattr(m, n) for n in names]
        whole = sum(t.numel() * t.element_size() for t in tensors)
        routed.append((m.num_experts, whole // m.num_experts))
        if not m.mxfp4:  # float experts are parameters, packed ones buffers
            expert_bytes += whole
    heads = {m.weight.data_ptr() for m in model.modules() if isinstance(m, ParallelLMHead)}
    table = sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if type(m) is VocabParallelEmbedding and m.weight.data_ptr() not in heads
    )
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return tuple(routed), params - expert_bytes - table


@pytest.mark.parametrize("held", ["mxfp4", "float"])
def test_step_bytes_count_v4_routed_experts_per_expert(
    folders: tuple[Path, Path], held: str
) -> None:
    """The floor's bytes count V4's routed experts as routed experts, MXFP4 (packed weights and
    e8m0 exponents) and float alike: per MoE layer the bytes of one expert, the rest as weights;
    they reach the driver in the workers' start-up answer, and the experts_touched probe counts
    V4's layers."""
    from atomrt import SamplingParams
    from atomrt.runtime.entrypoints.llm import LLM

    quantized, dequantized = folders
    folder = quantized if held == "mxfp4" else dequantized
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(str(folder), device="cpu", block_size=4, enforce_eager=True) as llm:
        step = llm.engine.info.step_bytes
        model = llm.engine.executor.worker.runner.model
        routed, weights = _expected_step_bytes(model)
        with llm.engine.executor.probe("experts_touched") as counts:
            llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert len(routed) == 4 and step.routed == routed and step.weights == weights  # every layer
    assert all(e == 8 for e, _ in routed)
    if held == "mxfp4":  # [2I, H / 2] e2m1 pairs, [H, I / 2], and an exponent per 32 of each
        assert routed[0][1] == 64 * 32 + 64 * 16 + 64 * 2 + 64 * 1
    touched = counts.mean_touched()
    assert len(touched) == 4 and all(1 <= n <= 8 for n in touched)


def test_step_bytes_reach_the_driver_through_mp(folders: tuple[Path, Path]) -> None:
    """The workers' start-up answer carries the floor's bytes across a process: the mp executor's
    StepBytes are the in-process one's."""
    from atomrt.runtime.entrypoints.llm import LLM

    quantized, _ = folders
    got = {}
    for executor in ("inproc", "mp"):
        settings = {"executor": executor, "worker_timeout_s": 90.0}
        with LLM(str(quantized), device="cpu", block_size=4, enforce_eager=True, **settings) as llm:
            got[executor] = llm.engine.info.step_bytes
    assert got["inproc"] is not None and got["inproc"].routed
    assert got["mp"] == got["inproc"]


def test_a_traced_float_layer_reports_its_routing() -> None:
    """Traced, V4's float experts are one opaque op (`v4_expert_pairs`) that runs the picked
    experts alone and reports its routing to the probe's tally, as the eager layer does."""
    from atomrt.workers.layers import expert_tally

    torch.manual_seed(0)
    eager, traced = (V4MoE(64, 64, 8, 2, 1, "sqrtsoftplus", 1.0, 0.5, False, 16) for _ in "ab")
    for moe in (eager, traced):
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.05)
    traced.load_state_dict(eager.state_dict())
    x, ids = torch.randn(3, 64), torch.tensor([3, 4, 5])
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(traced, backend=backend, fullgraph=True)
    tally = expert_tally.ExpertTally([eager, traced])
    with torch.no_grad(), expert_tally.counting(tally):
        picked = int(torch.unique(eager.gate(x, ids)[0]).numel())
        want = eager(x, ids)
        out = compiled(x, ids)
    assert picked < 8
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("v4_expert_pairs" in t for t in targets), targets
    assert tally.distinct == [[picked], [picked]]
    assert tally.step_counts().tolist() == [[picked, picked]]


@pytest.mark.slow
def test_the_probe_counts_traced_float_v4_experts_as_eager(folders: tuple[Path, Path]) -> None:
    """At level 3 a probed step of float V4 runs its traced experts' op, the picked experts alone:
    the probe counts what an eager step does."""
    from atomrt import SamplingParams
    from atomrt.runtime.entrypoints.llm import LLM

    _, dequantized = folders
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    touched = []
    for level in (0, 3):
        with LLM(str(dequantized), device="cpu", block_size=4, compilation_config=level) as llm:
            with llm.engine.executor.probe("experts_touched") as counts:
                llm.generate([[3, 4, 5, 6]], greedy, use_tqdm=False)
        touched.append(counts.mean_touched())
    assert touched[0] == touched[1] and len(touched[0]) == 4, touched
    assert min(touched[0]) < 8, touched  # not every expert: a decode row picks top_k of 8

"""`atomrt bench throughput` on CPU: a tiny random Llama, atomrt against transformers' generate."""

import json
from pathlib import Path

import pytest
from executor_harness import VOCAB, build_tiny_llama
from records_harness import check_records

from atomrt.runtime.bench.targets import env_variant
from atomrt.runtime.bench.throughput import CHAT_PROMPTS, _parse, build_prompts, main
from atomrt.runtime.entrypoints.cli import build_parser

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_throughput"))


def test_compare_hf_writes_both_figures(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "throughput.json"
    rc = main(
        [
            "--model",
            str(tiny_folder),
            "--device",
            "cpu",
            "--enforce-eager",
            "--set",
            "cache_config.num_kv_blocks=64",
            "--num-prompts",
            "3",
            "--input-len",
            "5",
            "--output-len",
            "6",
            "--compare-hf",
            "--repeat",
            "2",
            "--no-progress",
            "--json",
            str(out),
            "--record",
            str(tmp_path / "records"),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert (report["num_prompts"], report["output_len"], report["prompt_source"]) == (
        3,
        6,
        "synthetic",
    )
    assert report["total_input_tokens"] == 15 and report["total_output_tokens"] == 18
    assert (
        report["device"] == "cpu" and report["dtype"] == "float32" and report["torch_threads"] >= 1
    )
    for name in ("atomrt", "transformers"):
        r = report[name]
        assert r["engine"] == name and len(r["runs_s"]) == 2
        assert r["seconds"] > 0 and r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
        assert 0 < r["best_s"] <= r["seconds"]
        assert r["output_tokens_per_s"] == pytest.approx(18 / r["seconds"], rel=1e-2)
    assert report["ratio"] == pytest.approx(
        report["atomrt"]["output_tokens_per_s"] / report["transformers"]["output_tokens_per_s"],
        rel=1e-2,
    )
    lines = capsys.readouterr().out.splitlines()
    assert any(
        line.startswith("atomrt: 3 prompts x 6 tokens") and "output tokens/s" in line
        for line in lines
    )
    assert any(line.startswith("transformers: 3 prompts x 6 tokens") for line in lines)
    assert any(line.startswith("atomrt / transformers:") for line in lines)
    ((f,),) = [r.figures for r in check_records(tmp_path / "records", "throughput")]
    flags = "--set cache_config.num_kv_blocks=64 --enforce-eager --device cpu"
    case = ", ".join(
        [f"{tiny_folder.name}, 3 synthetic prompts × 6 tokens, float32", flags, *env_variant()]
    )
    assert (f.target, f.case, f.unit) == ("offline-throughput", case, "tokens/s")
    assert (f.value, f.anchor, f.anchor_name) == (
        report["atomrt"]["output_tokens_per_s"],
        report["transformers"]["output_tokens_per_s"],
        "transformers generate",
    )
    assert f.ratio == pytest.approx(report["ratio"], rel=1e-2)


def test_prompt_sources(tiny_folder: Path, tmp_path: Path) -> None:
    from atomrt.runtime.config import Config
    from atomrt.runtime.entrypoints.llm import load_tokenizer_for

    tokenizer = load_tokenizer_for(Config(model=str(tiny_folder)))
    ids, source = build_prompts(
        _parse(["--num-prompts", "4", "--input-len", "7"]), tokenizer, VOCAB
    )
    assert source == "synthetic" and [len(p) for p in ids] == [7] * 4
    assert all(0 <= t < VOCAB for p in ids for t in p)
    assert (
        build_prompts(_parse(["--num-prompts", "4", "--input-len", "7"]), None, VOCAB)[0] == ids
    )  # seeded
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("w3 w4 w5\n\nw6 w7\n")
    ids, source = build_prompts(_parse(["--prompts-file", str(prompts_file)]), tokenizer, VOCAB)
    assert source == "file" and ids == [tokenizer.encode("w3 w4 w5"), tokenizer.encode("w6 w7")]
    ids, _ = build_prompts(
        _parse(["--prompts-file", str(prompts_file), "--num-prompts", "3"]), tokenizer, VOCAB
    )
    assert len(ids) == 3 and ids[2] == ids[0]  # cycled
    assert len(CHAT_PROMPTS) == 12
    with pytest.raises(ValueError, match="tokenizer"):
        build_prompts(_parse(["--prompts-file", str(prompts_file)]), None, VOCAB)


def test_compare_hf_needs_real_weights(capsys: pytest.CaptureFixture) -> None:
    rc = main(
        [
            "--model",
            "SmolLM2-135M",
            "--load-format",
            "dummy",
            "--device",
            "cpu",
            "--enforce-eager",
            "--set",
            "cache_config.num_kv_blocks=64",
            "--output-len",
            "2",
            "--num-prompts",
            "1",
            "--input-len",
            "4",
            "--compare-hf",
            "--no-progress",
            "--no-warmup",
        ]
    )
    assert rc == 2 and "real weights" in capsys.readouterr().err


def test_cli_wires_the_subcommand() -> None:
    args, rest = build_parser().parse_known_args(["bench", "throughput", "--output-len", "3"])
    assert (args.command, args.what, rest) == ("bench", "throughput", ["--output-len", "3"])

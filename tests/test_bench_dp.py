"""`atomrt bench dp` on CPU: the tiny MoE preset (dummy weights), DP=1 against DP=2 through mp
(and through Ray in the slow run), JSON and PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from records_harness import check_records

from atomrt.runtime.bench.dp import Layout, _parse, main, make_requests
from atomrt.runtime.bench.targets import env_variant
from atomrt.runtime.entrypoints.cli import build_parser

SMALL = [
    "--device",
    "cpu",
    "--enforce-eager",
    "--set",
    "cache_config.num_kv_blocks=32",
    "--num-requests",
    "6",
    "--input-len",
    "12",
    "--output-len",
    "6",
    "--imbalance",
    "0.5",
    "--no-progress",
]


def _run(tmp_path: Path, *extra: str) -> dict:
    out, plot = tmp_path / "dp.json", tmp_path / "dp.png"
    record = ["--record", str(tmp_path / "records")]
    assert main([*SMALL, *extra, "--json", str(out), "--plot", str(plot), *record]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(out.read_text())


def test_dp2_reports_throughput_and_padding(tmp_path: Path, capsys) -> None:
    report = _run(tmp_path, "--layouts", "2x1", "--dp-prefill-align", "1")
    (two,) = report["results"]
    assert (two["dp"], two["tp"], two["executor"], two["speedup"]) == (2, 1, "mp", 1.0)
    assert report["model"] == "tiny-qwen3-moe" and report["dp_prefill_align"] == 1
    # 3 full requests of 6 tokens, 3 halved ones of 3
    assert report["num_requests"] == [6] and two["num_requests"] == 6
    assert two["output_tokens"] == 27
    assert two["output_tokens_per_s"] > 0 and two["steps"] > 0
    # rank 1's requests are shorter: it idles (dummy batches) while rank 0 finishes
    assert two["dummy_batches"] > 0 and two["padded_tokens"] > 0
    assert 0 < two["pad_fraction"] < 1
    # every request's prompt and output rows, less the last output token (never computed)
    assert two["real_tokens"] == 3 * (12 + 5) + 3 * (6 + 2)
    assert "DP=2 TP=1 (mp" in capsys.readouterr().out
    ((f,),) = [r.figures for r in check_records(tmp_path / "records", "dp")]
    flags = "--set cache_config.num_kv_blocks=32 --enforce-eager --load-format dummy --device cpu"
    case = ", ".join(
        ["tiny-qwen3-moe DP=2 TP=1, mp, tbo=none, 6 requests", "dp_prefill_align 1", flags]
    )
    assert (f.target, f.case) == ("data-parallel", ", ".join([case, *env_variant()]))
    assert (f.value, f.anchor, f.extra["padded"].value) == (
        two["output_tokens_per_s"],
        None,  # the first layout is its own baseline
        round(100 * two["pad_fraction"], 1),
    )


@pytest.mark.slow
def test_dp1_against_dp2(tmp_path: Path) -> None:
    report = _run(tmp_path, "--layouts", "1x1,2x1")
    one, two = report["results"]
    assert (one["dp"], one["executor"], two["dp"], two["executor"]) == (1, "mp", 2, "mp")
    assert one["cpu_threads_per_rank"] >= two["cpu_threads_per_rank"] >= 1
    assert one["padded_tokens"] == one["dummy_batches"] == 0 and one["speedup"] == 1.0
    assert two["real_tokens"] == one["real_tokens"] and two["padded_tokens"] > 0
    assert two["speedup"] == round(two["output_tokens_per_s"] / one["output_tokens_per_s"], 3)


@pytest.mark.slow
def test_through_the_ray_executor(tmp_path: Path) -> None:
    report = _run(tmp_path, "--layouts", "2x1,2x2", "--executor", "ray")
    assert [(r["dp"], r["tp"], r["executor"]) for r in report["results"]] == [
        (2, 1, "ray"),
        (2, 2, "ray"),
    ]


def test_requests_and_flags() -> None:
    args = _parse(["--num-requests", "4", "--input-len", "10", "--output-len", "8"])
    assert args.model == "tiny-qwen3-moe" and args.load_format == "dummy"
    requests = make_requests(args, vocab_size=100, num_requests=args.num_requests[0])
    assert [(len(r.prompt), r.max_tokens) for r in requests] == [(10, 8), (5, 4)] * 2
    assert Layout.parse("2x2") == Layout(2, 2)
    args = _parse(["--num-requests", "8,64", "--enable-tbo", "none,auto"])
    assert args.num_requests == [8, 64] and args.tbo_modes == ["none", "auto"]
    assert args.enable_tbo is None  # the list is the bench's; each engine gets one mode
    with pytest.raises(SystemExit):
        _parse(["--enable-tbo", "none,sometimes"])
    with pytest.raises(ValueError, match="DPxTP"):
        Layout.parse("2")
    with pytest.raises(SystemExit):
        _parse(["--imbalance", "1.0"])
    assert build_parser().parse_known_args(["bench", "dp", "--layouts", "1x1"])[0].what == "dp"


def test_tbo_auto_reports_its_measurements(tmp_path: Path, capsys) -> None:
    """`--enable-tbo auto` at DP=2 (mp): the start-up measurement of every capture size that
    splits, the slowest rank's, is in the report and the printed line, beside the steps split and
    the decode steps' milliseconds by batch size."""
    report = _run(
        tmp_path,
        "--layouts",
        "2x1",
        "--enable-tbo",
        "auto",
        "--set",
        "compilation_config.cudagraph_capture_sizes=[2,4,8]",
    )
    (auto,) = report["results"]
    assert report["enable_tbo"] == ["auto"] and auto["enable_tbo"] == "auto"
    assert [v["running_bs"] for v in auto["tbo_auto"]] == [4, 8]
    for v in auto["tbo_auto"]:
        assert v["unsplit_ms"] > 0 and v["split_ms"] > 0
        assert v["splits"] == (v["split_ms"] < v["unsplit_ms"])
    assert auto["decode_ms_by_bs"] and all(t > 0 for t in auto["decode_ms_by_bs"].values())
    assert auto["tbo_speedup"] == 1.0 and auto["split_steps"] >= 0
    out = capsys.readouterr().out
    assert "tbo=auto" in out and "auto bucket 4: " in out and "decode ms/step by batch" in out


@pytest.mark.slow
def test_tbo_ab_every_mode_and_batch_size(tmp_path: Path) -> None:
    modes = ["none", "prefill", "all", "auto"]
    report = _run(
        tmp_path, "--layouts", "2x1", "--enable-tbo", ",".join(modes), "--num-requests", "4,8"
    )
    results = report["results"]
    assert [(r["num_requests"], r["enable_tbo"]) for r in results] == [
        (n, m) for n in (4, 8) for m in modes
    ]
    for r in results:
        base = next(b for b in results if b["num_requests"] == r["num_requests"])
        assert r["tbo_speedup"] == round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
        if r["enable_tbo"] == "none":
            assert r["split_steps"] == 0
        elif r["enable_tbo"] != "auto":
            assert r["split_steps"] > 0


@pytest.mark.slow
def test_two_simulated_nodes_take_a_rank_each(tmp_path: Path) -> None:
    """`atomrt bench dp --executor ray` joined to a two-node cluster (ray.cluster_utils, one CPU
    per node): the two DP ranks run on different nodes, over tcp, and the run finishes."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, logging_level="WARNING")
        report = _run(tmp_path, "--layouts", "2x1", "--executor", "ray")
        (two,) = report["results"]
        assert (two["dp"], two["executor"], two["num_nodes"]) == (2, "ray", 2)
        assert two["output_tokens"] == 27 and two["steps"] > 0
    finally:
        ray.shutdown()
        cluster.shutdown()

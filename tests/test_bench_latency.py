"""`atomrt bench latency` on CPU: a tiny random Llama, two batch sizes, eager plus a graph mode that falls back."""

import json
from pathlib import Path

import pytest
import torch
from executor_harness import build_tiny_llama
from records_harness import check_records

from atomrt.runtime.bench.latency import (
    Report,
    Row,
    _parse,
    check_targets,
    compare_executors,
    main,
    mode_settings,
)
from atomrt.runtime.bench.records import RATIO_TOLERANCE
from atomrt.runtime.bench.spec_decode import SpecRow, compare_tokens, prompts_for
from atomrt.runtime.bench.spec_figures import step_costs
from atomrt.runtime.bench.targets import env_variant
from atomrt.runtime.config import ConfigError, CUDAGraphMode


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_bench"))


def test_cpu_smoke_writes_rows_and_json(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "latency.json"
    rc = main(
        [
            "--model",
            str(tiny_folder),
            "--batch-sizes",
            "1,2",
            "--decode-steps",
            "3",
            "--warmup-steps",
            "1",
            "--input-len",
            "8",
            "--modes",
            "eager,FULL+async",
            "--device",
            "cpu",
            "--json",
            str(out),
            "--max-num-batched-tokens",
            "8",  # bs=2 prefills in two chunks: the first request runs ahead
            "--record",
            str(tmp_path / "records"),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["errors"] == [] and report["copy_gbps"] > 0
    assert report["weight_bytes"][str(tiny_folder)] > 0
    assert any("graph modes run eagerly" in n for n in report["notes"])
    rows = report["rows"]
    assert [(r["mode"], r["batch_size"]) for r in rows] == [
        ("eager", 1),
        ("eager", 2),
        ("FULL+async", 1),
        ("FULL+async", 2),
    ]
    for r in rows:
        assert r["forward_kind"] == "eager"
        assert 0 < r["ms_median"] <= r["ms_p90"]
        assert r["tokens_per_s"] == pytest.approx(r["batch_size"] / r["ms_median"] * 1e3, rel=1e-2)
        assert r["floor_ms"] > 0 and r["ratio_to_floor"] > 0
    # the floor counts each sequence's KV cache (and input embedding row): bs=2 reads more. The
    # rows' floors are rounded to 0.1 us (a fast copy makes the tiny model's bs=1 and 2 alike
    # there), so each is checked against the step's bytes, which the report keeps
    sb = report["step_bytes"][str(tiny_folder)]
    assert sb["kv_per_token"] > 0 and sb["weights"] > 0
    ctx = 8 + 1 + 3 // 2  # input, warm-up and half the decode steps
    for r in rows:
        bs = r["batch_size"]
        nbytes = sb["weights"] + bs * (sb["row"] + ctx * sb["kv_per_token"])
        assert r["floor_ms"] == pytest.approx(nbytes / report["copy_gbps"] / 1e6, abs=6e-5)
    lines = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith(str(tiny_folder))
    ]
    assert len(lines) == 4  # one printed line per (model, mode, bs)
    # the record: one decode-step figure per row, no verdict on CPU (the targets are a GPU's)
    (record,) = check_records(tmp_path / "records", "latency")
    assert "atomrt bench latency --model " in record.command and "--record" in record.command
    variant = ", ".join(["level 0, 8-token prompts, --max-num-batched-tokens 8", *env_variant()])
    assert [(f.target, f.case) for f in record.figures] == [
        ("decode-step", f"{tiny_folder.name} bs={bs} {mode}, {variant}")
        for mode in ("eager", "FULL+async")
        for bs in (1, 2)
    ]
    for f, r in zip(record.figures, rows):
        assert (f.value, f.unit, f.anchor, f.extra["p90"].value) == (
            r["ms_median"],
            "ms",
            r["floor_ms"],
            r["ms_p90"],
        )
        # the record's ratio is of its rounded figures; the row's of the unrounded ones
        assert f.ratio == pytest.approx(f.value / f.anchor, rel=1e-3) and f.threshold is None
        assert f.ratio == pytest.approx(r["ratio_to_floor"], rel=RATIO_TOLERANCE)
    assert record.machine.kind.endswith("-core CPU") and record.machine.gpu_count == 0
    assert any("graph modes run eagerly" in n for n in record.notes)


def test_mode_settings() -> None:
    assert mode_settings("eager", 3, on_cuda=True) == {
        "enforce_eager": True,
        "async_scheduling": False,
    }
    assert mode_settings("FULL", 3, on_cuda=False) == {
        "enforce_eager": True,
        "async_scheduling": False,
    }
    assert mode_settings("TR_HYBRID", 3, on_cuda=True) == {
        "level": 3,
        "cudagraph_mode": CUDAGraphMode.TR_HYBRID,
        "async_scheduling": False,
    }
    assert mode_settings("FULL+async", 3, on_cuda=True) == {
        "level": 3,
        "cudagraph_mode": CUDAGraphMode.FULL,
        "async_scheduling": True,
    }
    assert mode_settings("eager+async", 0, on_cuda=True) == {
        "enforce_eager": True,
        "async_scheduling": True,
    }


def test_targets_judge_graph_steps_only() -> None:
    """The decode-step targets are about graph replays: a row whose steps ran eagerly gets no
    verdict; a graph row of a target's (model, batch size) gets PASS or FAIL."""
    report = Report("H200", torch.__version__, 4000.0, {})
    for mode, kind, ms in (("eager", "eager", 13.9), ("FULL+async", "req_graph", 0.45)):
        report.rows.append(
            Row(
                "SmolLM2-135M",
                mode,
                "inproc",
                1,
                kind,
                ms,
                ms,
                1e3 / ms,
                0.06,
                ms / 0.06,
                0,
                0,
                None,
            )
        )
    assert check_targets(report) == [
        "target SmolLM2-135M FULL+async bs=1: 0.450 ms <= 0.5 ms: PASS"
    ]


def test_compare_executors_slowdown() -> None:
    report = Report("cpu", torch.__version__, 1.0, {})
    for executor, ms in (("inproc", 2.0), ("ray", 2.1)):
        report.rows.append(
            Row(
                "m",
                "FULL",
                executor,
                1,
                "req_graph",
                ms,
                ms,
                1e3 / ms,
                None,
                None,
                0.0,
                0.0,
                None,
            )
        )
    (c,) = compare_executors(report)
    assert (c["inproc_ms"], c["ray_ms"]) == (2.0, 2.1) and c["slowdown_pct"] == pytest.approx(5.0)


def test_transport_spin_us_flag_takes_auto_or_microseconds() -> None:
    assert _parse([]).transport_spin_us is None  # the config's default ("auto") applies
    assert _parse(["--transport-spin-us", "auto"]).transport_spin_us == "auto"
    assert _parse(["--transport-spin-us", "0"]).transport_spin_us == 0.0
    assert _parse(["--transport-spin-us", "2000"]).transport_spin_us == 2000.0
    with pytest.raises(SystemExit):  # argparse: not auto, not a number
        _parse(["--transport-spin-us", "fast"])
    with pytest.raises(ConfigError, match=r"parallel_config\.transport_spin_us"):
        _parse(["--transport-spin-us", "2e6"])


SPEC_NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'


def test_speculative_config_compares_decode_with_and_without(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--speculative-config: each workload without and with n-gram speculation; tokens/s, the
    speedup and the acceptance figures per row; a bad config is refused before any model loads."""
    model = tiny_folder
    out = tmp_path / "spec.json"
    argv = ["--model", str(model), "--device", "cpu", "--modes", "eager", "--batch-sizes", "2"]
    argv += ["--input-len", "16", "--decode-steps", "8", "--warmup-steps", "1"]
    records = tmp_path / "records"
    rc = main(
        argv + ["--speculative-config", SPEC_NGRAM, "--json", str(out), "--record", str(records)]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["errors"] == [] and report["speculative_config"]["method"] == "ngram"
    rows = report["rows"]
    assert [(r["workload"], r["speculative"]) for r in rows] == [  # interleaved on CPU
        ("repetitive", "off"),
        ("repetitive", "ngram k=3"),
        ("random", "off"),
        ("random", "ngram k=3"),
    ]
    for r in rows:
        assert r["decode_tokens"] == 2 * 7 and r["tokens_per_s"] > 0
    for r in rows[1::2]:
        assert r["speedup"] > 0 and r["drafted_tokens"] >= r["accepted_tokens"]
        if r["drafted_tokens"]:
            assert r["mean_acceptance_length"] >= 1 and len(r["acceptance_per_position"]) == 3
        assert r["same_tokens"] == 2 and r["first_difference"] is None  # greedy: no change
        assert "tokens" not in r
        assert r["policy"] is None  # synchronous steps always speculate: no adaptive policy
    printed = capsys.readouterr().out
    assert "accept_len" in printed and "ngram k=3" in printed
    # the record: a figure per row that speculated, against the same workload without
    (record,) = check_records(records, "latency")
    variant = ", ".join(["16-token prompts", *env_variant(), "8 tokens"])  # eager: no level
    assert [f.case for f in record.figures] == [
        f"{model.name} eager bs=2 {w}, ngram k=3, {variant}" for w in ("repetitive", "random")
    ]
    for f, on, off in zip(record.figures, rows[1::2], rows[0::2]):
        assert (f.target, f.value, f.anchor) == (
            "speculative-decoding",
            on["tokens_per_s"],
            off["tokens_per_s"],
        )
        assert f.ratio == pytest.approx(on["speedup"], rel=1e-2) and f.threshold is None
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        main(argv + ["--speculative-config", '{"method": "ngram"}', "--json", str(out)])


def test_a_refilled_run_keeps_the_batch_full_and_times_every_token(
    tiny_folder: Path, tmp_path: Path
) -> None:
    """--num-requests: 5 requests with 2 in flight, their lengths spread around --decode-steps;
    every output token counts, and speculation changes none of them."""
    from atomrt.runtime.bench.spec_decode import refill_lengths

    out = tmp_path / "refill.json"
    argv = ["--model", str(tiny_folder), "--device", "cpu", "--modes", "eager"]
    argv += ["--batch-sizes", "2", "--input-len", "16", "--decode-steps", "6"]
    argv += ["--warmup-steps", "1", "--num-requests", "5", "--json", str(out)]
    assert main(argv + ["--speculative-config", SPEC_NGRAM]) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == [] and len(report["rows"]) == 4
    lengths = refill_lengths(5, 6, seed=2)
    assert min(lengths) >= 3 and max(lengths) <= 9
    for r in report["rows"]:
        assert r["num_requests"] == 5 and r["batch_size"] == 2
        assert r["decode_tokens"] == sum(lengths) and r["tokens_per_s"] > 0
        assert 0 < r["engine_steps"] <= sum(lengths)  # two in flight: no step idles
    for r in report["rows"][0::2]:  # without speculation a request makes a token a step
        assert max(lengths) <= r["engine_steps"]
    for r in report["rows"][1::2]:
        assert r["same_tokens"] == 5 and r["first_difference"] is None
    with pytest.raises(SystemExit):  # without --speculative-config it means nothing
        main(argv)


def test_an_mtp_run_reports_the_step_costs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--speculative-config with MTP on the tiny DeepSeek-V3 preset's dummy weights (its MTP layer
    included): acceptance means nothing there, so each speculative row says what its step, its
    draft passes and the verify step cost against the plain step of the same workload."""
    out = tmp_path / "mtp.json"
    argv = ["--model", "tiny-deepseek-v3", "--load-format", "dummy", "--device", "cpu"]
    argv += ["--modes", "eager", "--batch-sizes", "2", "--input-len", "8", "--decode-steps", "6"]
    argv += ["--warmup-steps", "1", "--json", str(out)]
    spec = '{"method": "mtp", "num_speculative_tokens": 1}'
    assert main(argv + ["--speculative-config", spec]) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == []
    off, on = report["rows"][0:2]
    assert off["ms_per_step"] > 0 and off["draft_ms_per_step"] is None
    assert on["speculative"] == "mtp k=1" and on["same_tokens"] == 2
    assert 0 < on["draft_ms_per_step"] < on["ms_per_step"] and on["drafted_tokens"] > 0
    printed = [line for line in capsys.readouterr().out.splitlines() if "step costs:" in line]
    assert len(printed) == 2  # one under each speculative row
    costs = step_costs(SpecRow(**on), SpecRow(**off))
    assert costs["draft_ms"] == on["draft_ms_per_step"]
    assert costs["verify_ms"] == pytest.approx(
        on["ms_per_step"] - on["draft_ms_per_step"], abs=1e-3
    )
    assert costs["break_even_tokens"] == pytest.approx(
        on["ms_per_step"] / off["ms_per_step"], rel=1e-2
    )


def test_compare_tokens_names_the_first_difference() -> None:
    row = SpecRow("m", "eager", 2, "random", "ngram k=3", 0, 1.0, 0.0, 0, None, None, 0, 0, 0)
    row.tokens = [[1, 2, 3], [4, 5, 6]]
    compare_tokens(row, [[1, 2, 3], [4, 9, 6]])
    assert row.same_tokens == 1 and row.first_difference == "request 1, token 1: 5 != 9"
    row.tokens = [[1, 2], [4, 5, 6]]
    compare_tokens(row, [[1, 2, 3], [4, 5, 6]])
    assert row.same_tokens == 1 and row.first_difference == "request 0, token 2: end != 3"


def test_speculative_workloads():
    rep = prompts_for("repetitive", 2, 20, 100, seed=0)
    assert all(len(p) == 20 for p in rep)
    assert all(any(p[i:] == p[: len(p) - i] for i in range(3, 9)) for p in rep)  # periodic
    rnd = prompts_for("random", 3, 20, 100, seed=0)
    assert len(rnd) == 3 and all(0 <= t < 100 for p in rnd for t in p)
    assert all(len(set(p)) > 8 for p in rnd)


def test_step_bytes_read_an_untied_embedding_by_its_rows() -> None:
    """The floor's bytes: the weights a step reads, then per sequence one embedding row and its
    context's KV; an untied input embedding counts only by the rows looked up."""
    import torch.nn as nn

    from atomrt.runtime.bench.step_bytes import StepBytes
    from atomrt.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding
    from atomrt.workers.step_bytes import runner_step_bytes

    class Model(nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.embed = VocabParallelEmbedding(100, 8)
            self.proj = nn.Linear(8, 8, bias=False)
            self.lm_head = ParallelLMHead(100, 8)
            if tied:
                self.lm_head.weight = self.embed.weight

    class Runner:
        shape = type("Shape", (), {"block_size": 4})()
        dtype = torch.float32

        def __init__(self, model: nn.Module) -> None:
            self.model = model

        def kv_bytes_per_block(self) -> int:
            return 4 * 64

        def kv_layer_specs(self) -> list:
            return []

    def step_bytes(tied: bool) -> StepBytes:
        return runner_step_bytes(Runner(Model(tied)))

    untied, tied = step_bytes(False), step_bytes(True)
    f32 = 4
    assert untied == StepBytes((64 + 800) * f32, 8 * f32, 64)  # the LM head is read whole
    assert tied == StepBytes((800 + 64) * f32, 0, 64)  # the one table is the LM head's
    assert untied.of(bs=2, ctx=10) == (64 + 800) * f32 + 2 * 8 * f32 + 2 * 10 * 64


def test_a_failed_model_prints_where_it_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A model that fails to start is an error line on stderr with its traceback (the frames say
    where) and the run's exit status 1."""
    missing = tmp_path / "no-such-model"
    argv = ["--model", str(missing), "--batch-sizes", "1", "--device", "cpu", "--modes", "eager"]
    rc = main(argv + ["--json", str(tmp_path / "latency.json")])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"ERROR {missing} eager inproc: " in err
    assert "Traceback (most recent call last):" in err

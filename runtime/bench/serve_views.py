"""Views of a serving run beside the bench client's (runtime/bench/serve.py): the offline
engine on the same prompts at the same concurrency (`--compare-offline`), the server's own
/metrics read before and after the run (mean TTFT from arrival in the API process, time queued,
engine steps), a run's printed line, and the latency/throughput plot (`--plot`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import httpx
from tqdm import tqdm

from atomrt.runtime.bench import structured
from atomrt.runtime.entrypoints.config_args import add_config_args, config_from_args

if TYPE_CHECKING:
    from atomrt.runtime.bench.serve import Request, RunResult


def offline_tokens_per_s(
    engine_argv: list[str],
    requests: Sequence[Request],
    concurrencies: list[Optional[int]],
    progress: bool,
) -> dict[Optional[int], tuple[float, int]]:
    """Output tokens/s of the offline engine (same flags, after a warm-up) on the same prompts, and
    the steps it took, per concurrency: at most that many requests in flight, a finished one
    replaced by the next, as the server's clients do (None: all at once)."""
    from atomrt.runtime.entrypoints.llm import LLM
    from atomrt.runtime.sampling_params import SamplingParams

    engine_args = argparse.ArgumentParser()
    add_config_args(engine_args)
    llm = LLM(config=config_from_args(engine_args.parse_args(engine_argv)))
    out: dict[Optional[int], tuple[float, int]] = {}
    try:
        warm = SamplingParams(temperature=0, ignore_eos=True, max_tokens=2)
        llm.generate([r.prompt for r in requests[:8]], warm, use_tqdm=False)
        for concurrency in dict.fromkeys(concurrencies):
            out[concurrency] = _closed_loop(llm.engine, requests, concurrency, progress)
    finally:
        llm.shutdown()
    return out


def _closed_loop(
    engine: Any, requests: Sequence[Request], concurrency: Optional[int], progress: bool
) -> tuple[float, int]:
    from atomrt.runtime.sampling_params import SamplingParams

    pending = list(requests)
    in_flight = tokens = 0
    steps = sum(engine.stats.steps.values())  # the counter the server's /metrics reports
    bar = tqdm(total=len(requests), desc=f"offline c={concurrency}", disable=not progress)
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and (concurrency is None or in_flight < concurrency):
            r = pending.pop(0)
            engine.add_request(
                r.prompt, SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.output_len)
            )
            in_flight += 1
        for o in engine.step():
            if o.finished:
                in_flight -= 1
                tokens += len(o.outputs[0].token_ids)
                bar.update(1)
    seconds = time.perf_counter() - start
    bar.close()
    return tokens / seconds, sum(engine.stats.steps.values()) - steps


_SCRAPED = (
    "atomrt:time_to_first_token_seconds_sum",
    "atomrt:time_to_first_token_seconds_count",
    "atomrt:request_queue_time_seconds_sum",
    "atomrt:request_queue_time_seconds_count",
    "atomrt:steps_total",
    "process_cpu_seconds_total",  # the API process's
)


def scrape(client: httpx.Client) -> Optional[dict[str, float]]:
    """The server's running totals that the bench reads its side of a run from (summed over
    labels), or None when /metrics is not there or not atomrt's."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = client.get("/metrics")
        if r.status_code != 200:
            return None
        totals = dict.fromkeys(_SCRAPED, 0.0)
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
    except (httpx.HTTPError, ValueError):
        return None
    return totals if totals["atomrt:time_to_first_token_seconds_count"] else None


def add_server_view(r: RunResult, before: Optional[dict], after: Optional[dict]) -> None:
    if before is None or after is None:
        return
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    firsts = d["atomrt:time_to_first_token_seconds_count"]
    queued = d["atomrt:request_queue_time_seconds_count"]
    if firsts > 0:
        r.server_ttft_ms_mean = round(
            1000 * d["atomrt:time_to_first_token_seconds_sum"] / firsts, 3
        )
    if queued > 0:
        r.server_queue_ms_mean = round(
            1000 * d["atomrt:request_queue_time_seconds_sum"] / queued, 3
        )
    r.server_steps = int(d["atomrt:steps_total"])
    cpu = d["process_cpu_seconds_total"]
    if cpu > 0 and r.output_tokens:
        r.api_cpu_us_per_token = round(1e6 * cpu / r.output_tokens, 2)
        r.api_cpu_us_per_chunk = round(1e6 * cpu / max(1, r.chunks), 2)
        r.api_cpu_busy = round(cpu / r.seconds, 3)


def line(r: RunResult) -> str:
    """A run's figures, as the bench prints them."""
    load = f"c={r.concurrency}" if r.concurrency is not None else f"rate={r.request_rate}"
    text = (
        f"{load:>10} {r.requests_per_s:8.2f} req/s {r.output_tokens_per_s:10.1f} tok/s  "
        f"TTFT p50/p90/p99 {r.ttft_ms['p50']:.1f}/{r.ttft_ms['p90']:.1f}/{r.ttft_ms['p99']:.1f} ms  "
        f"TPOT {r.tpot_ms['p50']:.2f}/{r.tpot_ms['p90']:.2f}/{r.tpot_ms['p99']:.2f} ms  "
        f"ITL {r.itl_ms['p50']:.2f}/{r.itl_ms['p90']:.2f}/{r.itl_ms['p99']:.2f} ms"
    )
    if r.failed:
        text += f"  ({r.failed} failed)"
    if r.server_ttft_ms_mean is not None:
        queued = "-" if r.server_queue_ms_mean is None else f"{r.server_queue_ms_mean:.1f}"
        text += (
            f"\n{'':>10} server: TTFT mean {r.server_ttft_ms_mean:.1f} ms, queued {queued} ms; "
            f"{r.server_steps} engine steps"
        )
    if r.api_cpu_us_per_token is not None:
        text += (
            f"\n{'':>10} API process CPU: {r.api_cpu_us_per_token:.1f} us/token, "
            f"{r.api_cpu_us_per_chunk:.1f} us/chunk ({r.chunks} chunks), "
            f"{r.api_cpu_busy:.2f} of a core"
        )
    if r.server_vs_offline is not None:
        text += f"  server/offline {r.server_vs_offline:.3f} (offline {r.offline_steps} steps)"
    v = r.structured
    if v is not None:
        text += f"\n{'':>10} {structured.describe(v)}"
    return text


def _constrained(requests: list[Request], schema: dict, share: float, seed: int) -> list[Request]:
    """The requests, `share` of them constrained to `schema` (the same ones in every run)."""
    chosen = structured.structured_mask(len(requests), share, seed)
    return [
        Request(r.prompt, r.output_len, schema if c else None) for r, c in zip(requests, chosen)
    ]


def plot(results: list[RunResult], path: str) -> None:
    """Latency against throughput, one point per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r.output_tokens_per_s for r in results]
    for key, label in (("tpot_ms", "TPOT p50"), ("ttft_ms", "TTFT p50"), ("itl_ms", "ITL p99")):
        q = "p99" if key == "itl_ms" else "p50"
        ax.plot(x, [getattr(r, key)[q] for r in results], marker="o", label=label)
    for r, xi in zip(results, x):
        tag = f"c={r.concurrency}" if r.concurrency is not None else f"{r.request_rate}/s"
        ax.annotate(tag, (xi, r.tpot_ms["p50"]), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title("atomrt serve: latency against throughput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)

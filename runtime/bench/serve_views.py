"""Two views of a serving run beside the bench client's (runtime/bench/serve.py): the offline
engine on the same prompts at the same concurrency (`--compare-offline`), and the server's own
/metrics read before and after the run (mean TTFT from arrival in the API process, time queued,
engine steps).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import httpx
from tqdm import tqdm

from atomrt.runtime.entrypoints.config_args import _add_config_args, config_from_args

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
    _add_config_args(engine_args)
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

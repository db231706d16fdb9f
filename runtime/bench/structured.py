"""Structured outputs in `atomrt bench serve` (vLLM's structured-output serving benchmark's shape):

    atomrt bench serve ... --structured-output-ratio 0,1 --json-schema FILE [--compile-stall]

Each run is repeated at each ratio R: a share R of its requests (the same ones at every
concurrency, picked with --seed) asks for output that follows the schema (vLLM's
`structured_outputs: {"json": schema}`); the rest run as without it. First a length probe runs
every request constrained (greedy, at the first load; its grammar wait is the "first" one): from
then on each request makes the tokens it made there, constrained or not, so runs of any ratio
differ by the grammar alone. A constrained request's max_tokens is twice its length (the
grammar's end stops it), the plain ones run to it with EOS ignored. Per run: output tokens/s (its
ratio to the ratio-0 run of the same load is the cost of structure), the share of the structured
outputs that parse and validate against the schema, and the server's own figures over the run:
how long a request waited for its grammar when it was compiled for it (the first) and when it
was found compiled (the rest), and the driver's µs per mask row filled.

`--compile-stall` then measures what compiling costs the requests already running: `--concurrency`
(the first) plain streams decode while 8 requests with fresh, complex schemas arrive; the
streams' time between tokens while those compile, over the same streams' time between tokens
just before (the structured requests join the batch only once compiled: the window closes before
the first of them is served).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from atomrt.runtime.bench.sse_client import SSEClient

STALL_SCHEMAS = 8  # fresh schemas compiling at once in --compile-stall
STALL_BASELINE_S = 3.0  # the window of plain decoding before them
_SCRAPED = (
    "atomrt:grammar_requests_total",
    "atomrt:grammar_wait_seconds_total",
    "atomrt:grammar_mask_rows_total",
    "atomrt:grammar_mask_fill_seconds_total",
)


@dataclass
class StructuredView:
    """One run's structured figures (`RunResult.structured`)."""

    ratio: float
    num_structured: int
    num_valid: int  # of them, parsed and validated against the schema
    num_cut: int = 0  # of the others, those that ended at max_tokens (finish_reason "length")
    first_invalid: str = ""  # the first other one's error and text, shortened
    compile_first_ms: Optional[float] = None  # mean wait for a grammar compiled for the request
    compile_cached_ms: Optional[float] = None  # mean wait for one found compiled
    mask_fill_us_per_row: Optional[float] = None

    @property
    def valid_share(self) -> Optional[float]:
        return self.num_valid / self.num_structured if self.num_structured else None


def describe(v: StructuredView) -> str:
    """One line of a run's structured figures."""

    def ms(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.1f} ms"

    fill = "-" if v.mask_fill_us_per_row is None else f"{v.mask_fill_us_per_row:.1f}"
    cut = f" ({v.num_cut} cut at max_tokens)" if v.num_cut else ""
    invalid = f"; first invalid: {v.first_invalid}" if v.first_invalid else ""
    return (
        f"structured {v.ratio:g}: {v.num_valid}/{v.num_structured} valid{cut}; grammar wait "
        f"first {ms(v.compile_first_ms)}, cached {ms(v.compile_cached_ms)}; mask fill {fill} "
        f"us/row{invalid}"
    )


def load_schema(path: str) -> dict[str, Any]:
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--json-schema {path}: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: not a JSON object")
    return schema


def ratios(text: Optional[str]) -> list[Optional[float]]:
    """--structured-output-ratio: a comma list in [0, 1] (None: no structured runs)."""
    if text is None:
        return [None]
    values = [float(x) for x in text.split(",") if x.strip()]
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise ValueError(
            f"--structured-output-ratio: a comma list of shares in [0, 1], got {text!r}"
        )
    return values


def constrain(requests: list[Any], schema: dict[str, Any], share: float, seed: int) -> list[Any]:
    """The requests (serve.py's `Request`), `share` of them constrained to `schema`: round(share *
    len) of them, spread by `seed`, the same ones in every run."""
    chosen = set(random.Random(seed).sample(range(len(requests)), round(share * len(requests))))
    return [
        dataclasses.replace(r, schema=schema if i in chosen else None)
        for i, r in enumerate(requests)
    ]


def matched(requests: list[Any], probe: list[Any]) -> list[Any]:
    """The requests, each to make the tokens it made constrained in the length probe (`probe`: its
    outcomes, every request constrained, greedy): a run's plain requests then make what the same
    requests make constrained, so that runs of any ratio differ by the grammar alone, not by
    their outputs' lengths (nor by plain requests all ending in the same step)."""
    return [
        dataclasses.replace(
            r, output_len=o.output_tokens if o.ok and o.output_tokens else r.output_len
        )
        for r, o in zip(requests, probe)
    ]


def validate(schema: dict[str, Any], outputs: list[tuple[str, str]]) -> tuple[int, int, str]:
    """Of `outputs` ((text, finish_reason) each): how many parse as JSON and validate against
    `schema`; how many of the others ended at max_tokens ("length": a grammar cannot close in
    time what the request cut short); and the first remaining one's error and text, shortened
    ("": none, every failure was a cut)."""
    import jsonschema

    ok = cut = 0
    first = ""
    for text, finish_reason in outputs:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            if finish_reason == "length":
                cut += 1
            elif not first:
                reason = e.message if isinstance(e, jsonschema.ValidationError) else str(e)
                first = f"{reason[:120]} in {text[:160]!r}"
            continue
        ok += 1
    return ok, cut, first


def view(
    ratio: float,
    schema: dict[str, Any],
    outputs: list[tuple[str, str]],  # (text, finish_reason) of each constrained request
    before: Optional[dict[str, dict[str, float]]],
    after: Optional[dict[str, dict[str, float]]],
) -> StructuredView:
    v = StructuredView(ratio, len(outputs), *validate(schema, outputs))
    if before is None or after is None:
        return v

    def delta(name: str, label: str = "") -> float:
        return after.get(name, {}).get(label, 0.0) - before.get(name, {}).get(label, 0.0)

    for label, attr in (("false", "compile_first_ms"), ("true", "compile_cached_ms")):
        n = delta("atomrt:grammar_requests_total", label)
        if n > 0:
            setattr(v, attr, round(1e3 * delta("atomrt:grammar_wait_seconds_total", label) / n, 3))
    rows = delta("atomrt:grammar_mask_rows_total")
    if rows > 0:
        v.mask_fill_us_per_row = round(
            1e6 * delta("atomrt:grammar_mask_fill_seconds_total") / rows, 3
        )
    return v


def scrape_grammar(client: Any) -> Optional[dict[str, dict[str, float]]]:
    """The server's grammar counters: name -> {cached label ("" for none) -> total}."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = client.get("/metrics")
        if r.status_code != 200:
            return None
        out: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                if sample.name in _SCRAPED:
                    label = sample.labels.get("cached", "")
                    out.setdefault(sample.name, {})[label] = sample.value
        return out
    except ValueError:
        return None


# ------------------------------------------------------------------------- compile stall


def stall_schema(i: int, seed: int) -> dict[str, Any]:
    """A fresh, complex schema whose compile takes about a second on a CPU core (SmolLM2's
    vocabulary): 300 properties of distinct patterns."""
    rng = random.Random(seed * 1000 + i)
    props = {}
    for j in range(300):
        lo = rng.randint(1, 4)
        hi = lo + rng.randint(2, 8)
        letters = "".join(sorted(rng.sample("abcdefghijklmnopqrstuvwxyz", 6)))
        props[f"s{i}_{j}"] = {"type": "string", "pattern": f"^[{letters}]{{{lo},{hi}}}[0-9]?$"}
    return {"type": "object", "properties": props, "required": list(props)[:5]}


async def _stream_times(client: SSEClient, body: dict[str, Any], times: list[float]) -> None:
    async with contextlib.aclosing(client.events("/v1/completions", body)) as events:
        async for data in events:
            if data != b"[DONE]":
                times.append(time.perf_counter())


async def compile_stall(url: str, model: str, prompt: Any, concurrency: int, seed: int) -> dict:
    """Plain streams' mean time between tokens while STALL_SCHEMAS fresh schemas compile, and just
    before; their ratio."""
    plain = {"model": model, "prompt": prompt, "temperature": 0, "ignore_eos": True, "stream": True}
    plain["max_tokens"] = 100000  # stopped by the bench (max_model_len bounds it too)
    async with SSEClient(url) as client:
        times: list[list[float]] = [[] for _ in range(concurrency)]
        tasks = [asyncio.ensure_future(_stream_times(client, plain, t)) for t in times]
        while sum(1 for t in times if t) < concurrency:  # every stream decoding
            await asyncio.sleep(0.05)
            if all(task.done() for task in tasks):
                raise RuntimeError("compile stall: the plain streams ended before decoding")
        await asyncio.sleep(STALL_BASELINE_S)
        submitted = time.perf_counter()
        firsts: list[list[float]] = [[] for _ in range(STALL_SCHEMAS)]
        structured = [
            asyncio.ensure_future(
                _stream_times(
                    client,
                    {
                        **plain,
                        "max_tokens": 4,
                        "structured_outputs": {"json": stall_schema(i, seed)},
                    },
                    firsts[i],
                )
            )
            for i in range(STALL_SCHEMAS)
        ]
        await asyncio.gather(*structured, return_exceptions=True)
        served = min((f[0] for f in firsts if f), default=time.perf_counter())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    gaps = [(a, b - a) for t in times for a, b in zip(t, t[1:])]
    gaps_before = [g for a, g in gaps if submitted - STALL_BASELINE_S <= a and a + g <= submitted]
    before = sum(gaps_before) / max(len(gaps_before), 1)
    # the steps that prefilled the first structured requests changed the batch, not the compile:
    # the window closes three steps before the first of their tokens came
    end = served - 3 * before
    gaps_during = [g for a, g in gaps if submitted <= a and a + g <= end]
    during = sum(gaps_during) / max(len(gaps_during), 1)
    return {
        "itl_before_ms": round(1e3 * before, 3),
        "itl_during_ms": round(1e3 * during, 3),
        "ratio": round(during / before, 4) if before and gaps_during else None,
        "window_s": round(served - submitted, 3),
        "gaps_during": len(gaps_during),
    }


def stall_line(stall: dict, concurrency: int) -> str:
    """`compile_stall`'s result in words."""
    return (
        f"compile stall: c={concurrency} plain streams, {STALL_SCHEMAS} fresh schemas: "
        f"{stall['itl_during_ms']:.2f} ms between tokens while compiling, "
        f"{stall['itl_before_ms']:.2f} ms before: x{stall['ratio']} "
        f"({stall['gaps_during']} gaps over {stall['window_s']:.2f} s)"
    )

"""Random engines and workloads for the randomized differential (tests/test_engine_random.py), and
the reference they are checked against: each request's samples run alone.

`run_workload` drives one engine through `LLMEngine.add_request / abort / step` as a server would
(random arrivals, streams, aborts) and checks, on every step and at the end:

- at most one output per request and step, exactly one `finished` output per request, none after it;
- no three steps in a row schedule nothing while a request is unfinished (a step may only wait for
  the one in flight), and once arrivals stop every request finishes within `step_bound` steps:
  a clear failure naming what is stuck, never a hang; every KV block is free at the end;
- every greedy or seeded sample gives the tokens, text and finish reason it gives alone (sample i of
  a request as the n=1 request `params.for_sample(i)`: seeded `seed + i`); an aborted sample's
  tokens are a prefix of them; a streamed sample's deltas add up to it, its end reported once;
- an unseeded sampled sample (nothing to compare) ends within its limits.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from executor_harness import VOCAB

from atomrt.runtime.driver.outputs import CompletionOutput, RequestOutput
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import SamplingParams

BLOCK = 4
CPU = dict(device="cpu", enforce_eager=True)


@dataclass(frozen=True)
class Sizes:
    """How long a workload's prompts and outputs get."""

    max_prompt: int
    max_new: int
    max_requests: int  # a workload has 3.. of them

    @property
    def max_prefix(self) -> int:  # a prefix that requests of a workload share
        return self.max_prompt // 3


FULL = Sizes(max_prompt=28, max_new=16, max_requests=10)
SMALL = Sizes(max_prompt=10, max_new=6, max_requests=14)  # a few blocks hold several requests


class Alone:
    """What a request's samples give when each runs by itself: one sequence at a time, a roomy
    pool, synchronous, no prefix cache, no speculation. Cached per (prompt, sample's params)."""

    def __init__(self, model: Path) -> None:
        self.llm = LLM(
            str(model),
            **CPU,
            num_kv_blocks=256,
            block_size=BLOCK,
            max_num_seqs=1,
            enable_prefix_caching=False,
        )
        self.cache: dict[tuple[tuple[int, ...], str], CompletionOutput] = {}

    def samples(self, requests: list[tuple[list[int], SamplingParams]]) -> list[list[Any]]:
        """Per request, per sample, its CompletionOutput alone (one engine call for every miss:
        with max_num_seqs=1 they still run one at a time)."""
        keyed = [[(p, _sample(params, i)) for i in range(params.n)] for p, params in requests]
        missing = {_key(p, sp): (p, sp) for row in keyed for p, sp in row}
        missing = {k: v for k, v in missing.items() if k not in self.cache}
        if missing:
            prompts, params = zip(*missing.values())
            outs = self.llm.generate(list(prompts), list(params), use_tqdm=False)
            for key, out in zip(missing, outs):
                self.cache[key] = out.outputs[0]
        return [[self.cache[_key(p, sp)] for p, sp in row] for row in keyed]

    def tokens(self, prompt: list[int], n: int) -> list[int]:
        """The greedy tokens of `prompt`, n of them (EOS ignored)."""
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return self.samples([(prompt, params)])[0][0].token_ids


def _sample(params: SamplingParams, i: int) -> SamplingParams:
    return params if params.n == 1 else params.for_sample(i)


def _key(prompt: list[int], params: SamplingParams) -> tuple[tuple[int, ...], str]:
    return tuple(prompt), repr(params)


def speculative_config(kind: Optional[str], k: int, draft: Path) -> Optional[dict[str, Any]]:
    if kind == "ngram":
        return dict(
            method="ngram", num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1
        )
    if kind == "draft":
        return dict(method="draft_model", model=str(draft), num_speculative_tokens=k)
    return None


def random_config(
    rng: random.Random, draft: Path, sizes: Sizes = FULL, **forced: Any
) -> dict[str, Any]:
    """LLM settings: a pool from just fitting the longest request to roomy, 1..8 sequences, small
    budgets, async or not, prefix caching or not, no speculation or n-gram / draft-model drafts.
    `forced`: `spec` ("none", "ngram", "draft"), `tiny_pool`, or any LLM setting."""
    spec = forced.pop("spec", None) or rng.choice(["none", "none", "ngram", "draft"])
    k = rng.randint(1, 3) if spec != "none" else 0
    fits = -(-(sizes.max_prompt + sizes.max_new - 1 + k) // BLOCK)  # the longest request's blocks
    tiny = [fits, fits + 1, fits + 2, 2 * fits]
    pools = tiny if forced.pop("tiny_pool", False) else [fits, fits + 2, 24, 64]
    config = dict(
        num_kv_blocks=rng.choice(pools),
        block_size=BLOCK,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.choice([8, 16, 32, 64]),
        async_scheduling=rng.random() < 0.6,
        enable_prefix_caching=rng.random() < 0.6,
        enable_chunked_prefill=True,
        speculative_config=speculative_config(spec, k, draft),
    )
    config.update(forced)
    return config


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    stream: bool

    @property
    def compared(self) -> bool:
        """Whether its samples have tokens to compare: greedy or seeded."""
        return self.params.is_greedy or self.params.seed is not None


def random_request(
    rng: random.Random, shared: list[int], seeded_share: float, sizes: Sizes = FULL
) -> Request:
    """n from 1 to 4; greedy, seeded sampled (`seeded_share` of them) or, rarely, unseeded sampled;
    EOS, stop token ids or stop strings now and then; penalties or logprobs (which decode without
    drafts) rarely; streamed or not."""
    if rng.random() < 0.2:  # repetitive: n-gram drafts find matches
        period = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 4))]
        prompt = (period * sizes.max_prompt)[: rng.randint(4, sizes.max_prompt)]
    else:
        prefix = shared[: rng.randint(1, sizes.max_prefix)] if rng.random() < 0.5 else []
        tail = rng.randint(1, sizes.max_prompt - sizes.max_prefix)
        prompt = prefix + [rng.randrange(4, VOCAB) for _ in range(tail)]
    short = rng.random() < 0.25  # done within a step or two of its prefill: a sample 0 that
    # finishes while its samples still wait for its prompt, or while it is preempted
    max_tokens = rng.randint(1, 2) if short else rng.randint(1, sizes.max_new)
    kw: dict[str, Any] = dict(n=rng.choice([1, 1, 2, 3, 4]), max_tokens=max_tokens)
    draw = rng.random()
    if draw < seeded_share:
        kw.update(temperature=rng.choice([0.1, 0.7, 1.0]), seed=rng.randrange(2**40))
        kw.update(top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([-1, 5]))
    elif draw < seeded_share + 0.05:
        kw.update(temperature=1.0)
    else:
        kw.update(temperature=0.0)
    ends = rng.random()
    kw["ignore_eos"] = ends < 0.6
    if 0.6 <= ends < 0.8:
        kw["stop_token_ids"] = [rng.randrange(4, VOCAB) for _ in range(4)]
    if rng.random() < 0.1:
        kw["stop"] = [f"w{rng.randrange(4, VOCAB)}"]
    extra = rng.random()
    if extra < 0.06:
        kw["repetition_penalty"] = 1.3
    elif extra < 0.1:
        kw["logprobs"] = 2
    return Request(prompt, SamplingParams(**kw), stream=rng.random() < 0.3)


@dataclass
class Coverage:
    """What a run exercised, for the tests that need it to have happened."""

    requests: int = 0
    compared_samples: int = 0
    seeded_samples: int = 0
    preempted: Counter = field(default_factory=Counter)  # "parent" / "child" / "single"
    aborted: int = 0

    def __iadd__(self, other: Coverage) -> Coverage:
        self.requests += other.requests
        self.compared_samples += other.compared_samples
        self.seeded_samples += other.seeded_samples
        self.preempted.update(other.preempted)
        self.aborted += other.aborted
        return self


@dataclass
class Seen:
    """One request's outputs as a caller of step() collects them."""

    request: Request
    tokens: dict[int, list[int]] = field(default_factory=dict)  # streamed: deltas added up
    text: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)  # sample -> its finish reason
    ends: Counter = field(default_factory=Counter)  # sample -> outputs that reported its end
    final: Optional[RequestOutput] = None

    def record(self, out: RequestOutput) -> None:
        rid = out.request_id
        assert self.final is None, f"request {rid}: an output after its finished one"
        assert self.request.stream or out.finished, f"request {rid}: not streamed, yet a delta"
        for c in out.outputs:
            if self.request.stream:
                self.tokens.setdefault(c.index, []).extend(c.token_ids)
                self.text[c.index] = self.text.get(c.index, "") + c.text
            else:
                self.tokens[c.index], self.text[c.index] = c.token_ids, c.text
            if c.finish_reason is not None:
                self.reasons[c.index] = c.finish_reason
                self.ends[c.index] += 1
        if out.finished:
            self.final = out


def step_bound(engine: Any, seen: dict[str, Seen]) -> int:
    """How many steps the unfinished requests may take once arrivals stop: for every unfinished
    sample its prompt's chunks, its tokens and a spare few, doubled (async scheduling runs a
    wasted row after a stop; preemption recomputes), plus slack."""
    budget = engine.config.scheduler_config.max_num_batched_tokens
    total = 0
    for s in seen.values():
        if s.final is None:
            chunks = -(-(len(s.request.prompt) + s.request.params.max_tokens) // budget)
            total += s.request.params.n * (chunks + s.request.params.max_tokens + 4)
    return 2 * total + 50


def _stuck(engine: Any, steps: int, what: str) -> str:
    rows = []
    for rank, sched in enumerate(engine.schedulers):
        for where, seqs in (("waiting", list(sched.waiting)), ("running", sched.running)):
            for q in seqs:
                parent = q.parent.status.value if q.parent is not None else "-"
                rows.append(
                    f"rank {rank} {where}: request {q.request_id} sample {q.index} "
                    f"computed {q.num_computed_tokens}/{q.num_tokens} pending {q.num_pending} "
                    f"parent {parent}"
                )
    free = [s.block_manager.num_free_blocks for s in engine.schedulers]
    return f"unfinished after {steps} {what}; free blocks {free}:\n" + "\n".join(rows)


def run_workload(
    llm: LLM, rng: random.Random, alone: Alone, seeded_share: float = 0.3, sizes: Sizes = FULL
) -> Coverage:
    """3..10 random requests arriving at random steps on one engine, random aborts; every check of
    the module docstring."""
    engine = llm.engine
    shared = [rng.randrange(4, VOCAB) for _ in range(sizes.max_prefix)]
    todo = [
        random_request(rng, shared, seeded_share, sizes)
        for _ in range(rng.randint(3, sizes.max_requests))
    ]
    seen: dict[str, Seen] = {}
    aborted: set[str] = set()
    preempted: set[tuple[str, int]] = set()
    bound: Optional[int] = None
    steps = stalled = 0
    while True:
        for _ in range(rng.choice([0, 0, 1, 1, 1, 3])):  # arrivals, now and then a burst
            if todo:
                req = todo.pop(0)
                seen[engine.add_request(req.prompt, req.params, stream=req.stream)] = Seen(req)
        live = [r for r, s in seen.items() if s.final is None and r not in aborted]
        if live and rng.random() < 0.04:
            victim = rng.choice(live)
            engine.abort(victim)
            aborted.add(victim)
        rows = engine.stats.real_tokens
        outs = engine.step()
        # A step that schedules nothing only waits for the one in flight: never twice running
        # (an abort would hide a request stuck for ever; the check catches it at once).
        stalled = stalled + 1 if engine.stats.real_tokens == rows and not outs else 0
        if stalled > 2 and engine.has_unfinished():
            raise AssertionError(_stuck(engine, stalled, "steps scheduled nothing"))
        ids = [o.request_id for o in outs]
        assert len(ids) == len(set(ids)), f"two outputs of one request in one step: {ids}"
        for out in outs:
            seen[out.request_id].record(out)
        for sched in engine.schedulers:
            preempted.update((q.request_id, q.index) for q in sched.waiting if q.num_preemptions)
        if todo:
            continue
        if bound is None:
            bound = step_bound(engine, seen)
        if not engine.has_unfinished():
            break
        steps += 1
        if steps > bound:
            raise AssertionError(_stuck(engine, steps, "steps after the last arrival"))
    assert all(
        s.block_manager.num_free_blocks == s.block_manager.num_blocks for s in engine.schedulers
    ), "KV blocks left allocated"
    requests = [(s.request.prompt, s.request.params) for s in seen.values()]
    coverage = Coverage(requests=len(seen), aborted=len(aborted))
    for (rid, s), want in zip(seen.items(), alone.samples(requests)):
        check_request(rid, s, want, rid in aborted, coverage)
    for rid, i in preempted:
        single = seen[rid].request.params.n == 1
        coverage.preempted["single" if single else "child" if i else "parent"] += 1
    return coverage


def check_request(
    rid: str, s: Seen, want: list[CompletionOutput], aborted: bool, coverage: Coverage
) -> None:
    """One request's samples against what each gives alone (see the module docstring)."""
    params = s.request.params
    n = params.n
    assert s.final is not None, f"request {rid} never got its finished output"
    if not s.request.stream:
        assert [c.index for c in s.final.outputs] == list(range(n)), rid
    assert s.ends == Counter(range(n)), f"request {rid}: sample ends reported {dict(s.ends)}"
    for i in range(n):
        tokens, reason = s.tokens.get(i, []), s.reasons[i]
        where = f"request {rid} sample {i} ({params}, stream={s.request.stream})"
        assert reason != "abort" or aborted, where
        if not s.request.compared:
            assert len(tokens) <= params.max_tokens and reason in ("stop", "length", "abort")
            continue
        coverage.compared_samples += 1
        coverage.seeded_samples += params.seed is not None
        if reason == "abort":
            assert tokens == want[i].token_ids[: len(tokens)], where
        else:
            got = (tokens, reason, s.text[i])
            assert got == (want[i].token_ids, want[i].finish_reason, want[i].text), where

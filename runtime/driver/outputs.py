"""What the engine hands to users: `RequestOutput` with one `CompletionOutput` per sample
(the shape vLLM users know)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Optional

from atomrt.runtime.driver.prompt_logprobs import Logprob, PromptLogprobsList
from atomrt.runtime.driver.sequence import Sequence

# Per sampled token: {token id: Logprob} holding the sampled token and the top alternatives
# (vLLM's shape: `c.logprobs[i][token_id].logprob`).
SampleLogprobs = list[dict[int, Logprob]]


# The three output dataclasses below are built with positional arguments in the step's hot path
# (`make_request_output`: about half the time of keywords): keep their fields in this order.


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    logprobs: Optional[SampleLogprobs] = None
    cumulative_logprob: Optional[float] = None
    stop_reason: Optional[object] = None  # the stop token id or string, when one ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When the request arrived, was first scheduled, produced its first token and finished:
    wall-clock times (time.time()), as vLLM reports them."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]  # shared by every output of the request: read it, do not modify it
    outputs: list[CompletionOutput] = field(default_factory=list)
    # The request ended (every sample; each CompletionOutput's finish_reason says its own): one
    # output per request has it, the last the engine returns for the request.
    finished: bool = False
    metrics: Optional[RequestMetrics] = None
    # SamplingParams.prompt_logprobs: None, then {token id: Logprob} per prompt token (a streamed
    # request's first output carries them)
    prompt_logprobs: Optional[PromptLogprobsList] = None
    num_cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache
    # why the request ended with finish_reason "abort" when no client aborted it: its
    # structured-output grammar did not compile, or not within
    # structured_outputs_config.grammar_compile_timeout_s; or no token satisfied its constraints
    error: Optional[str] = None


def make_request_output(
    seq: Sequence, prompt: Optional[str] = None, delta: bool = False, wall: Optional[float] = None
) -> RequestOutput:
    """Snapshot of seq for the user: cumulative text, tokens and logprobs by default; delta=True
    (streaming) returns only the text, token ids and logprobs not yet streamed (the same rows),
    holding back a text tail that could start a stop string while the sequence runs. `wall`:
    time.time() - time.monotonic() (`wall_offset`), once for a step's outputs."""
    finished = seq.is_finished
    wants_logprobs = seq.sampling_params.logprobs is not None
    prompt_logprobs = seq.prompt_logprobs
    if delta:
        if seq.num_streamed_tokens:  # sent with the first output
            prompt_logprobs = None
        text = seq.detokenizer.take_stream_delta(finished) if seq.detokenizer is not None else ""
        # Slice the new tokens straight from token_ids: copying the whole output first costs a
        # streamed row time that grows with its length, every step.
        start = seq.num_streamed_tokens
        token_ids = seq.token_ids[seq.num_prompt_tokens + start :]
        logprobs = (  # the same new rows
            sample_logprobs(seq, seq.output_logprobs[start:]) if wants_logprobs else None
        )
        seq.num_streamed_tokens = seq.num_output_tokens
    else:
        text = seq.output_text
        token_ids = seq.output_token_ids
        logprobs = sample_logprobs(seq, seq.output_logprobs) if wants_logprobs else None
    cumulative_logprob = seq.cumulative_logprob if wants_logprobs else None
    completion = CompletionOutput(
        seq.index,
        text,
        token_ids,
        seq.finish_reason,
        logprobs,
        cumulative_logprob,
        seq.stop_reason,
    )
    if wall is None:
        wall = wall_offset()
    metrics = RequestMetrics(  # the sequence's times are monotonic ones
        seq.arrival_time + wall,
        _plus(seq.first_scheduled_time, wall),
        _plus(seq.first_token_time, wall),
        _plus(seq.finished_time, wall),
        seq.num_preemptions,
    )
    return RequestOutput(
        seq.request_id,
        prompt,
        seq.prompt_token_ids,
        [completion],
        finished,
        metrics,
        prompt_logprobs,
        seq.num_cached_tokens if seq.num_cached_tokens >= 0 else None,
        seq.error,
    )


def wall_offset() -> float:
    """What turns a time.monotonic() time into a time.time() one (`RequestMetrics`)."""
    return time.time() - time.monotonic()


def _plus(t: Optional[float], offset: float) -> Optional[float]:
    return None if t is None else t + offset


def sample_logprobs(seq: Sequence, rows: list[dict[int, float]]) -> SampleLogprobs:
    """The sequence's rows ({token id: logprob}: the top alternatives in order, then the sampled
    token) as vLLM's {token id: Logprob(logprob, rank, decoded_token)}. A top alternative's rank is
    its place (1: the most likely); the sampled token's is its place among them, None when it is
    not one of them (its exact rank is not computed). decoded_token is the token alone, special
    tokens included."""
    tokenizer = seq.detokenizer.tokenizer if seq.detokenizer is not None else None
    num_top = seq.sampling_params.logprobs or 0
    out: SampleLogprobs = []
    for row in rows:
        ranks = {tid: i + 1 for i, tid in enumerate(itertools.islice(row, num_top))}
        out.append(
            {
                tid: Logprob(
                    lp,
                    ranks.get(tid),
                    tokenizer.decode([tid], skip_special_tokens=False) if tokenizer else None,
                )
                for tid, lp in row.items()
            }
        )
    return out


def merge_request_outputs(outputs: list[RequestOutput], finished: bool) -> RequestOutput:
    """One output of a request from some of its samples' (one CompletionOutput each, by index);
    `finished`: whether the request is (every sample, not only these)."""
    first = outputs[0]
    completions = sorted((c for o in outputs for c in o.outputs), key=lambda c: c.index)
    return RequestOutput(
        request_id=first.request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=finished,
        metrics=first.metrics,
        prompt_logprobs=first.prompt_logprobs,  # sample 0's: the request's
        num_cached_tokens=first.num_cached_tokens,
        error=next((o.error for o in outputs if o.error is not None), None),
    )

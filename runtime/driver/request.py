"""A request as the engine keeps it (`EngineRequest`: its samples and how its outputs go out), and
what `LLMEngine.add_request` and the step do with a request's own parameters: binding either form
of `add_request`'s arguments, fitting the prompt and `max_tokens` to the context, and the logprobs
of a step's tokens that each request asked for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Union

from atomrt.distributed.messages import StepResult
from atomrt.runtime.driver.outputs import (
    RequestOutput,
    make_request_output,
    merge_request_outputs,
    wall_offset,
)
from atomrt.runtime.driver.scheduler import SchedulerOutput
from atomrt.runtime.driver.sequence import Sequence
from atomrt.runtime.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class EngineRequest:
    """One request's sequences (its n samples) and how its outputs go out."""

    dp_rank: int
    seqs: list[Sequence]
    prompt: Optional[str]  # the prompt text, when it came as text
    stream: bool  # a delta output (of the samples with new tokens) every step it produced one
    cumulative: bool = False  # else: every sample's whole output so far, every step

    @property
    def all_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def final_output(self) -> RequestOutput:
        """Every sample's whole output (a request that is not streamed, once all have finished)."""
        outputs = [make_request_output(s, self.prompt) for s in self.seqs]
        return merge_request_outputs(outputs, finished=True)

    def delta_output(self, seqs: list[Sequence]) -> RequestOutput:
        """The new tokens of `seqs` (samples of this request, by index) in one output, which is
        `finished` once every sample is: a streamed request's output of one step."""
        deltas = [make_request_output(s, self.prompt, delta=True) for s in seqs]
        if len(self.seqs) == 1:
            return deltas[0]
        return merge_request_outputs(deltas, finished=self.all_finished)


class StepOutputs:
    """A step's outputs, built a row at a time (`add`: a scheduled row whose token was applied),
    then `finish`: at most one output per request (a streamed request's delta, or a request's
    final output), the finished requests dropped from `requests`."""

    def __init__(self, requests: dict[str, EngineRequest]) -> None:
        self.requests = requests
        self.outputs: list[RequestOutput] = []
        self.samples: dict[str, list[Sequence]] = {}  # n > 1: a request's samples with new tokens
        self.wall = wall_offset()  # one clock reading for the step's outputs

    def add(self, seq: Sequence) -> None:
        req = self.requests.get(seq.request_id)
        if req is None:
            return
        if len(req.seqs) > 1:
            self.samples.setdefault(seq.request_id, []).append(seq)
        elif req.stream:
            self.outputs.append(make_request_output(seq, req.prompt, True, self.wall))
        elif req.cumulative:  # the whole output so far, `finished` once it is
            self.outputs.append(make_request_output(seq, req.prompt, False, self.wall))
        elif seq.is_finished:
            self.outputs.append(req.final_output())

    def finish(self) -> list[RequestOutput]:
        outputs = self.outputs
        for request_id, seqs in self.samples.items():
            req = self.requests[request_id]
            if req.stream:
                outputs.append(req.delta_output(sorted(seqs, key=lambda s: s.index)))
            elif req.cumulative and not req.all_finished:
                parts = [make_request_output(s, req.prompt) for s in req.seqs]
                outputs.append(merge_request_outputs(parts, finished=False))
            elif req.all_finished:
                outputs.append(req.final_output())
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs


class AddRequestArgs(NamedTuple):
    """What a call of `add_request` asked for, in either form."""

    prompt: Any
    params: Any
    request_id: Any
    kind: Union[bool, RequestOutputKind]  # the older form: whether to stream


_OLDER_FORM = ("prompt", "params", "request_id", "stream")
_VLLM_FORM = (
    "request_id",
    "prompt",
    "params",
    "arrival_time",
    "lora_request",
    "tokenization_kwargs",
    "trace_headers",
    "priority",
)


def bind_add_request(args: tuple[Any, ...], kwargs: dict[str, Any]) -> AddRequestArgs:
    """The arguments of either form of `add_request`, by name."""
    # vLLM's form starts (request id, prompt); the older one (prompt, params or None)
    vllm_form = "prompt" in kwargs
    if len(args) >= 2 and "request_id" not in kwargs and isinstance(args[0], str):
        vllm_form = not isinstance(args[1], SamplingParams) and args[1] is not None
    if not vllm_form:
        bound = _bind(_OLDER_FORM, args, kwargs)
        if "prompt" not in bound:
            raise TypeError("add_request: missing the prompt")
        stream = bound.get("stream", False)
        return AddRequestArgs(
            bound["prompt"], bound.get("params"), bound.get("request_id"), bool(stream)
        )
    bound = _bind(_VLLM_FORM, args, kwargs)
    for key in ("request_id", "prompt"):
        if key not in bound:
            raise TypeError(f"add_request: missing {key}")
    if bound.get("lora_request") is not None:
        raise ValueError("lora_request: atomrt serves no LoRA adapters")
    if bound.get("tokenization_kwargs"):
        raise ValueError("tokenization_kwargs: not supported (use truncate_prompt_tokens)")
    if bound.get("priority", 0) != 0:
        raise ValueError("priority: atomrt schedules first come, first served (priority 0 only)")
    params = bound.get("params")
    kind = (
        params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.FINAL_ONLY
    )
    return AddRequestArgs(bound["prompt"], params, bound["request_id"], kind)


def _bind(names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict:
    """Positional and keyword arguments by name; a TypeError for too many, or an unknown or
    repeated one."""
    if len(args) > len(names):
        raise TypeError(f"add_request: at most {len(names)} arguments")
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names or key in bound:
            raise TypeError(f"add_request: unexpected or repeated argument {key!r}")
        bound[key] = value
    return bound


def fit_to_context(
    token_ids: list[int], params: SamplingParams, max_model_len: int
) -> tuple[list[int], SamplingParams]:
    """`truncate_prompt_tokens` (keep the prompt's last k tokens; -1: max_model_len) and
    `max_tokens=None` (as many as the context leaves), as vLLM reads them."""
    k = params.truncate_prompt_tokens
    if k is not None:
        k = max_model_len if k == -1 else k
        if k > max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {k} exceeds max_model_len={max_model_len}")
        token_ids = token_ids[-k:]
    if params.max_tokens is None:
        room = max(max_model_len - len(token_ids), 1)
        params = dataclasses.replace(params, max_tokens=room)
    return token_ids, params


def step_logprobs(res: StepResult, out: SchedulerOutput) -> Optional[dict[int, dict[int, float]]]:
    """seq_id -> {token id: logprob}: the sampled token plus the request's own top-`logprobs`
    (the worker sends the batch's largest k for every row)."""
    if res.logprobs is None:
        return None
    wanted = {r.seq.seq_id: r.seq.sampling_params.logprobs for r in out.scheduled}
    rows: dict[int, dict[int, float]] = {}
    for i, (seq_id, tok) in enumerate(zip(res.seq_ids.tolist(), res.sampled_token_ids.tolist())):
        k = wanted.get(seq_id)
        if k is None:
            continue
        top_ids, top_lps = res.top_logprob_ids[i, :k].tolist(), res.top_logprobs[i, :k].tolist()
        row = {int(t): float(lp) for t, lp in zip(top_ids, top_lps)}
        row[int(tok)] = float(res.logprobs[i])
        rows[seq_id] = row
    return rows

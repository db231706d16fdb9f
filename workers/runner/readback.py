"""A step's sampled tokens on their way to the host, through pinned slots the runner reuses."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple, Optional

import numpy as np
import torch

from atomrt.workers.runner.sampler import SamplerOutput

NUM_SLOTS = 4  # pinned token buffers reused by `Readbacks.start` (async scheduling keeps <= 2 busy)
PROGRESS_PERIOD_S = 0.1  # how often a long wait on the device reports progress


class DeviceTimeout(RuntimeError):
    """The device did not finish a step within the bound: a hung GPU or a runaway kernel."""


def wait_event(
    event: torch.cuda.Event, timeout_s: float, progress: Optional[Callable[[], None]], what: str
) -> None:
    """Wait for `event` by polling it (never an unbounded synchronize): `progress()` is called while
    waiting, and DeviceTimeout is raised after `timeout_s`."""
    start = last = time.monotonic()
    while not event.query():
        now = time.monotonic()
        if now - start > timeout_s:
            raise DeviceTimeout(
                f"{what}: the device did not finish within {timeout_s:.0f} s "
                "(parallel_config.heartbeat_timeout_s)"
            )
        if progress is not None and now - last > PROGRESS_PERIOD_S:
            progress()
            last = now


class StepArrays(NamedTuple):
    """A step's results on the host."""

    tokens: list[int]
    logprobs: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]  # sampled, top ids, top values
    prompt_logprobs: Optional[list[np.ndarray]]  # PromptLogprobsTensors' arrays, in order


class ReadbackSlot:
    """A pinned host buffer for a step's sampled tokens and the event that says their copy landed.
    `busy` from the copy's start until `Readback.wait`."""

    def __init__(self, size: int) -> None:
        self.tokens = torch.empty(size, dtype=torch.int64, pin_memory=True)
        self.event = torch.cuda.Event()
        self.busy = False


class Readback:
    """A step's sampled tokens (and logprobs) on their way to the host. On CUDA the copies are queued
    behind the step and the host waits on an event, so a later step queued meanwhile is not waited
    for; on CPU the values are already there. The tokens land in `slot` when one is given (free,
    and large enough), else in a new pinned tensor."""

    def __init__(
        self, out: SamplerOutput, device: torch.device, slot: Optional[ReadbackSlot] = None
    ) -> None:
        lp = out.logprobs
        tensors = [out.sampled_token_ids]
        if lp is not None:
            tensors += [
                lp.sampled_logprobs.float(),
                lp.top_token_ids.to(torch.int32),
                lp.top_logprobs.float(),
            ]
        self.num_logprob_tensors = len(tensors) - 1
        if out.prompt_logprobs is not None:
            tensors += out.prompt_logprobs.tensors()
        self.event: Optional[torch.cuda.Event] = None
        self.slot: Optional[ReadbackSlot] = None
        if device.type == "cuda":
            tokens = tensors[0]
            fits = (
                slot is not None
                and tokens.dtype == slot.tokens.dtype
                and tokens.shape[0] <= slot.tokens.shape[0]
            )
            if fits and not slot.busy:
                host = slot.tokens[: tokens.shape[0]]
                host.copy_(tokens, non_blocking=True)
                tensors = [host] + [t.to("cpu", non_blocking=True) for t in tensors[1:]]
                slot.busy, self.slot, self.event = True, slot, slot.event
            else:
                tensors = [t.to("cpu", non_blocking=True) for t in tensors]
                self.event = torch.cuda.Event()
            self.event.record()
        self.tensors = tensors

    def done(self) -> bool:
        """Whether the copies have landed (never blocks)."""
        return self.event is None or self.event.query()

    def wait(
        self,
        timeout_s: float = float("inf"),
        progress: Optional[Callable[[], None]] = None,
        what: str = "readback",
    ) -> StepArrays:
        """The step's results once the copies landed (a bounded wait: see `wait_event`)."""
        if self.event is not None:
            wait_event(self.event, timeout_s, progress, what)
        tokens = self.tensors[0].tolist()
        if self.slot is not None:  # the tokens are out of the slot: it may take the next step's
            self.slot.busy, self.slot = False, None
        end = 1 + self.num_logprob_tensors
        logprobs = tuple(t.numpy() for t in self.tensors[1:end]) if end > 1 else None
        prompt = [t.numpy() for t in self.tensors[end:]] if len(self.tensors) > end else None
        return StepArrays(tokens, logprobs, prompt)


class Readbacks:
    """The runner's pinned slots (CUDA only): a step's readback takes the first free one, so a step
    allocates nothing; with none free (or on CPU) a new buffer is used."""

    def __init__(self, device: torch.device, max_num_seqs: int) -> None:
        self.device = device
        self.slots = (
            [ReadbackSlot(max_num_seqs) for _ in range(NUM_SLOTS)] if device.type == "cuda" else []
        )

    def start(self, out: SamplerOutput) -> Readback:
        slot = next((s for s in self.slots if not s.busy), None)
        return Readback(out, self.device, slot)

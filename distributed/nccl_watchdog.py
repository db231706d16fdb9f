"""`drain_nccl_works()`: wait out ProcessGroupNCCL's watchdog before a CUDA-graph recording.

The hazard. ProcessGroupNCCL enqueues every eager collective's Work on a list that its watchdog
thread polls (a `cudaEventQuery` on the Work's end event, every ~100 ms) until the Work has
completed; only then is it retired from the list. A collective recorded into a CUDA graph joins the
NCCL stream into the capture. If, during that capture, the watchdog queries the event of an eager
collective that is still on its list, the query touches a capturing stream: the capture is
invalidated (ROCm: `hipErrorCapturedEvent`; CUDA: "operation not permitted when stream is
capturing"), or the watchdog itself throws and tears the process group down. `torch.cuda.synchronize()`
alone does not prevent it: the work completes on the GPU, but stays on the watchdog's list until
the next poll retires it, and that poll can land inside the capture.

Recent PyTorch on CUDA mitigates this (PR 104487 / 110665: capture start waits until enqueued
work is retired; PR 148594: the watchdog queries in thread-local capture mode), ROCm still needs it,
and atomrt drains explicitly on every build anyway: it is cheap (at most one watchdog period per
recording), deterministic, and tested.

Mechanism (torch 2.8 - 2.13): `torch.cuda.synchronize()` so every eager collective has finished on
the GPU, then `ProcessGroup._wait_for_pending_works()` on every NCCL group of this process, which
returns once the watchdog has retired every enqueued Work (it polls the watchdog's work list; it
releases the GIL). Neither call has a timeout of its own, so both run in a daemon thread that the
caller waits on with a bound; a `NcclDrainTimeout` names the rank and the groups. If the private
method is missing (a torch that lacks it), we fall back to synchronize plus two watchdog periods.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_WATCHDOG_PERIOD_S = 0.1  # ProcessGroupNCCL's watchdog poll interval (kWatchdogThreadSleepMillis)
_warned_fallback = False


class NcclDrainTimeout(TimeoutError):
    """Eager NCCL work did not complete and retire in time; capturing now would be unsafe."""


def graph_capture_kwargs() -> dict[str, Any]:
    """Keyword arguments for `torch.cuda.graph(...)` / `CUDAGraph.capture_begin(...)`.

    thread_local: only this thread's unsafe CUDA calls can invalidate the capture, not another
    thread's (the NCCL watchdog, a logging thread, the tokenizer pool).
    """
    return {"capture_error_mode": "thread_local"}


def _nccl_groups(groups: Optional[Iterable[Any]]) -> list[Any]:
    if groups is None:
        # every process group this rank belongs to; torch keeps them in its private registry
        world = getattr(dist.distributed_c10d, "_world", None)
        pg_map = getattr(world, "pg_map", None)
        groups = list(pg_map) if pg_map else [dist.group.WORLD]
    out = []
    for pg in groups:
        if pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        if str(dist.get_backend(pg)) == "nccl":
            out.append(pg)
    return out


def drain_nccl_works(timeout_s: float = 60.0, groups: Optional[Iterable[Any]] = None) -> None:
    """Before a CUDA-graph recording: wait until every eager NCCL collective has completed AND been
    retired by ProcessGroupNCCL's watchdog, so that no watchdog poll can hit the capture.

    No-op without an initialized process group, on gloo, or without CUDA. `groups`: the process
    groups to drain (default: every group of this rank). Raises `NcclDrainTimeout` after
    `timeout_s` (a collective some peer never joined, a hung GPU, or TORCH_NCCL_BLOCKING_WAIT=1,
    under which the watchdog was seen never retiring work).
    """
    if not (dist.is_available() and dist.is_initialized() and torch.cuda.is_available()):
        return
    pgs = _nccl_groups(groups)
    if not pgs:
        return
    device = torch.cuda.current_device()  # the drain thread must sync *this* thread's device
    done = threading.Event()
    errors: list[BaseException] = []

    def drain() -> None:
        try:
            torch.cuda.synchronize(device)
            _wait_retired(pgs)
        except BaseException as e:  # handed to the caller below
            errors.append(e)
        finally:
            done.set()

    t0 = time.monotonic()
    threading.Thread(target=drain, name="atomrt-nccl-drain", daemon=True).start()
    if not done.wait(timeout_s):
        rank = dist.get_rank()
        raise NcclDrainTimeout(
            f"rank {rank}: drain NCCL work before graph capture: not done after {timeout_s:.0f} s "
            f"({len(pgs)} NCCL group(s)); an eager collective has not completed or the watchdog has not "
            "retired it (a peer that never joined the collective? TORCH_NCCL_BLOCKING_WAIT=1 set?)"
        )
    if errors:
        raise errors[0]
    logger.debug("drained %d NCCL group(s) in %.1f ms", len(pgs), (time.monotonic() - t0) * 1e3)


def _wait_retired(pgs: list[Any]) -> None:
    global _warned_fallback
    for pg in pgs:
        wait = getattr(pg, "_wait_for_pending_works", None)
        if wait is None:
            if not _warned_fallback:
                _warned_fallback = True
                logger.warning(
                    "torch %s has no ProcessGroup._wait_for_pending_works; draining NCCL work by waiting "
                    "two watchdog periods instead",
                    torch.__version__,
                )
            time.sleep(2 * _WATCHDOG_PERIOD_S)
            return
        wait()

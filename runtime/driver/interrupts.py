"""Holding Ctrl-C back while the driver's state is half changed.

A KeyboardInterrupt can land between any two bytecodes. Inside a step that would leave a scheduler
with blocks allocated and no plan sent, or a sequence advanced but not recorded in flight. The
engine therefore marks the parts of its step that change state as critical: a SIGINT that arrives
there is held and raised when the part ends, where the engine knows exactly what was submitted and
can discard it. Waiting for results is not critical: Ctrl-C interrupts it at once.

Only the main thread receives signals, and only Python's default handler is replaced: a program
that installed its own SIGINT handler keeps it (and its interrupts are not held back). The handler
is the process's, like the signal: installed once, shared by every engine, and outside a critical
section it does what the default handler does (raise KeyboardInterrupt), so it is never removed.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional


class _SigintHolder:
    def __init__(self) -> None:
        self.depth = 0  # critical sections open in the main thread
        self.held = False

    def handle(self, signum: int, frame: Any) -> None:
        if self.depth:
            self.held = True
        else:
            raise KeyboardInterrupt


_holder: Optional[_SigintHolder] = None  # the process's SIGINT handler, once installed


def _install() -> Optional[_SigintHolder]:
    global _holder
    if threading.current_thread() is not threading.main_thread():
        return None
    current = signal.getsignal(signal.SIGINT)
    if _holder is not None and current == _holder.handle:
        return _holder
    if current is signal.default_int_handler:
        _holder = _SigintHolder()
        signal.signal(signal.SIGINT, _holder.handle)
        return _holder
    return None


class InterruptGuard:
    def __init__(self) -> None:
        self._holder = _install()

    @property
    def installed(self) -> bool:
        return self._holder is not None

    @contextmanager
    def critical(self) -> Iterator[None]:
        """A part of the step that must not stop half-way: a SIGINT meanwhile is raised at its end."""
        holder = self._holder
        if holder is None or threading.current_thread() is not threading.main_thread():
            yield
            return
        holder.depth += 1
        try:
            yield
        finally:
            holder.depth -= 1
            if holder.held and not holder.depth:
                holder.held = False
                raise KeyboardInterrupt

"""One driver at a time: the guard that makes a second, concurrent caller of ``P2PTier`` fail
with a clear error instead of corrupting the tier (or crashing libzmq underneath it).

The tier and every transport assume that their public methods are called by **one thread at
a time** (contracts.py). Engines may hand the tier between threads (vLLM calls it from the
scheduler thread and from its tier-poll thread, under one lock); that is allowed. What is not
allowed is two threads inside at once: the second one raises :class:`ConcurrentCall`, naming
both threads and the method the first is in, and touches nothing.

Cost: one uncontended non-blocking acquire and release of a re-entrant lock per call (in C);
the outermost call also records the method and the thread, for the refusal's message. Its
exit flushes control frames only when one was queued (:class:`FlushPoint`): a call that sent
nothing, such as a request naming a peer with no session yet, makes no call for it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from p2pkv.errors import ConcurrentCall

P = ParamSpec("P")
R = TypeVar("R")


class FlushPoint:
    """Control frames a batching transport holds, and the call that puts them on the wire.

    Whoever queues a frame sets ``pending`` (the sessions, as they send). Calling the point
    flushes and clears it. :class:`DriverGuard` calls it as an outermost call returns, only
    when ``pending`` is set: every frame leaves by the end of the call that queued it, and a
    call that queued none pays one attribute read. A cleanup frame (the terminal fetch) does
    not set it: it leaves with the next flush, or at the next tick's ``poll``. Driver thread
    only."""

    __slots__ = ("_flush", "pending")

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush
        self.pending = False

    def __call__(self) -> None:
        """Flush now, whether or not a frame is pending (before a slow data call, say)."""
        self.pending = False
        self._flush()


class DriverGuard:
    """Admits the calls of one thread at a time; a concurrent thread gets ``ConcurrentCall``.

    A re-entrant lock taken without blocking: the thread inside may re-enter (nested calls),
    any other one is refused. ``enter`` returns whether the call is the thread's outermost,
    which the matching ``exit`` is given."""

    __slots__ = ("_lock", "_method", "_owner", "_what", "flush")

    def __init__(self, what: str) -> None:
        self._what = what
        self.flush: FlushPoint | None = None
        """Called as an outermost call returns (or raises) with a frame pending, by its
        thread, before the next caller may enter: the tier's control flush point."""
        self._lock = threading.RLock()
        self._owner = 0
        """The thread inside (for the refusal's message only)."""
        self._method = ""
        """The outermost method being run, ``""`` when no thread is inside."""

    def enter(self, method: str) -> bool:
        if not self._lock.acquire(False):
            raise self._refusal(method)
        if self._method:
            return False
        self._method = method
        self._owner = threading.get_ident()
        return True

    def exit(self, outermost: bool) -> None:
        try:
            if outermost:
                self._method = ""
                flush = self.flush
                if flush is not None and flush.pending:
                    flush()
        finally:
            self._lock.release()

    def _refusal(self, method: str) -> ConcurrentCall:
        return ConcurrentCall(
            f"{self._what}.{method} called from thread {threading.current_thread().name!r} "
            f"while another thread (id {self._owner}) is inside {self._what}.{self._method}: "
            f"the tier needs one caller at a time; serialise the calls (one lock around "
            f"every call, or one thread)"
        )


class HasDriverGuard(Protocol):
    _guard: DriverGuard


S = TypeVar("S", bound=HasDriverGuard)


def driver_call(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Run ``method`` inside its object's ``_guard`` (see :class:`DriverGuard`)."""
    name = method.__name__

    @functools.wraps(method)
    def guarded(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        guard = self._guard
        outermost = guard.enter(name)
        try:
            return method(self, *args, **kwargs)
        finally:
            guard.exit(outermost)

    return guarded

"""One driver at a time: the guard that makes a second, concurrent caller of ``P2PTier`` fail
with a clear error instead of corrupting the tier (or crashing libzmq underneath it).

The tier and every transport assume that their public methods are called by **one thread at
a time** (contracts.py). Engines may hand the tier between threads (vLLM calls it from the
scheduler thread and from its tier-poll thread, under one lock); that is allowed. What is not
allowed is two threads inside at once: the second one raises :class:`ConcurrentCall`, naming
both threads and the method the first is in, and touches nothing.

Cost: one uncontended non-blocking lock acquire and release per outermost call; nested calls
(the tier calling its own public methods) only compare a thread id.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from p2pkv.errors import ConcurrentCall

__all__ = ["DriverGuard", "HasDriverGuard", "driver_call"]

P = ParamSpec("P")
R = TypeVar("R")


class DriverGuard:
    """Admits the calls of one thread at a time; a concurrent thread gets ``ConcurrentCall``."""

    __slots__ = ("_depth", "_lock", "_method", "_owner", "_what")

    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._method = ""

    def enter(self, method: str) -> None:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return
        if not self._lock.acquire(blocking=False):
            raise ConcurrentCall(
                f"{self._what}.{method} called from thread {threading.current_thread().name!r} "
                f"while another thread (id {self._owner}) is inside {self._what}.{self._method}: "
                f"the tier needs one caller at a time; serialise the calls (one lock around "
                f"every call, or one thread)"
            )
        self._owner = me
        self._depth = 1
        self._method = method

    def exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()


class HasDriverGuard(Protocol):
    _guard: DriverGuard


S = TypeVar("S", bound=HasDriverGuard)


def driver_call(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Run ``method`` inside its object's ``_guard`` (see :class:`DriverGuard`)."""
    name = method.__name__

    @functools.wraps(method)
    def guarded(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        guard = self._guard
        guard.enter(name)
        try:
            return method(self, *args, **kwargs)
        finally:
            guard.exit()

    return guarded

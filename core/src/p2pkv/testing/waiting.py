"""Bounded waiting for tests: poll a condition until it holds or a deadline passes.

Nothing in the kit sleeps to let things settle. ``wait_until`` calls the pumps (which do I/O:
``poll``/``progress`` of the transports involved) and the condition in a loop; between empty
rounds it yields the CPU briefly, so a peer in another process gets to run on a busy machine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["WaitTimeout", "wait_until"]

T = TypeVar("T")

_IDLE = threading.Event()  # never set: ``wait`` on it is a bounded pause, not a sleep loop
_MAX_PAUSE = 0.002


class WaitTimeout(AssertionError):
    """A condition did not hold within its deadline (an assertion: the transport is too slow
    or never gets there)."""


def wait_until(
    condition: Callable[[], T],
    *,
    timeout: float,
    what: str,
    pumps: Iterable[Callable[[], object]] = (),
) -> T:
    """Return the first truthy value of ``condition()``; ``WaitTimeout`` after ``timeout`` s.

    ``pumps`` are called before each evaluation, in order.
    """
    pumps = tuple(pumps)
    deadline = time.monotonic() + timeout
    pause = 0.0
    while True:
        for pump in pumps:
            pump()
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout}s waiting for {what}")
        if pause:
            _IDLE.wait(pause)
        pause = min(_MAX_PAUSE, pause * 2 or 0.0001)

"""Bounded waiting for tests: poll a condition until it holds or a deadline passes.

Nothing in the kit sleeps to let things settle. ``wait_until`` calls the pumps (which do I/O:
``poll``/``progress`` of the transports involved) and the condition in a loop; between empty
rounds it yields the CPU briefly, so a peer in another process gets to run on a busy machine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

__all__ = ["WaitTimeout", "pumping_in_background", "quietly", "wait_until"]

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


def quietly(fn: Callable[[], object]) -> None:
    """Teardown: close what a test left open without masking the test's own outcome."""
    try:
        fn()
    except Exception:
        pass


class pumping_in_background:
    """Call ``pumps`` on a helper thread while the test thread blocks (e.g. in ``close``).

    Meanwhile the helper thread is the only driver of the pumped transports, so the one-driver
    rule of the contracts holds. The thread stops when the ``with`` block ends.
    """

    def __init__(self, pumps: Sequence[Callable[[], object]]) -> None:
        self._pumps = list(pumps)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2pkv-pump", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pump in self._pumps:
                pump()
            self._stop.wait(0.0005)

    def __enter__(self) -> None:
        if self._pumps:
            self._thread.start()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

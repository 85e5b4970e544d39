"""A deadline heap: timers fire in time order without scanning every request each tick.

Cancelling is O(1) (the entry is disarmed and skipped when it surfaces); the heap is rebuilt
when disarmed entries outnumber live ones, so memory stays proportional to live timers.

Threading: driver thread only.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["Deadlines", "Timer"]


class Timer:
    """One armed deadline; ``cancel`` through :meth:`Deadlines.cancel`."""

    __slots__ = ("arg", "fn", "when")

    def __init__(self, when: float, fn: Callable[[Any], None], arg: Any) -> None:
        self.when = when
        self.fn: Callable[[Any], None] | None = fn
        self.arg = arg

    @property
    def armed(self) -> bool:
        return self.fn is not None


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._live = 0

    def at(self, when: float, fn: Callable[[Any], None], arg: Any = None) -> Timer:
        """Call ``fn(arg)`` from the first ``fire_due(now)`` with ``now >= when``."""
        timer = Timer(when, fn, arg)
        heapq.heappush(self._heap, (when, next(self._seq), timer))
        self._live += 1
        return timer

    def cancel(self, timer: Timer | None) -> None:
        """Disarm ``timer``; a no-op for None or a timer that fired or was cancelled."""
        if timer is None or timer.fn is None:
            return
        timer.fn = None
        timer.arg = None
        self._live -= 1
        if len(self._heap) > 64 and self._live < len(self._heap) // 4:
            self._heap = [e for e in self._heap if e[2].fn is not None]
            heapq.heapify(self._heap)

    def fire_due(self, now: float) -> int:
        """Fire every armed timer due at ``now`` in deadline order (including timers armed by
        the callbacks themselves, if already due). Returns how many fired."""
        fired = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            timer = heapq.heappop(heap)[2]
            fn = timer.fn
            if fn is None:
                continue
            arg = timer.arg
            timer.fn = None
            timer.arg = None
            self._live -= 1
            fired += 1
            fn(arg)
            heap = self._heap  # a callback may have compacted the heap
        return fired

    def next_due(self) -> float | None:
        """When the earliest armed timer fires, or None."""
        while self._heap and self._heap[0][2].fn is None:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return self._live

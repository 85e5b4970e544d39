"""A deadline heap: timers fire in time order without scanning every request each tick.

A timer is its heap entry, the tuple ``(when, seq)``; what it calls is kept by ``seq`` until
it fires or is cancelled. Cancelling is O(1) (the call is dropped; the entry is skipped when
it surfaces) and frees at once everything the garbage collector would have to visit (a
cancelled entry holds two numbers: the collector stops tracking it). The heap is rebuilt
when dead entries outnumber live ones, so memory stays proportional to live timers.

Threading: driver thread only.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

Timer = tuple[float, int]
"""One armed deadline, ``(when, seq)``; cancel it through :meth:`Deadlines.cancel`."""


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[Timer] = []
        self._seq = itertools.count()
        self._calls: dict[int, tuple[Callable[[Any], None], Any]] = {}
        """seq -> (fn, arg) of every armed timer."""

    def at(self, when: float, fn: Callable[[Any], None], arg: Any = None) -> Timer:
        """Call ``fn(arg)`` from the first ``fire_due(now)`` with ``now >= when``."""
        timer = (when, next(self._seq))
        heapq.heappush(self._heap, timer)
        self._calls[timer[1]] = (fn, arg)
        return timer

    def cancel(self, timer: Timer | None) -> None:
        """Disarm ``timer``; a no-op for None or a timer that fired or was cancelled."""
        if timer is None or self._calls.pop(timer[1], None) is None:
            return
        heap = self._heap
        if len(heap) > 64 and len(self._calls) < len(heap) // 4:
            self._heap = [t for t in heap if t[1] in self._calls]
            heapq.heapify(self._heap)

    def fire_due(self, now: float) -> int:
        """Fire every armed timer due at ``now`` in deadline order (including timers armed by
        the callbacks themselves, if already due). Returns how many fired."""
        fired = 0
        heap, calls = self._heap, self._calls
        while heap and heap[0][0] <= now:
            call = calls.pop(heapq.heappop(heap)[1], None)
            if call is None:
                continue
            fired += 1
            call[0](call[1])
            heap = self._heap  # a callback may have compacted the heap
        return fired

    def next_due(self) -> float | None:
        """When the earliest armed timer fires, or None."""
        heap = self._heap
        while heap and heap[0][1] not in self._calls:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def __len__(self) -> int:
        return len(self._calls)

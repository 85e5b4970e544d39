"""Telling a stopped process from a slow tick: a watchdog thread whose own gaps show a stop.

A long gap between two ticks of the tier has two causes that look alike on the tier's
clock. The process was *stopped* (SIGSTOP, a frozen cgroup, a VM migrated): nothing of it
ran, not even the control transport's heartbeat thread, so peers have dropped its sessions.
Or a *call of its own was slow* (a transport that blocked, a long garbage collection): the
process ran all along, its heartbeats went out, and its sessions are alive.

:class:`StopWatch` tells them apart with a light daemon thread (``p2pkv-stop-watch``). It
wakes every ``period`` seconds, reads the tier's clock and notes the gap since its previous
wake-up. A stopped process stops this thread too, so its gap spans the stop; a slow call on
the driver thread does not delay it. The tier asks :meth:`StopWatch.stopped` only when a
tick gap exceeded the silence timeout, so the common path costs nothing.

Why a thread, and not the time spent inside the tier's own calls subtracted from the gap:
a process stopped *inside* one of those calls would then never be noticed, and a tier spends
much of its time in them. The thread sees a stop wherever it falls.

The GIL: each wake-up takes the GIL for a few microseconds (a clock read, a compare, one
read of a ``/proc`` file), ten times a second at most. A waiting thread gets the GIL from a
Python thread within CPython's switch interval (5 ms), so the watchdog keeps beating through
a slow call that runs Python code or releases the GIL (I/O, a sleep, most native calls).

Two cases still delay the watchdog without a stop. On a host short of CPU (load far above
its cores) the driver thread may hold the GIL while it waits for a CPU, and the watchdog
then waits for both. So a gap of the watchdog counts as a stop only if the driver thread was
neither running nor waiting for a CPU for longer than the limit meanwhile: Linux counts both
per thread (``/proc/self/task/<tid>/schedstat``), and a stopped thread does neither. (Where
that file is missing the watchdog's gap alone decides.) And a native call that holds the GIL
while it blocks, longer than the silence timeout, starves the watchdog too and is taken for
a stop: the tier's call guard (:mod:`p2pkv.call_guard`) still logs that call by name.

The thread holds the watch only through a weak reference: a watch that is dropped (its tier
gone without ``shutdown``) ends its thread within one period. After a ``fork`` the child has
no watchdog thread; :meth:`StopWatch.stopped` then starts a new one and, that once, counts
the gap as a stop (the old rule).

Threading: :meth:`stopped` and :meth:`close` from the tier's driver thread; the watchdog
thread only writes ``_stop`` and then ``_latest`` (single assignments, atomic under the
GIL), and the driver reads them in the other order. The watchdog lets go of the GIL inside a
wake-up (reading ``/proc``), often right after a resume, when the driver wants it too: a
driver that saw a wake-up's time before its stop would take the stop for a slow tick.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

_PERIOD_MAX = 0.1
"""The longest the watchdog sleeps (seconds): often enough to see a stop of a fraction of
any silence timeout, rarely enough to cost nothing measurable."""
_PERIOD_MIN = 0.005


def runnable_ns(tid: int) -> int | None:
    """Nanoseconds thread ``tid`` (native id) of this process has spent on a CPU or waiting
    for one, or None when the kernel does not say (no ``schedstat``, no such thread)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as stat:
            on_cpu, waiting = stat.read().split()[:2]
        return int(on_cpu) + int(waiting)
    except (OSError, ValueError):
        return None


_Sample = tuple[float, int, int]
"""A reading of the driver thread: (``clock``, its native id, :func:`runnable_ns`)."""


def watch_period(limit: float) -> float:
    """How often the watchdog wakes for a silence timeout of ``limit`` seconds: a tenth of it,
    within 5..100 ms."""
    return min(_PERIOD_MAX, max(_PERIOD_MIN, limit / 10))


class StopWatch:
    """A watchdog that notices when this process did not run for longer than ``limit``
    seconds of ``clock`` (see the module docstring). ``start=False`` runs no thread: a test
    then calls :meth:`beat` itself. ``runnable`` reads a thread's time on or waiting for a
    CPU (tests replace it)."""

    __slots__ = (
        "__weakref__",
        "_clock",
        "_done",
        "_latest",
        "_runnable",
        "_stop",
        "_thread",
        "driver",
        "limit",
        "period",
    )

    def __init__(
        self,
        clock: Callable[[], float],
        limit: float,
        *,
        start: bool = True,
        runnable: Callable[[int], int | None] = runnable_ns,
    ) -> None:
        self._clock = clock
        self._runnable = runnable
        self.driver = 0
        """The native id of the thread that drives the tier (0: not known yet); set by the
        pause detector on the driver thread."""
        self.limit = limit
        self.period = watch_period(limit)
        self._latest: tuple[float, _Sample | None] = (clock(), None)
        """The watchdog's latest wake-up: when (``clock``), and the driver thread's reading
        then. One tuple, so that the driver reads both of the same wake-up."""
        self._stop: tuple[float, float] | None = None
        """The latest stop it saw: (when it ended, how long it lasted)."""
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._start()

    def beat(self) -> None:
        """One wake-up of the watchdog: note a gap longer than ``limit`` as a stop, unless
        the driver thread was running or waiting for a CPU all along but for ``limit``."""
        now = self._clock()
        (beat, before), sample = self._latest, self._read(now)
        gap = now - beat
        if gap > self.limit and not self._ran(before, sample):
            self._stop = (now, gap)
        self._latest = (now, sample)  # last: a driver that sees this wake-up sees its stop

    def stopped(self, since: float, now: float) -> bool:
        """Whether the process was stopped for longer than ``limit`` after ``since`` (both
        on ``clock``, ``now`` its current reading): a stop the watchdog saw end since then,
        or a watchdog that has not run for longer than ``limit`` (the process just resumed,
        before the watchdog did)."""
        if self._thread is not None and not self._thread.is_alive() and not self._done.is_set():
            self._start()  # after a fork: the gap cannot be told apart, so it counts
            return True
        beat, sample = self._latest  # before the stop: see ``beat``
        stop = self._stop
        if stop is not None and stop[0] > since:
            return True
        if now - beat <= self.limit:
            return False
        return not self._ran(sample, self._read(now))

    def _read(self, now: float) -> _Sample | None:
        tid = self.driver
        ns = self._runnable(tid) if tid else None
        return None if ns is None else (now, tid, ns)

    def _ran(self, before: _Sample | None, after: _Sample | None) -> bool:
        """Whether the driver thread spent all of ``before..after`` on a CPU or waiting for
        one, but for ``limit`` (a stopped thread does neither). False when unknown."""
        if before is None or after is None or before[1] != after[1]:
            return False
        elapsed = after[0] - before[0]
        return elapsed - (after[2] - before[2]) / 1e9 <= self.limit

    def close(self) -> None:
        """End the watchdog thread (within one period; not waited for). Idempotent."""
        self._done.set()

    def _start(self) -> None:
        self._latest = (self._clock(), None)
        self._thread = threading.Thread(
            target=_watch,
            args=(weakref.ref(self), self._done, self.period),
            name="p2pkv-stop-watch",
            daemon=True,
        )
        self._thread.start()


def _watch(ref: weakref.ref[StopWatch], done: threading.Event, period: float) -> None:
    """The watchdog thread: beat every ``period`` until closed or the watch is gone."""
    while not done.wait(period):
        watch = ref()
        if watch is None:
            return
        watch.beat()
        del watch
